"""A prompt's decompressed attention (MHA over K / V expanded from the latent rows) on the AMX-BF16 tiles, or where the
process has none by AVX512-BF16 dot products (unit()): the scores q K^T and the output P V as bf16 products with
fp32 sums (csrc/x86/amx_bf16_bmm.c, x86/avx512_bf16.c: the dot products round once per product, the tiles once per
pair), the masked softmax between them in one C pass that writes P as bf16. The kernel plan takes it where it
already runs the K / V expansion in bf16 (MLAAttention.attention_bf16): K's nope half and V are then bf16 values, so
the products round only q, k_pe and P.

Notation (one group of G heads of B requests, N = B G; u = 2^-8, bf = round to nearest even bfloat16)
  q    [B, G, Q, D]   fp32 queries of one block of Q queries, D = dn + dr; pack_queries -> q_b = bf(scale q)
                      [N, Mp, Dp], read from the layer's q_nope / q_pe through the block's token rows
  K    [B, G, L, D]   keys [k_nope | k_pe]; pack_keys -> the pairs of K_b^T in blocks of 16 keys:
                      int32 [N, Lp / 16, Dp / 2, 16]
  V    [B, G, L, dv]  values; pack_values -> the pairs of V_b: int32 [N, Lp / 2, dvp] (seen as [N, dvp / 16,
                      Lp / 2, 16])
                      (Lp, Dp, dvp, Mp: rounded up to 32 with zeros, which add nothing to any sum)
  S    [N, Mp, n']    fp32 = q_b K_b^T over the block's keys (n = key_ends, n' rounded up to 32; padded keys and
                      query rows are zeros, padded keys masked), sums in fp32 in the unit
  P    = softmax(S over the keys the mask allows) in fp32, P_b = bf(P): one C pass per row (max, exp within 2 ulp,
                      sum, scale, round; csrc/x86/avx512_bf16.c mls_softmax_bf16), padded rows and keys 0
  O    [B, Q, G, dv]  fp32 = P_b V_b
Error against the fp32 attention: the rounding of q, k_pe and P (u / 2 relative each) and the fp32 sums; the same
grade as the bf16 prefill products around it (docs/FORMATS.md's rule; tests/identities/test_attention_backends.py
holds the backend's output within BF16_TOL of the fp32 reference's, tests/kernels/test_bf16_attention.py the
products against fp64). Queries are independent: a query's output does not depend on the block, batch or threads.
"""

from __future__ import annotations

import torch

from mlaserve.kernels import bf16_pairs, native

TILE = 32  # rows, columns and depth of the kernel's blocks: every operand is padded to a multiple


UNITS = {2: "amx-bf16 tiles", 1: "avx512-bf16 dot products"}  # csrc mls_bf16_bmm_unit's answers, in words


def unit() -> int:
    """Which unit runs the products in this process (csrc/x86/amx_bf16_bmm.c mls_bf16_bmm_unit): 2 the AMX-BF16 tiles
    (the build has them and the kernel granted the tile state), 1 AVX512-BF16 dot products (x86/avx512_bf16.c: the
    build has AVX512-BF16 but no granted tiles), 0 neither."""
    lib = native.library()
    return lib.mls_bf16_bmm_unit() if lib is not None else 0


def granted() -> bool:
    """Whether this process runs them (on either unit)."""
    return unit() != 0


def unit_detail() -> str:
    """In words, for the kernel plan: the unit, or why neither."""
    u = unit()
    return UNITS[u] if u else f"no bf16 attention unit ({bf16_pairs.tiles_detail()}, and no avx512_bf16 in the build)"


def _up(n: int) -> int:
    return -(-n // TILE) * TILE


def pack_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """K = [k_nope | k_pe]: k_nope [B, G, L, dn], k_pe [B, 1 or G, L, dr] (any strides, any float dtype: k_nope
    rounded to bf16 and k_pe read as fp32 where they are not already) -> int32 [B G, Lp / 16, Dp / 2, 16]: per block
    of 16 keys, row p holds each key's values 2p and 2p + 1 as bf16 (the tiles' pair layout of K^T, a tile's 16 rows
    in one 1 KiB run), keys past L and values past D zero (Dp = D rounded up to 32). One C pass
    (csrc/attention_pack.c), the bits of torch's padded copy and transpose (a NaN stays a NaN)."""
    b, g, length, dn = k_nope.shape
    dr = k_pe.shape[-1]
    kn = _last_contiguous(k_nope.to(torch.bfloat16))
    kp = _last_contiguous(k_pe.float()).expand(b, g, length, dr)  # a k_pe shared by the heads: head stride 0
    lp, dp = _up(length), _up(dn + dr)
    out = torch.empty(b * g, lp // 16, dp // 2, 16, dtype=torch.int32)
    rc = native.library().mls_pack_keys_bf16(
        kn.data_ptr(), dn, *kn.stride()[:3], kp.data_ptr(), dr, *kp.stride()[:3], b, g, length, out.data_ptr(), lp,
        dp, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native bf16 key pack failed (rc {rc})")
    return out


def pack_values(v: torch.Tensor, finite: bool) -> torch.Tensor:
    """v [B, G, L, dv] (any strides, any float dtype: rounded to bf16 where it is not) -> int32 [B G, dvp / 16, Lp /
    2, 16], a view of [B G, Lp / 2, dvp]: row p holds, per column, keys 2p and 2p + 1's values as bf16, keys past L
    zero (a padded key's probability is 0), columns past dv zero (dvp = dv rounded up to 32; attention() drops them).
    finite: non-finite values zeroed (a query's masked later rows have probability 0, and 0 x NaN = NaN:
    attention/backends/blocks.py finite_values). One C pass (csrc/attention_pack.c), the bits of torch's copies."""
    b, g, length, dv = v.shape
    vb = _last_contiguous(v.to(torch.bfloat16))
    lp, dvp = _up(length), _up(dv)
    pairs = torch.empty(b * g, lp // 2, dvp, dtype=torch.int32)
    rc = native.library().mls_pack_values_bf16(
        vb.data_ptr(), dv, *vb.stride()[:3], b, g, length, int(finite), pairs.data_ptr(), lp, dvp,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native bf16 value pack failed (rc {rc})")
    return pairs.view(b * g, lp // 2, dvp // 16, 16).transpose(1, 2)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last axis is contiguous (the C packs' rows), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def bmm(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """a [N, M, K] bf16 contiguous (M, K multiples of 32), b [N, column blocks, pair rows, 16] int32 pairs (any
    strides but the last; its first n columns, n a multiple of 32, and first K / 2 pair rows) -> [N, M, n] fp32 = a
    times the matrix b packs, fp32 sums."""
    batch, m, k = a.shape
    assert a.dtype == torch.bfloat16 and a.is_contiguous() and b.dtype == torch.int32 and b.stride(3) == 1
    assert k // 2 <= b.shape[2] and n <= 16 * b.shape[1] and b.shape[3] == 16, (a.shape, b.shape, n)
    c = torch.empty(batch, m, n, dtype=torch.float32)
    rc = native.library().mls_bf16_bmm(
        a.data_ptr(), batch, m, k, k, m * k, b.data_ptr(), n, b.stride(2), b.stride(1), b.stride(0), c.data_ptr(),
        n, m * n, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native bf16 attention product failed (rc {rc}: {unit_detail()})")
    return c


def pack_queries(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """A block of queries of a group of G heads as the scores' left operand: q_nope [T, G, dn], q_pe [T, G, dr] fp32 (a
    head's values contiguous; any token and head strides: the layer's halves where they lie), rows [B, Q] their
    token rows -> q_b [B G, Mp, Dp] bf16 = bf(scale [q_nope | q_pe]) of token rows[b, i], rows past Q and values past
    dn + dr zero (csrc/attention_pack.c: one pass, the bits of (q * scale).bfloat16())."""
    b, nq = rows.shape
    g, dn, dr = q_nope.shape[1], q_nope.shape[2], q_pe.shape[2]
    assert q_nope.dtype == q_pe.dtype == torch.float32 and q_nope.stride(2) == 1 and q_pe.stride(2) == 1
    assert q_pe.shape[:2] == q_nope.shape[:2] and rows.dtype == torch.int64
    out = torch.empty(b * g, _up(nq), _up(dn + dr), dtype=torch.bfloat16)
    rows = rows.contiguous()
    rc = native.library().mls_pack_queries_bf16(
        q_nope.data_ptr(), dn, q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(), dr, q_pe.stride(0),
        q_pe.stride(1), rows.data_ptr(), b, nq, g, scale, out.data_ptr(), out.shape[1], out.shape[2],
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native bf16 query pack failed (rc {rc})")
    return out


def attention(
    qb: torch.Tensor, b: int, nq: int, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, n: int, dv: int
) -> torch.Tensor:
    """One block of nq queries of b requests: qb [B G, Mp, Dp] (pack_queries: scaled, rounded, padded), keys /
    values packed (pack_keys / pack_values), mask [B, Q, n] over the block's first n keys -> O [B, Q, G, dv] fp32
    (a view)."""
    g, mp, npad = qb.shape[0] // b, qb.shape[1], _up(n)
    scores = bmm(qb, keys, npad)
    probs = torch.empty(b * g, mp, npad, dtype=torch.bfloat16)
    mask = mask.contiguous()
    rc = native.library().mls_softmax_bf16(
        scores.data_ptr(), b, g, mp, npad, mask.data_ptr(), nq, n, probs.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native bf16 softmax failed (rc {rc}: {unit_detail()})")
    out = bmm(probs, values, 16 * values.shape[1]).view(b, g, mp, -1)
    return out[:, :, :nq, :dv].transpose(1, 2)

"""int8 activations for the K-quants (Q4_K, Q5_K, Q6_K) against an independent numpy reference.

The reference follows llama.cpp, not our C: quantize_row_q8_K_ref (per 256 values: iscale = -127 / max, max the
value of largest magnitude, codes nearest(iscale * x) capped at 127, d = 1 / iscale, code sums), the weight's
integer codes and sub-block scales read from the ggml layout (checked against gguf-py's dequantizer, a third
party's code), the exact integer sums of code products per super-block, and the float arithmetic the kernels
document per super-block and row (csrc/x86/avx2.c): y += (d_w * d_x) * S, y -= (dmin * d_x) * M. Every float
step is a single IEEE fp32 operation, so the kernels must equal the reference EXACTLY (bit for bit), in every build
this CPU runs (VNNI, AVX2 maddubs, scalar), at 1-16 rows, and a row's result is the same whatever rows share its
call (batch independence). Separately, the int8 result is within the activation-quantization bound of the exact
float product: each activation moves by at most |d_x| / 2, so |y - y_exact| <= sum_j |w_j| |d_x(j)| / 2, plus
the fp32 rounding of both sides (2 K u sum |x w|, the summation-order bound test_kernels.py derives).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import grid_blocks

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
U = 2.0**-24
F32 = np.float32


def _blocks(name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name]
    nb = k // 256
    raw = torch.randint(0, 256, (rows, nb, size), dtype=torch.uint8, generator=g)
    offs = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[name]
    for off in offs:
        d = (torch.rand(rows, nb, generator=g) * 0.02 + 0.001).half()
        raw[..., off : off + 2] = d.view(torch.uint8).view(rows, nb, 2)
    return raw.flatten(-2).contiguous()


# ---------------------------------------------------------------- the reference (numpy, llama.cpp's definitions)


def q8k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_K_ref: x [M, K] fp32 -> codes [M, K] int8, d [M, K/256] fp32, bsums per 32
    values [M, K/32] (llama.cpp keeps them per 16; the K-quants with mins read pairs of them)."""
    m, k = x.shape
    xb = x.reshape(m, k // 256, 256).astype(F32)
    ax = np.abs(xb)
    first = ax.argmax(-1)[..., None]  # the first of equal magnitudes (llama.cpp: `if (ax > amax)`)
    mx = np.take_along_axis(xb, first, -1)[..., 0]
    amax = ax.max(-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, F32(-127.0) / np.where(amax > 0, mx, F32(1)), F32(0)).astype(F32)
    v = np.rint(iscale[..., None] * xb)  # nearest_int: round half to even
    q = np.minimum(F32(127), v).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, F32(1)), F32(0)).astype(F32)
    bsum = q.reshape(m, k // 32, 32).astype(np.int64).sum(-1)
    return q.reshape(m, k), d, bsum


def f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(F32)[..., 0]


def kquant_codes(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, R] -> (codes [N, nb, 256] int64, scales [N, nb, G] int64 per sub-block, mins [N, nb, G] int64 (0 for
    Q6_K), d [N, nb] fp32, dmin [N, nb] fp32), from ggml's block layout (get_scale_min_k4, the Q5_K high bits,
    the Q6_K interleave): value = d * scale * code - dmin * min (Q6_K: d * scale * code, codes minus 32)."""
    n = raw.shape[0]
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name]
    b = raw.reshape(n, -1, size).astype(np.int64)
    nb = b.shape[1]
    if name == "Q6_K":
        ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208]
        sc = np.where(sc > 127, sc - 256, sc)
        codes = np.zeros((n, nb, 256), dtype=np.int64)
        for t in range(256):
            h, r = t >> 7, t & 127
            lo = (ql[..., h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15
            hi = (qh[..., h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3
            codes[..., t] = (lo | (hi << 4)) - 32
        d = f16(raw.reshape(n, nb, size)[..., 208:210])
        return codes, sc, np.zeros_like(sc), d, np.zeros_like(d)
    s = b[..., 4:16]
    sc = np.zeros((n, nb, 8), dtype=np.int64)
    mn = np.zeros((n, nb, 8), dtype=np.int64)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc[..., j] = (s[..., j + 4] & 0x0F) | ((s[..., j - 4] >> 6) << 4)
            mn[..., j] = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
    qs = b[..., 48:176] if name == "Q5_K" else b[..., 16:144]
    codes = np.zeros((n, nb, 256), dtype=np.int64)
    for j in range(8):
        q = (qs[..., (j // 2) * 32 : (j // 2) * 32 + 32] >> (4 * (j & 1))) & 15
        if name == "Q5_K":
            q = q | (((b[..., 16:48] >> j) & 1) << 4)
        codes[..., 32 * j : 32 * j + 32] = q
    d = f16(raw.reshape(n, nb, size)[..., 0:2])
    dmin = f16(raw.reshape(n, nb, size)[..., 2:4])
    return codes, sc, mn, d, dmin


def int8_product_reference(raw: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """y [M, N]: x quantized as llama.cpp does, exact integer sums per super-block, then the documented fp32
    operations (each a single IEEE rounding, which numpy's float32 scalars reproduce)."""
    q, dx, bsum = q8k_reference(x.numpy())
    codes, sc, mn, d, dmin = kquant_codes(raw.numpy(), name)
    n, nb = d.shape
    m = q.shape[0]
    group = 16 if name == "Q6_K" else 32
    qb = q.astype(np.int64).reshape(m, nb, 256 // group, group)
    cb = codes.reshape(n, nb, 256 // group, group)
    sub = np.einsum("nbgl,mbgl->mnbg", cb, qb)  # exact int64 sums per sub-block
    s_int = (sub * sc[None]).sum(-1)  # [M, N, nb]
    m_int = (mn[None] * bsum.reshape(m, 1, nb, 8)).sum(-1) if name != "Q6_K" else None
    y = np.zeros((m, n), dtype=F32)
    for i in range(m):
        for r in range(n):
            acc = F32(0)
            for blk in range(nb):
                acc = F32(acc + F32(F32(d[r, blk] * dx[i, blk]) * F32(s_int[i, r, blk])))
                if m_int is not None:
                    acc = F32(acc - F32(F32(dmin[r, blk] * dx[i, blk]) * F32(m_int[i, r, blk])))
            y[i, r] = acc
    return torch.from_numpy(y)


# ---------------------------------------------------------------- the tests


def test_reference_codes_decode_as_gguf_py():
    """The reference's integer codes and scales give gguf-py's dequantized values exactly (so the reference reads
    the layout as llama.cpp does, independently of our C and torch decoders)."""
    gguf = pytest.importorskip("gguf")
    for name in KQUANTS:
        raw = _blocks(name, 6, 512, seed=3)
        codes, sc, mn, d, dmin = kquant_codes(raw.numpy(), name)
        group = 16 if name == "Q6_K" else 32
        dd = (d[..., None] * sc.astype(F32)).astype(F32).repeat(group, -1)
        if name == "Q6_K":
            vals = (dd * codes.astype(F32)).astype(F32)
        else:
            dm = (dmin[..., None] * mn.astype(F32)).astype(F32).repeat(group, -1)
            vals = (dd * codes.astype(F32) - dm).astype(F32)
        want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).astype(F32)
        assert np.array_equal(vals.reshape(6, -1), want), name


def _special_x(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with the edge cases of q8_K: an all-zero super-block, equal magnitudes of opposite sign (the
    first decides the scale's sign), a positive and a negative largest value, exact halves after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, :256] = 0.0
    if rows > 1:
        x[1, 256:512] = torch.randn(256, generator=g).clamp(-1, 1)
        x[1, 300], x[1, 280] = -3.0, 3.0  # equal magnitudes: 280 comes first, positive max
    if rows > 2:
        x[2, :256] = torch.arange(256, dtype=torch.float32) - 127.0  # iscale -1: integers, and -127 the max
        x[2, 0] = 127.0
    return x


@needs_native
@pytest.mark.parametrize("name", KQUANTS)
def test_activation_quantization_is_llama_cpp_q8_k(name):
    t = GGML_TYPE_IDS[name]
    x = _special_x(5, 768, seed=4)
    q, slots = native.quantize_act(t, x)
    want_q, want_d, want_bsum = q8k_reference(x.numpy())
    assert np.array_equal(q.numpy(), want_q)
    meta = slots.view(5, 3, 8)  # per super-block: d, then 8 int16 sums in the next 4 slots (common.h q8k_meta)
    assert np.array_equal(meta[..., 0].numpy(), want_d)
    got_bsum = meta[..., 1:5].contiguous().view(torch.int16).reshape(5, 24).numpy()
    assert np.array_equal(got_bsum, want_bsum)
    assert want_d[1, 1] < 0 and want_d[0, 0] == 0  # the cases _special_x makes are really there
    with pytest.raises(RuntimeError, match="refused"):
        native.quantize_act(t, x[:, :288])  # not whole super-blocks


def _with_build(monkeypatch, flags: tuple[str, ...]) -> str:
    lib, detail = native_build._build(flags)
    assert lib is not None, detail
    monkeypatch.setitem(native_build._state, "lib", lib)
    return native.int8_isa()


def _builds() -> list[tuple[str, ...]]:
    builds = [()]
    if "avx512_vnni" in cpu_flags():  # AVX-512 without VNNI: the one-row products' 16 rows with vpmaddwd (rows16_q8k)
        builds.append(("-mno-avx512vnni",))
    if "avx512f" in cpu_flags():
        builds.append(("-mno-avx512f",))  # AVX2: vpmaddubsw + vpmaddwd instead of vpdpbusd
    builds.append(("-mno-avx512f", "-mno-avx2", "-mno-f16c"))  # no SIMD
    return builds


@needs_native
@pytest.mark.parametrize("name", KQUANTS)
def test_int8_products_equal_the_reference_exactly_in_every_build(name, monkeypatch):
    """gemm at 1-16 rows and the grouped gemm, bit for bit equal to the reference, in each build; a row's result
    does not depend on the rows that share its call."""
    t, k, n = GGML_TYPE_IDS[name], 768, 19
    raw = _blocks(name, n, k, seed=5)
    x = _special_x(16, k, seed=6)
    want = int8_product_reference(raw, name, x)
    seen = []
    for flags in _builds():
        seen.append(_with_build(monkeypatch, flags))
        for rows in (1, 2, 3, 4, 5, 8, 13, 16):
            got = native.gemm(t, x[:rows].contiguous(), raw, k, int8=True)
            assert torch.equal(got, want[:rows]), (seen[-1], rows)
        for start in (3, 7):  # the same row inside other batches
            got = native.gemm(t, x[start : start + 5].contiguous(), raw, k, int8=True)
            assert torch.equal(got, want[start : start + 5]), (seen[-1], start)
        for n_rows in (9, 10, 14):  # one activation row: weight rows 4 at a time, then 1, 2 or 3 (a decode step)
            got = native.gemm(t, x[5:6].contiguous(), raw[:n_rows].contiguous(), k, int8=True)
            assert torch.equal(got, want[5:6, :n_rows]), (seen[-1], n_rows)
        stacked = torch.stack([raw, _blocks(name, n, k, seed=7)])
        experts, starts = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 9, 10])
        ys = native.grouped_gemm(t, x[:10].contiguous(), stacked, k, experts, starts, int8=True)
        assert torch.equal(ys[4:9], want[4:9])
        assert torch.equal(ys[:4], int8_product_reference(stacked[1], name, x[:4]))
        assert torch.equal(ys[9:10], int8_product_reference(stacked[1], name, x[9:10]))  # a group of one row
    assert len(set(seen)) >= 2, seen  # builds that differ (AVX-512 without VNNI names its dot products as AVX2's)


@needs_native
def test_q4_0_products_equal_the_row_kernel_in_every_build(monkeypatch):
    """On AVX-512, Q4_0 at one activation row takes 16 weight rows side by side (x86/rows16_q8k.c rows16_q4_0) and at 2
    or more rows two activation rows per vector over pairs of weight rows (q4_0_pairs_rows), both with the unsigned
    nibbles' sums less 8 x the activation codes' sum; the row kernel elsewhere (x86/avx2.c, ref/int8.c) and in grouped
    calls. Every row's 8 float lanes and fma chain are the row kernel's, so every row count (1-40: odd counts leave a
    pair half empty, past 16 the rows come in chunks of 16) and a grouped call give the same bits, in every build
    (AVX-512 with and without VNNI, AVX2, scalar), and the builds equal each other; odd weight-row counts too."""
    t, k, n = GGML_TYPE_IDS["Q4_0"], 512, 37
    g = torch.Generator().manual_seed(21)
    raw = torch.randint(0, 256, (n, k // 32, 18), dtype=torch.uint8, generator=g)
    raw[..., 0:2] = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().view(torch.uint8).view(n, -1, 2)
    raw = raw.flatten(-2).contiguous()
    x = torch.cat([_special_x(16, k, seed=22), _special_x(24, k, seed=23)])
    seen, results = [], []
    for flags in _builds():
        seen.append(_with_build(monkeypatch, flags))
        full = native.gemm(t, x, raw, k, int8=True)  # 40 activation rows: chunks of 16, 16 and 8
        for i in (0, 5, 15, 39):
            assert torch.equal(native.gemm(t, x[i : i + 1].contiguous(), raw, k, int8=True), full[i : i + 1]), seen[-1]
        for rows in (2, 3, 7, 16, 17, 33):
            got = native.gemm(t, x[1 : 1 + rows].contiguous(), raw, k, int8=True)
            assert torch.equal(got, full[1 : 1 + rows]), (seen[-1], rows)
        got = native.gemm(t, x[:5].contiguous(), raw[:7].contiguous(), k, int8=True)  # odd weight rows, 5 activations
        assert torch.equal(got, full[:5, :7]), seen[-1]
        for n_rows in (1, 2, 3, 15, 16, 17):
            got = native.gemm(t, x[3:4].contiguous(), raw[:n_rows].contiguous(), k, int8=True)
            assert torch.equal(got, full[3:4, :n_rows]), (seen[-1], n_rows)
        experts, starts = torch.tensor([1, 0]), torch.tensor([0, 1, 6])
        stacked = torch.stack([raw, raw.flip(0).contiguous()])
        ys = native.grouped_gemm(t, x[:6].contiguous(), stacked, k, experts, starts, int8=True)
        assert torch.equal(ys[1:6], full[1:6])
        assert torch.equal(ys[0:1], native.gemm(t, x, raw.flip(0).contiguous(), k, int8=True)[0:1])  # a group of one
        results.append(full)
    assert len(set(seen)) >= 2, seen
    for flags, r in zip(seen[1:], results[1:]):
        assert torch.equal(r, results[0]), (seen[0], flags)


@needs_native
@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("rows", [1, 16])
def test_int8_products_within_the_activation_bound(name, rows):
    """|y_int8 - y_exact| <= sum_j |w_j| |d_x(j)| / 2 + fp32 rounding; and the int8 path really ran (not equal to
    the float product)."""
    t, k = GGML_TYPE_IDS[name], 1024
    raw = _blocks(name, 40, k, seed=8)
    w = ggml.dense(raw, t, k).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    _, dx, _ = q8k_reference(x.numpy())
    step = torch.from_numpy(np.abs(dx)).double().repeat_interleave(256, 1) / 2  # [M, K]
    exact = x.double() @ w.T
    bound = step @ w.abs().T + 2 * k * U * (x.double().abs() @ w.abs().T)
    got = ggml.linear(x, raw, t, k, kernel="native", int8=True).double()
    assert ((got - exact).abs() <= bound).all()
    assert not torch.allclose(got, exact, rtol=1e-6, atol=0)
    ratio = ((got - exact).abs() / bound).max().item()
    print(f"\n{name} rows {rows}: worst |y - exact| / bound {ratio:.3f}")


@needs_native
def test_int8_setting_caps_the_weight_bits():
    """int8=6 (activations="auto"): the K-quants and Q4_0 take int8 activations, Q8_0 stays exact; int8=True every
    type with an int8 kernel."""
    assert native.takes_int8(GGML_TYPE_IDS["Q6_K"], 6) and native.takes_int8(GGML_TYPE_IDS["Q4_0"], 6)
    assert not native.takes_int8(GGML_TYPE_IDS["Q8_0"], 6) and native.takes_int8(GGML_TYPE_IDS["Q8_0"], True)
    assert not native.takes_int8(GGML_TYPE_IDS["Q3_K"], True)  # no int8 kernel: float
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 256, generator=g)
    raw = _blocks("Q4_K", 8, 256, seed=11)
    t = GGML_TYPE_IDS["Q4_K"]
    assert torch.equal(native.gemm(t, x, raw, 256, int8=6), int8_product_reference(raw, "Q4_K", x))
    assert torch.equal(native.gemm(t, x, raw, 256, int8=3), native.gemm(t, x, raw, 256))
    assert not torch.equal(native.gemm(t, x, raw, 256, int8=6), native.gemm(t, x, raw, 256))


@needs_native
@pytest.mark.parametrize("type_id", sorted(native.Q8_ACTIVATION_TYPES))
def test_a_rows_int8_result_does_not_depend_on_its_batch(type_id):
    """Every int8 kernel (the 32-value types and IQ4_XS too): row i of a 1-16 row call is bit for bit its result alone (one request's
    result independent of the batch it rides in)."""
    name = GGML_TYPES[type_id].name
    k = 512
    if name in KQUANTS:
        raw = _blocks(name, 11, k, seed=14)
    elif name.startswith(("IQ1", "IQ2", "IQ3")):
        raw = grid_blocks(name, 11, k, seed=14)
    else:
        g = torch.Generator().manual_seed(14)
        t = GGML_TYPES[type_id]
        raw = torch.randint(0, 256, (11, k // t.block_size, t.type_size), dtype=torch.uint8, generator=g)
        for off in (0, 2) if name in ("Q4_1", "Q5_1") else (0,):  # finite fp16 d (and Q4_1 / Q5_1's m)
            d = (torch.rand(11, k // t.block_size, generator=g) * 0.02 + 0.001).half()
            raw[..., off : off + 2] = d.view(torch.uint8).view(11, -1, 2)
        raw = raw.flatten(-2).contiguous()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(15))
    alone = torch.cat([native.gemm(type_id, x[i : i + 1].contiguous(), raw, k, int8=True) for i in range(16)])
    for rows in (2, 5, 16):
        assert torch.equal(native.gemm(type_id, x[:rows].contiguous(), raw, k, int8=True), alone[:rows]), rows

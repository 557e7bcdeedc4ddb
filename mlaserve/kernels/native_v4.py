"""The native kernels' entries for DeepSeek-V4's own ops (and GLM-5.3-Flash's mHC): the attention with per-head sinks
over a step's gathered keys (csrc/attention.c mls_sink_mqa, on the latent MQA's driver), the rope of interleaved
trailing pairs (csrc/glue.c mls_rope_pairs; with the rows' RMSNorm before it, mls_norm_rope_pairs) and a
hyper-connection's mixing and new streams (csrc/hyper.c mls_hc_pre, mls_hc_post). The models bind them through the KernelPlan (ops sink_attention, hyper_connection:
models/deepseek_v4/attention.py, hyper.py); the tests hold them to the torch forms (tests/kernels/
test_sink_mqa_kernel.py, test_rope_pairs_kernel.py, test_hc_pre_kernel.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from mlaserve.kernels.native import library


def sink_mqa(
    q: torch.Tensor, q_index: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """DeepSeek-V4's attention in one C call (csrc/attention.c mls_sink_mqa): q [T, H, D] the step's rows, q_index
    [B, S] int64 the row of each query of the step's padded layout (-1 on pad slots), keys [B, K, D] (one shared
    K=V head per sequence), mask [B, S, K] bool, sinks [H], all fp32 CPU and contiguous -> [T, H, D]: row
    q_index[b, i] = softmax over [scale q . keys[b] | sink_h] (the sink column dropped) @ keys[b], over the allowed
    keys only (the masked ones are never read); a query with no allowed key gives zeros. Every row of q must be
    named by one query (the rows of out no query names are not written)."""
    t, h, d = q.shape
    b, s = q_index.shape
    k = keys.shape[1]
    if not all(x.is_contiguous() for x in (q, q_index, keys, mask, sinks)) or q_index.dtype != torch.int64:
        raise ValueError("sink_mqa: q, q_index (int64), keys, mask and sinks must be contiguous")
    if keys.shape != (b, k, d) or mask.shape != (b, s, k) or sinks.shape != (h,) or mask.dtype != torch.bool:
        raise ValueError(
            f"sink_mqa: q {tuple(q.shape)}, q_index {tuple(q_index.shape)}, keys {tuple(keys.shape)}, "
            f"mask {tuple(mask.shape)} bool, sinks [H]"
        )
    slots = torch.arange(b * k, dtype=torch.int64).view(b, k)  # key j of sequence b is row b * K + j of keys
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = library().mls_sink_mqa(
        q.data_ptr(), h * d, d, q_index.data_ptr(), keys.data_ptr(), slots.data_ptr(), mask.data_ptr(), b, s, k, h,
        d, scale, sinks.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native sink_mqa failed (rc {rc})")
    return out


@dataclass(frozen=True)
class KeyParts:
    """A step's keys [B, K, d] not copied: key j of sequence b is row direct[b, j] = (part, row) of parts[part]
    (fp32 contiguous [rows_p, d] matrices: the ring cache, the step's K=V rows, the paged pool, the rows the step
    closed, a zero row; step_keys.py LayerKeys.direct). sink_mqa_parts reads them where they lie; gather() copies
    them into the tensor the other consumers take."""

    parts: tuple[torch.Tensor, ...]
    direct: torch.Tensor  # [B, K, 2] int64

    def gather(self) -> torch.Tensor:
        return gather_rows(list(self.parts), self.direct)


def _parts_args(parts: tuple[torch.Tensor, ...] | list[torch.Tensor], part_row: torch.Tensor, what: str) -> tuple:
    """(bases, rows, d) for a C call over rows of several matrices, after the checks both such calls share."""
    d = parts[0].shape[-1]
    if not all(p.dtype == torch.float32 and p.dim() == 2 and p.shape[1] == d and p.is_contiguous() for p in parts):
        raise ValueError(f"{what}: parts must be contiguous fp32 [rows, {d}]")
    if part_row.dtype != torch.int64 or part_row.shape[-1] != 2 or not part_row.is_contiguous():
        raise ValueError(f"{what}: part_row must be contiguous int64 [..., 2]")
    bases = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    return bases, torch.tensor([p.shape[0] for p in parts], dtype=torch.int64), d


def sink_mqa_parts(
    q: torch.Tensor, q_index: torch.Tensor, keys: KeyParts, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """sink_mqa over keys read where they lie (csrc/attention.c mls_sink_mqa_parts): the same rows in the same order
    as sink_mqa(q, q_index, keys.gather(), ...), so the same bits, without the copy. A (part, row) pair outside
    the parts is an error (nothing read)."""
    t, h, d = q.shape
    b, s = q_index.shape
    k = keys.direct.shape[1]
    bases, rows, width = _parts_args(keys.parts, keys.direct, "sink_mqa_parts")
    if not all(x.is_contiguous() for x in (q, q_index, mask, sinks)) or q_index.dtype != torch.int64:
        raise ValueError("sink_mqa_parts: q, q_index (int64), mask and sinks must be contiguous")
    if width != d or keys.direct.shape != (b, k, 2) or mask.shape != (b, s, k) or sinks.shape != (h,):
        raise ValueError(
            f"sink_mqa_parts: q {tuple(q.shape)}, q_index {tuple(q_index.shape)}, rows of {width}, "
            f"direct {tuple(keys.direct.shape)}, mask {tuple(mask.shape)}, sinks [H]"
        )
    if mask.dtype != torch.bool:
        raise ValueError("sink_mqa_parts: mask must be bool")
    out = torch.empty(t, h, d, dtype=torch.float32)
    rc = library().mls_sink_mqa_parts(
        q.data_ptr(), h * d, d, q_index.data_ptr(), bases, rows.data_ptr(), len(keys.parts), keys.direct.data_ptr(),
        mask.data_ptr(), b, s, k, h, d, scale, sinks.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc in (-2, -3):
        raise RuntimeError(f"native sink_mqa_parts refused a {'part' if rc == -2 else 'row'} outside the parts given")
    if rc != 0:
        raise RuntimeError(f"native sink_mqa_parts failed (rc {rc})")
    return out


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """DeepSeek-V4's rope in place (csrc/glue.c mls_rope_pairs): x [T, ..., W] fp32 contiguous, its trailing
    2 * cos.shape[-1] values per row rotated as interleaved pairs by cos, sign * sin [T, d / 2] (fp32, contiguous);
    the same bits as models/deepseek_v4/rope.rotate_trailing. -> x."""
    t, w, half = x.shape[0], x.shape[-1], cos.shape[-1]
    if not all(v.is_contiguous() and v.dtype == torch.float32 for v in (x, cos, sin)) or cos.shape != (t, half):
        raise ValueError(f"rope_pairs: x {tuple(x.shape)}, cos {tuple(cos.shape)} fp32 contiguous, [T, d / 2]")
    rc = library().mls_rope_pairs(
        x.data_ptr(), t, x.numel() // (t * w) if t else 0, w, 2 * half, cos.data_ptr(), sin.data_ptr(), sign,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native rope_pairs refused d={2 * half}, W={w}")
    return x


def norm_rope_pairs(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """DeepSeek-V4's query heads or K=V rows finished in place in one call (csrc/glue.c mls_norm_rope_pairs): x
    [T, ..., W] fp32 contiguous, each row of W values RMS-normalised (by `weight` [W] fp32 contiguous, or unweighted
    where None), then its trailing 2 * cos.shape[-1] values rotated as rope_pairs does. Equal to rope_pairs after
    the torch norm up to the rounding of the sum of squares (fp32). -> x."""
    t, w, half = x.shape[0], x.shape[-1], cos.shape[-1]
    if not all(v.is_contiguous() and v.dtype == torch.float32 for v in (x, cos, sin)) or cos.shape != (t, half):
        raise ValueError(f"norm_rope_pairs: x {tuple(x.shape)}, cos {tuple(cos.shape)} fp32 contiguous, [T, d / 2]")
    if weight is not None and (weight.shape != (w,) or weight.dtype != torch.float32 or not weight.is_contiguous()):
        raise ValueError(f"norm_rope_pairs: weight {tuple(weight.shape)} {weight.dtype}, want [{w}] fp32 contiguous")
    rc = library().mls_norm_rope_pairs(
        x.data_ptr(), t, x.numel() // (t * w) if t else 0, w, weight.data_ptr() if weight is not None else None, eps,
        2 * half, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native norm_rope_pairs refused d={2 * half}, W={w}")
    return x


def hc_pre(
    h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An mHC hyper-connection's mixing weights and sublayer input in one C call (csrc/hyper.c mls_hc_pre): h
    [S, N, D], fn [(2+N)N, N*D], base [(2+N)N], scale [3], all fp32 CPU contiguous -> post [S, N], comb [S, N, N],
    x [S, D] (models/deepseek_v4/hyper.py HyperConnection's)."""
    s, n, d = h.shape
    if not all(t.is_contiguous() and t.dtype == torch.float32 for t in (h, fn, base, scale)):
        raise ValueError("hc_pre: h, fn, base and scale must be contiguous fp32")
    if fn.shape != ((2 + n) * n, n * d) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"hc_pre: h {tuple(h.shape)}, fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale [3]")
    post, comb, x = torch.empty(s, n), torch.empty(s, n, n), torch.empty(s, d)
    rc = library().mls_hc_pre(
        h.data_ptr(), s, n, d, fn.data_ptr(), base.data_ptr(), scale.data_ptr(), eps, norm_eps, iters,
        post.data_ptr(), comb.data_ptr(), x.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native hc_pre failed (rc {rc}: -1 more than 16 streams or no Sinkhorn pass)")
    return post, comb, x


def hc_post(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A hyper-connection's new streams in one C call (csrc/hyper.c mls_hc_post): post [S, N], comb [S, N, N], y [S, D],
    h [S, N, D], all fp32 CPU contiguous -> [S, N, D] = post_k y + sum_j comb[j, k] h_j (hyper.py expand)."""
    s, n, d = h.shape
    if not all(t.is_contiguous() and t.dtype == torch.float32 for t in (post, comb, y, h)):
        raise ValueError("hc_post: post, comb, y and h must be contiguous fp32")
    if post.shape != (s, n) or comb.shape != (s, n, n) or y.shape != (s, d):
        raise ValueError(
            f"hc_post: h {tuple(h.shape)}, post {tuple(post.shape)}, comb {tuple(comb.shape)}, y {tuple(y.shape)}"
        )
    out = torch.empty(s, n, d)
    rc = library().mls_hc_post(
        h.data_ptr(), s, n, d, post.data_ptr(), comb.data_ptr(), y.data_ptr(), out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native hc_post refused {n} streams (at most 16)")
    return out


def v4_ffn(
    h: torch.Tensor,
    post_a: torch.Tensor,
    comb_a: torch.Tensor,
    y: torch.Tensor,
    hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float, int],
    norm: tuple[torch.Tensor, float],
    moe: tuple[ctypes.Structure, torch.Tensor | None],
) -> torch.Tensor:
    """DeepSeek-V4's FFN sublayer of a step in one C call (csrc/v4_ffn.c mls_v4_ffn): the attention's new streams
    hc_post(h; post_a, comb_a, y), the FFN hyper-connection's mixing (hc: fn, base, scale, eps, norm_eps, iters, as
    hc_pre takes them), its RMSNorm (norm: weight, eps), the MoE block (moe: its MoEBlockArgs, whose tensors the
    caller keeps alive, and the step's token ids [S] int64 where it routes by them, else None) and the layer's
    output streams; h [S, N, D], post_a [S, N], comb_a [S, N, N], y [S, D], all fp32 CPU contiguous -> [S, N, D].
    The same C calls in the same order as the per-op native path: the same bits."""
    s, n, d = h.shape
    fn, base, scale, eps, norm_eps, iters = hc
    weight, eps_g = norm
    args, ids = moe
    tensors = (h, post_a, comb_a, y, fn, base, scale, weight)
    if not all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors):
        raise ValueError("v4_ffn: h, post_a, comb_a, y and the weights must be contiguous fp32")
    if post_a.shape != (s, n) or comb_a.shape != (s, n, n) or y.shape != (s, d) or weight.shape != (d,):
        raise ValueError(f"v4_ffn: h {tuple(h.shape)}, post {tuple(post_a.shape)}, comb {tuple(comb_a.shape)}, "
                         f"y {tuple(y.shape)}, norm weight {tuple(weight.shape)}")  # fmt: skip
    if args.d != d or (args.tid2eid and (ids is None or ids.shape != (s,) or ids.dtype != torch.int64)):
        raise ValueError(f"v4_ffn: a MoE block of width {args.d} (hash routing reads the step's {s} ids, int64)")
    out = torch.empty(s, n, d)
    rc = library().mls_v4_ffn(
        h.data_ptr(), s, n, d, post_a.data_ptr(), comb_a.data_ptr(), y.data_ptr(), fn.data_ptr(), base.data_ptr(),
        scale.data_ptr(), eps, norm_eps, iters, weight.data_ptr(), eps_g, ctypes.byref(args),
        ids.data_ptr() if args.tid2eid else None, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native v4_ffn refused (rc {rc}: -1 the streams or a weight type, -2 .. -5 the MoE block)")
    return out


def gather_rows(parts: list[torch.Tensor], part_row: torch.Tensor) -> torch.Tensor:
    """Rows of several fp32 matrices [rows_p, d] (contiguous, one width) gathered in one C call (csrc/glue.c
    mls_gather_rows): part_row [..., 2] int64 (part, row) pairs -> [..., d]. A pair outside its part is an error."""
    bases, rows, d = _parts_args(parts, part_row, "gather_rows")
    n = part_row.numel() // 2
    out = torch.empty(*part_row.shape[:-1], d)
    rc = library().mls_gather_rows(
        bases, rows.data_ptr(), len(parts), part_row.data_ptr(), n, d, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native gather_rows refused a {'part' if rc == -1 else 'row'} outside the parts given")
    return out

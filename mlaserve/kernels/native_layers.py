"""The native kernels' per-layer operations outside the matmuls (blocks.c "latent MQA" and "decode-step glue"):
the absorbed path's latent MQA over paged rows, RMSNorm, and a step's latent rows with the query rope. The
library, its build and the matmul / MoE wrappers are in native.py; the tests hold these to the torch code
(tests/test_latent_mqa_kernel.py, tests/test_glue_kernels.py, the attention-backend harness).
"""

from __future__ import annotations

import torch

from mlaserve.kernels.native import library


def latent_mqa(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    q_index: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [T, H, r] / q_pe [T, H, dr] fp32 with unit stride along the last dim (views are read in place),
    q_index [B, Q] int64 (the token of each query), cache [S, r + dr] fp32, slots [B, L] int64, mask [B, Q, L]
    bool (these contiguous) -> [B, Q, H, r] fp32: softmax(scale * [q_lat | q_pe] . row) @ row[:r] over each
    query's allowed rows, read in place."""
    lib = library()
    b, nq = q_index.shape
    h, r = q_lat.shape[1], q_lat.shape[2]
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.shape[1] != r + q_pe.shape[2]:
        raise ValueError("latent_mqa: q_lat / q_pe need unit stride along the row, cache rows r + dr values")
    if q_index.dtype != torch.int64 or not q_index.is_contiguous():
        raise ValueError("latent_mqa: q_index must be contiguous int64")
    out = torch.empty(b, nq, h, r, dtype=torch.float32)
    rc = lib.mls_latent_mqa(
        q_lat.data_ptr(),
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.data_ptr(),
        q_pe.stride(0),
        q_pe.stride(1),
        q_index.data_ptr(),
        cache.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        b,
        nq,
        slots.shape[1],
        h,
        r,
        q_pe.shape[2],
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native latent_mqa failed (rc {rc})")
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] fp32 with unit stride along d, w [d] fp32 contiguous -> [T, d] fp32: x * rsqrt(mean(x^2) + eps) * w,
    torch's fp32 rms_norm up to the rounding of the sum of squares."""
    t, d = x.shape
    y = torch.empty(t, d, dtype=torch.float32)
    library().mls_rms_norm(x.data_ptr(), t, d, x.stride(0), w.data_ptr(), eps, y.data_ptr(), d, torch.get_num_threads())
    return y


def latent_rope_write(
    kv: torch.Tensor,
    q: torch.Tensor,
    dn: int,
    w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """A step's latent rows and query rope in one call (blocks.c mls_latent_rope_write):
    kv [T, r + dr] fp32 rows [c_kv | k_pe] (unit stride along the row), q [T, H, dn + dr] fp32 contiguous,
    w [r] the kv_a_layernorm weight, cos / sin [T, dr / 2] fp32 contiguous, cache [S, r + dr] fp32
    contiguous, slots [T] int64 contiguous. Writes cache[slots] = [rmsnorm(c_kv) w | rope(k_pe)] and
    rotates q's q_pe columns in place."""
    t, h, ldh = q.shape
    dr = ldh - dn
    r = kv.shape[1] - dr
    rc = library().mls_latent_rope_write(
        kv.data_ptr(),
        t,
        kv.stride(0),
        r,
        dr,
        w.data_ptr(),
        eps,
        q.data_ptr(),
        h,
        ldh,
        dn,
        cos.data_ptr(),
        sin.data_ptr(),
        int(interleaved),
        cache.data_ptr(),
        cache.shape[0],
        slots.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -5:
        raise IndexError(f"latent_rope_write: a slot outside the cache of {cache.shape[0]} rows")
    if rc != 0:
        raise RuntimeError(f"native latent_rope_write refused rope width {dr} (rc {rc})")

"""Prefill products of Q8_0 weights on the AMX-BF16 tiles at fp32 grade: the int8 codes are exact in bf16, each
activation is split into two bfloat16s (its rounding and the rounding's remainder), the tile unit sums codes times
both halves in fp32 per 32-value block, and each block's scale multiplies that sum in fp32 (csrc/x86/amx_bf16.c).

Notation (bf = round to nearest even bfloat16, u = 2^-8)
  x   [M, K]   fp32 activations (M > ggml.GEMV_ROWS: the many-rows path); x_h = bf(x), x_l = bf(x - x_h)
  W   [N, R]   uint8 Q8_0 blocks; w = d q its values (fp16 d per 32 values times int8 q: the reference's)
  y   [M, N]   fp32 = sum_b d_b sum_{k in b} q (x_h + x_l)
               |y - x W^T| <= (u^2 + (K / 32 + 65) 2^-24 (1 + 2u)) sum_k |x_k| |w_k|
               (tests/kernels/test_bf16_pairs.py holds it to that against fp64; a row's bits do not depend on the
               batch or the threads)
Why Q8_0 only: plain bf16 (d q and x rounded) adds 0.54-0.57x Q8_0's own quantization error
(kernels/bf16_prefill.py, over the rule's 1/2), while this adds ~u^2 per product; the lower-bit types take plain
bf16 (or the int8 tiles), which is faster and already well inside their rule. Float weights (F16, BF16, F32) have
no many-rows native path.
"""

from __future__ import annotations

import torch

from mlaserve.kernels import native, stack_parts

Q8_0 = 8  # ggml's type id: the one weight type these products take
NO_TILES_IN_BUILD = "the build's CPU has no AMX-BF16"


def granted() -> bool:
    """Whether this process runs them: the build has AMX-BF16 and the kernel granted the tile state (asked once per
    process, csrc/x86/amx.c amx_permission)."""
    lib = native.library()
    return lib is not None and lib.mls_bf16_tiles() == 1


def tiles_detail() -> str:
    """In words, for the kernel plan: the unit, or why not."""
    lib = native.library()
    rc = lib.mls_bf16_tiles() if lib is not None else 0
    if rc == 1:
        return "amx-bf16 tiles"
    if rc == 0:
        return f"no amx-bf16 tiles: {NO_TILES_IN_BUILD}"
    return f"no amx-bf16 tiles: the kernel refused the tile state (arch_prctl errno {-rc})"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native bf16-pair {what} failed (rc {rc}: {tiles_detail()})")


def linear(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] W^T for Q8_0 rows w [N, R] (contiguous)."""
    x = x.float().contiguous()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib = native.library()
    rc = lib.mls_q8_0_bf16_pairs(
        x.data_ptr(), m, k, k, w.data_ptr(), n, w.shape[-1], y.data_ptr(), n, torch.get_num_threads()
    )
    _check(rc, "product")
    return y


def grouped(
    xs: torch.Tensor, parts: tuple[torch.Tensor, ...], k: int, experts: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s rows of every part (stacks
    [E, N_i, R] whose rows follow one another: gate then up), each part written into its columns of ys."""
    starts = torch.nn.functional.pad(offs.to(torch.int64), (1, 0))
    return stack_parts.grouped(
        xs, parts, k, experts, starts, native.library().mls_q8_0_bf16_pairs_grouped,
        lambda rc: _check(rc, "grouped product"),
    )  # fmt: skip

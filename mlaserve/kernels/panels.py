"""Exact (fp32) prefill products on decoded weight panels (csrc/x86/panels.c, AVX-512 builds): a panel of 4 weight
rows decoded once into a thread's buffer (the reference decoder's values, bit for bit), every activation row of a
chunk multiplied with it by fp32 fused multiply-adds, 16 lanes per accumulator. The many-rows path's fp32 products
(kernels/ggml.py: more than GEMV_ROWS rows per weight, the weights bf16_prefill.takes_bf16 leaves FP32; a grouped
product at any row count, a dense one up to ggml.PANEL_ROWS) instead of each weight decoded to fp32 in memory and
then the BLAS GEMM: on routed experts (tens of rows each) that GEMM ran at ~60% of its 512-row speed and the decoded
experts were written and read once more.

Notation
  x   [M, K]   fp32 activation rows (K a multiple of 16: every block type's rows are)
  W   [N, R]   uint8 stored rows; w [N, K] fp32 their decoded values
  y   [M, N]   fp32 = x w^T; each output's 16 lanes sum the products k = l (mod 16) in order, one FMA each, then
               the lanes are added: |y - x w^T| <= (K / 16 + 4) 2^-24 sum_k |x_k| |w_k| to first order
               (tests/kernels/test_panels.py holds it against fp64); a row's bits do not depend on the batch or the
               threads
  xs [P, K], experts [A], starts [A + 1]: the grouped form (routed experts), rows starts[a] .. starts[a + 1] of xs
  times expert experts[a]'s rows
"""

from __future__ import annotations

import torch

from mlaserve.kernels import native, stack_parts

UNIT = "avx512 fp32 tiles of 6 rows x 4 decoded weight rows"  # what the kernel plan names


def available() -> bool:
    """Whether the library was built with the panel products (AVX-512)."""
    lib = native.library()
    return lib is not None and lib.mls_panels() == 1


def grouped(
    xs: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    type_id: int,
    k: int,
    experts: torch.Tensor,
    starts: torch.Tensor,
) -> torch.Tensor:
    """ys [P, N] fp32: rows [starts[a], starts[a + 1]) of xs times expert experts[a]'s rows of every part (stacks
    [E, N_i, R] with whole rows one after another, e.g. gate then up), each part into its columns of ys."""

    def check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"native panel product failed for ggml type {type_id} (rc {rc})")

    lib = native.library()
    return stack_parts.grouped(xs, parts, k, experts, starts, lambda *a: lib.mls_grouped_panels(type_id, *a), check)


def linear(x: torch.Tensor, w: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] w^T for stored rows w [N, R] (contiguous): the grouped form with one group."""
    one = torch.zeros(1, dtype=torch.int64)
    starts = torch.tensor([0, x.shape[0]], dtype=torch.int64)
    return grouped(x, (w.contiguous().unsqueeze(0),), type_id, k, one, starts)

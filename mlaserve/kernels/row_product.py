"""A weight's decode-sized product (at most ggml.GEMV_ROWS activation rows) bound once per weight and setting.

Notation
  x   [M, K]   fp32 activations, M <= ggml.GEMV_ROWS
  W   [N, R]   uint8: the file's blocks of the [N, K] matrix (contiguous rows)
  y   [M, N]   fp32 = x W^T, the bits of ggml.linear_native for the same call

ggml.linear_native decides per call which C entry runs (linear_path: int16 activations where the setting gives
them to the type, else the decode kernels, int8 activations where native.takes_int8 says so) and looks up the
library, the thread count and the weight's sizes each time. At decode those decisions never change between
calls, so bind() makes them once and keeps the entry with its fixed arguments: a call is then one allocation and
one ctypes call. Why: a model whose layers have no fused decode (DeepSeek-V4's: ~43 products a step on the
4-layer benchmark model) paid ~10-35 us of Python around each 7-130 us kernel (a 2-core AMX Xeon, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaserve.kernels import ggml, native

RowProduct = Callable[[torch.Tensor], torch.Tensor]


def bind(w: torch.Tensor, ggml_type: int, k: int, int8: bool | int) -> RowProduct:
    """-> product(x [M, K] fp32 contiguous, M <= GEMV_ROWS) -> y [M, N] fp32, equal bit for bit to
    ggml.linear_native(x, w, ggml_type, k, int8) at those rows. w: contiguous [N, R], kept alive by the product."""
    lib = native.library()
    n, row_bytes, w_ptr = w.shape[0], w.shape[-1], w.data_ptr()
    if ggml.linear_path(1, ggml_type, int8) == "int16":
        entry, tail, what = lib.mls_int16_gemm, (), "int16-activation product"
    elif native.takes_int8(ggml_type, int8):
        entry, tail, what = lib.mls_gemm_q8, (), "int8-activation gemm"
    else:  # the exact decode kernels (no scale grid: GGUF blocks carry their own scales)
        entry, tail, what = lib.mls_gemm, (None, 1, 1, 1, n), "gemm"

    def product(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        rc = entry(
            ggml_type, x.data_ptr(), m, k, k, w_ptr, n, row_bytes, *tail, y.data_ptr(), n, torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"native {what} refused type {ggml_type} (rc {rc})")
        return y

    product.weight = w  # the closure reads its address: keep the tensor alive with it
    return product

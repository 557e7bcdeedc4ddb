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

import ctypes
from collections.abc import Callable

import torch

from mlaserve.kernels import ggml, native

RowProduct = Callable[[torch.Tensor], torch.Tensor]
SharedProduct = Callable[[torch.Tensor], list[torch.Tensor]]
# activation rows up to which a shared-input product runs (csrc/int16.c QW_FEW: past it one weight's own call may
# take the AMX-INT8 tiles, which the shared form does not; at 16 rows the shared form measured slower on a 2-core
# AMX Xeon, 2026-12-07)
SHARED_ROWS = 3


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


def bind_shared_input(ws: list[torch.Tensor], ggml_type: int, k: int, int8: bool | int) -> SharedProduct | None:
    """Several weights of one type and row width that take the same input (a layer's projections of x) as one
    decode-sized product: -> product(x [M, K] fp32 contiguous, M <= GEMV_ROWS) -> [x W_i^T for each weight], equal
    bit for bit to bind(w_i, ...)(x) each (csrc/int16.c mls_int16_gemm_multi: the same items on the same kernels,
    the activations quantized once, one call's start instead of one per weight), at up to SHARED_ROWS rows. None
    where the weights' decode products are not the int16 ones (the entry with a several-weights form). ws:
    contiguous [N_i, R], kept alive by the product."""
    if ggml.linear_path(1, ggml_type, int8) != "int16" or len({w.shape[-1] for w in ws}) != 1:
        return None
    lib = native.library()
    n = [w.shape[0] for w in ws]
    ptrs = (ctypes.c_void_p * len(ws))(*(w.data_ptr() for w in ws))
    rows = torch.tensor(n, dtype=torch.int64)  # each weight's rows, also each output's row stride

    def product(x: torch.Tensor) -> list[torch.Tensor]:
        m = x.shape[0]
        ys = [torch.empty(m, r, dtype=torch.float32) for r in n]
        out = (ctypes.c_void_p * len(ys))(*(y.data_ptr() for y in ys))
        rc = lib.mls_int16_gemm_multi(
            ggml_type, x.data_ptr(), m, k, k, ptrs, rows.data_ptr(), len(ws), ws[0].shape[-1], out, rows.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"native int16 product of {len(ws)} weights refused type {ggml_type} (rc {rc})")
        return ys

    product.weights = ws  # the closure reads their addresses: keep the tensors alive with it
    return product

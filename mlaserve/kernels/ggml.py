"""Matrix products with weights kept in llama.cpp's block formats (GGUF Q8_0, Q4_0, Q4_K, ...).

Notation
  x   [M, K]   activations (any float dtype; the product runs in fp32)
  W   [N, K]   the weight as the file stores it: raw ggml bytes [N, R] uint8, R = K / block * type_size
               (a row is a whole number of blocks, so rows are independent byte ranges)
  y   [M, N]   fp32, = x @ dequantize(W)^T up to float summation order
  Experts: W [E, N, R]; xs [P, K] the (token, expert) pairs sorted by expert; experts [A] the active
  expert ids (ascending), offs [A] int32 cumulative pair counts (the end of each group in xs).
These functions are the seam: the reference is "dequantize (gguf.quants, bit-exact with gguf-py),
then one fp32 GEMM"; a native kernel behind the same signature must agree with it up to fp32
summation order (tests/test_kernels.py holds it to that bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.gguf.quants import GGML_TYPES, dequantize


def row_bytes(ggml_type: int, k: int) -> int:
    t = GGML_TYPES[ggml_type]
    if k % t.block_size:
        raise ValueError(f"a {t.name} row holds whole {t.block_size}-value blocks; {k} columns do not")
    return k // t.block_size * t.type_size


def dense(w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """Raw [..., N, R] -> fp32 [..., N, K] (the reference dequantizer)."""
    return dequantize(w.contiguous(), ggml_type, (*w.shape[:-1], k))


def linear(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequantize(w [N, R])^T."""
    return F.linear(x.float(), dense(w, ggml_type, k))


def expert_linear(
    xs: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, experts: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s weight."""
    return torch._grouped_mm(xs.float(), dense(w[experts], ggml_type, k).transpose(1, 2), offs=offs)

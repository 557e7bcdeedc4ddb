"""What the Triton GEMM kernels share: the launch (grid, block sizes, compile options) and the fp32 product of
a decoded weight tile.

Notation
  x  [M, K] fp32 activations (contiguous), W [N, K] the weight as its stored format decodes it, y [M, N] fp32
  BM, BN, BK  the tile: BM rows of x, BN weight rows, BK columns per step of the K loop
A kernel computes y[m, n] = sum_k x[m, k] W[n, k] in fp32: every decoded value is the reference dequantizer's
value bit for bit, and tl.dot runs with input_precision="ieee" (TF32 would keep 10 mantissa bits, far outside
the fp32 reorder bound the tests hold the product to). Compiled, fp fusion is off (enable_fp_fusion=False): a
decode step like (d * sc) * q - dmin * m must round each operation as the reference dequantizers do, and an FMA
would skip a rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Rows of x per tile: tl.dot takes tiles of at least 16 in every dimension, and a decode step (the small batch
# these kernels are for) has 1..16 rows; more rows take more row tiles, each decoding the weight again.
BM = 16
BN = 64
BK = 64


# Launch options of every kernel: no fp fusion where Triton compiles (the interpreter takes and ignores it: numpy
# never fuses)
LAUNCH = {"enable_fp_fusion": False}


def gemm_grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(n, BN), triton.cdiv(m, BM)


def decode_grid(n: int, k: int) -> tuple[int, int]:
    return triton.cdiv(n, BN), triton.cdiv(k, BK)


@triton.jit
def load_x(x_ptr, offs_m, offs_k, M, K):
    """x [BM, BK] fp32, zero outside [M, K]."""
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    return tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def dot_tile(acc, x, w):
    """acc [BM, BN] += x [BM, BK] @ w [BN, BK]^T in IEEE fp32."""
    return tl.dot(x, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def store_y(y_ptr, acc, offs_m, offs_n, M, N):
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)

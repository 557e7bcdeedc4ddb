"""What the Triton GEMM kernels share: the launch (grid, block sizes, compile options), the fp32 product of
a decoded weight tile, and the GGUF formats' GEMM and decode kernels (one body each, the format's tile decoder
passed as a constexpr function: DECODE(q_ptr, d_ptr, offs_n, offs_k, N, K) -> W [BN, BK] fp32, 0 outside [N, K]).

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

import torch
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


@triton.jit
def gguf_gemm(x_ptr, q_ptr, d_ptr, y_ptr, M, N, K, DECODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):  # fmt: skip
    """y [M, N] = x [M, K] @ W^T, W decoded tile by tile by DECODE from the blocks at q_ptr / d_ptr."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        w = DECODE(q_ptr, d_ptr, offs_n, offs_k, N, K)
        acc = dot_tile(acc, load_x(x_ptr, offs_m, offs_k, M, K), w)
    store_y(y_ptr, acc, offs_m, offs_n, M, N)


@triton.jit
def gguf_decode(q_ptr, d_ptr, w_ptr, N, K, DECODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W [N, K] fp32 written out by DECODE, one [BN, BK] tile per program."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    w = DECODE(q_ptr, d_ptr, offs_n, offs_k, N, K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=mask)


def gguf_linear(decode, q: torch.Tensor, d: torch.Tensor, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ W^T, W the blocks (q, d: views of one weight's bytes) as `decode` reads them."""
    x = x.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    gguf_gemm[gemm_grid(m, n)](x, q, d, y, m, n, k, decode, BM, BN, BK, **LAUNCH)
    return y


def gguf_dequantize(decode, q: torch.Tensor, d: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [N, K] fp32 as `decode` reads the blocks (q, d: views of one weight's bytes)."""
    w = torch.empty(n, k, dtype=torch.float32, device=q.device)
    gguf_decode[decode_grid(n, k)](q, d, w, n, k, decode, BN, BK, **LAUNCH)
    return w

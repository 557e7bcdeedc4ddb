"""FP8 e4m3 block-scaled weights in Triton: y = x @ W^T with W decoded from its bytes and block scales.

Notation (as quant/fp8_block.py)
  x  [M, K] fp32;  Q [N, K] e4m3 codes, read as uint8;  S [nb, kb] fp32, nb = ceil(N / bn), kb = ceil(K / bk)
  W[n, k] = e4m3(Q[n, k]) * S[n // bn, k // bk]      one fp32 rounding, as fp8_block.dequantize_reference
  y  [M, N] fp32 = x @ W^T, summed in fp32 (tiles.py)
The codes are decoded in the kernel from their bits (s.eeee.mmm, bias 7; e = 0: subnormal m * 2^-9; the two
codes s.1111.111 are NaN), not loaded as float8: the same code then runs under the interpreter (numpy has no
e4m3) and compiled, and on GPUs without FP8 units. The decode is exact, so W equals the reference's values bit
for bit (tests/kernels/test_triton_gemm.py checks all 256 codes and partial edge blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.triton import tiles


@triton.jit
def decode_e4m3(b):
    """uint8 codes (any int tensor) -> their fp32 values, exactly (NaN codes: a quiet NaN of the code's sign)."""
    b = b.to(tl.int32)
    sign = (b & 128) << 24
    exp = (b >> 3) & 15
    man = b & 7
    bits = tl.where((b & 127) == 127, sign | 0x7FC00000, sign | ((exp + 120) << 23) | (man << 20))
    normal = bits.to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # m * 2^-9: exact
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(exp == 0, sub, normal)


@triton.jit
def decode_tile(q_ptr, s_ptr, offs_n, offs_k, N, K, KB, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [BN, BK] fp32 of rows offs_n, columns offs_k; 0 outside [N, K]."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None]  # byte offsets of big weights pass 2^31
    q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + (offs_n[:, None] // BLOCK_N) * KB + offs_k[None, :] // BLOCK_K, mask=mask, other=0.0)
    return tl.where(mask, decode_e4m3(q) * s, 0.0)


@triton.jit
def _gemm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, KB, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        w = decode_tile(q_ptr, s_ptr, offs_n, offs_k, N, K, KB, BLOCK_N, BLOCK_K)
        acc = tiles.dot_tile(acc, tiles.load_x(x_ptr, offs_m, offs_k, M, K), w)
    tiles.store_y(y_ptr, acc, offs_m, offs_n, M, N)


@triton.jit
def _decode(q_ptr, s_ptr, w_ptr, N, K, KB, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    w = decode_tile(q_ptr, s_ptr, offs_n, offs_k, N, K, KB, BLOCK_N, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], w, mask=mask)


def _operands(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = q.shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    if tuple(s.shape) != (nb, kb):
        raise ValueError(f"fp8 scales {tuple(s.shape)} do not tile a [{n}, {k}] weight in {block} blocks")
    return q.contiguous().view(torch.uint8), s.float().contiguous()


def linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ (Q [N, K] e4m3 * S [nb, kb] per (bn, bk) block)^T."""
    codes, scales = _operands(q, s, block)
    x = x.float().contiguous()
    (m, k), n = x.shape, codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    _gemm[tiles.gemm_grid(m, n)](
        x, codes, scales, y, m, n, k, scales.shape[1], block[0], block[1], tiles.BM, tiles.BN, tiles.BK,
        **tiles.LAUNCH,
    )  # fmt: skip
    return y


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [N, K] fp32 decoded by the kernels' tile decoder (equal to fp8_block.dequantize_reference bit for bit)."""
    codes, scales = _operands(q, s, block)
    n, k = codes.shape
    w = torch.empty(n, k, dtype=torch.float32, device=codes.device)
    _decode[tiles.decode_grid(n, k)](
        codes, scales, w, n, k, scales.shape[1], block[0], block[1], tiles.BN, tiles.BK,
        **tiles.LAUNCH,
    )  # fmt: skip
    return w

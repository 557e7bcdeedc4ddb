"""GGUF Q8_0 blocks in Triton: y = x @ W^T read straight from the file's blocks (small batch: 1..16 rows).

Notation
  x  [M, K] fp32;  raw [N, R] uint8, R = K / 32 * 34: per row K / 32 blocks of (d fp16, qs 32 x int8)
  W[n, k] = float(d[n, k // 32]) * float(qs[n, k // 32][k % 32])     one fp32 rounding, as gguf-py
  y  [M, N] fp32 = x @ W^T, summed in fp32 (tiles.py)
The block's bytes are read through two views of the same memory: int8 for qs, fp16 for d (a block is 34 bytes,
so every d lies at an even offset: block j of row n starts at fp16 index (n R + 34 j) / 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.triton import tiles

QK = 32  # values per block
BLOCK_BYTES = 34


@triton.jit
def decode_tile(q_ptr, d_ptr, offs_n, offs_k, N, K):
    """W [BN, BK] fp32 of rows offs_n, columns offs_k; 0 outside [N, K]."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    block = offs_n.to(tl.int64)[:, None] * (K // 32) + offs_k[None, :] // 32  # its index in the weight (int64)
    qs = tl.load(q_ptr + block * 34 + 2 + offs_k[None, :] % 32, mask=mask, other=0)
    d = tl.load(d_ptr + block * 17, mask=mask, other=0.0)
    return tl.where(mask, d.to(tl.float32) * qs.to(tl.float32), 0.0)


def _views(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [N, R] uint8 -> (qs as int8, d as fp16): two views of the same bytes."""
    if k % QK or raw.dim() != 2 or raw.shape[1] != k // QK * BLOCK_BYTES or raw.dtype != torch.uint8:
        raise ValueError(f"Q8_0 weight: {tuple(raw.shape)} {raw.dtype} is not [N, {k} / 32 * 34] uint8 blocks")
    raw = raw.contiguous()
    return raw.view(torch.int8), raw.view(torch.float16)


def linear(x: torch.Tensor, raw: torch.Tensor, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequantize(raw [N, R])^T."""
    qs, d = _views(raw, k)
    return tiles.gguf_linear(decode_tile, qs, d, x, raw.shape[0], k)


def dequantize(raw: torch.Tensor, k: int) -> torch.Tensor:
    """W [N, K] fp32 by the kernels' tile decoder (equal to gguf-py's dequantizer bit for bit)."""
    qs, d = _views(raw, k)
    return tiles.gguf_dequantize(decode_tile, qs, d, raw.shape[0], k)

"""GGUF Q4_K super-blocks in Triton: y = x @ W^T read straight from the file's blocks (small batch: 1..16 rows).

Notation
  x  [M, K] fp32;  raw [N, R] uint8, R = K / 256 * 144: per row K / 256 super-blocks of 144 bytes:
     d fp16 (bytes 0-1), dmin fp16 (2-3), scales[12] (4-15: eight 6-bit scales sc and eight 6-bit mins mn),
     qs[128] (16-143: 256 4-bit codes)
  value i of a super-block: sub-block j = i // 32, l = i % 32
     sc[j], mn[j]  j < 4: scales[j] & 63, scales[j + 4] & 63
                   j >= 4: (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4, (scales[j + 4] >> 4) | (scales[j] >> 6) << 4
     q = qs[32 (j // 2) + l] >> 4 (j % 2) & 15                 (low nibbles: the even sub-block)
     W = (d * sc) * q - dmin * mn     each operation rounded in fp32, in this order, as gguf-py (no FMA)
  y  [M, N] fp32 = x @ W^T, summed in fp32 (tiles.py)
d and dmin are read through an fp16 view of the same bytes (144-byte super-blocks: 72 fp16 each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.triton import tiles

QK_K = 256  # values per super-block
BLOCK_BYTES = 144


@triton.jit
def decode_tile(q_ptr, h_ptr, offs_n, offs_k, N, K):
    """W [BN, BK] fp32 of rows offs_n, columns offs_k; 0 outside [N, K]."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    sb = offs_n.to(tl.int64)[:, None] * (K // 256) + offs_k[None, :] // 256  # its index in the weight (int64)
    i = offs_k[None, :] % 256
    j = i // 32
    base = q_ptr + sb * 144
    d = tl.load(h_ptr + sb * 72, mask=mask, other=0.0).to(tl.float32)
    dmin = tl.load(h_ptr + sb * 72 + 1, mask=mask, other=0.0).to(tl.float32)
    # scales[t] is byte 4 + t: scales[j], scales[j + 4] (both halves) and, for j >= 4, scales[j - 4]
    s_j = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
    s_up = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
    s_lo = tl.load(base + 4 + j % 4, mask=mask, other=0).to(tl.int32)
    low = j < 4
    sc = tl.where(low, s_j & 63, (s_up & 15) | ((s_lo >> 6) << 4))
    mn = tl.where(low, s_up & 63, (s_up >> 4) | ((s_j >> 6) << 4))
    byte = tl.load(base + 16 + (j // 2) * 32 + i % 32, mask=mask, other=0).to(tl.int32)
    q = (byte >> ((j % 2) * 4)) & 15
    ds = d * sc.to(tl.float32)
    dm = dmin * mn.to(tl.float32)
    return tl.where(mask, ds * q.to(tl.float32) - dm, 0.0)


def _views(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [N, R] uint8 -> (the bytes, d / dmin as fp16): two views of the same memory."""
    if k % QK_K or raw.dim() != 2 or raw.shape[1] != k // QK_K * BLOCK_BYTES or raw.dtype != torch.uint8:
        raise ValueError(f"Q4_K weight: {tuple(raw.shape)} {raw.dtype} is not [N, {k} / 256 * 144] uint8 blocks")
    raw = raw.contiguous()
    return raw, raw.view(torch.float16)


def linear(x: torch.Tensor, raw: torch.Tensor, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequantize(raw [N, R])^T."""
    q, h = _views(raw, k)
    return tiles.gguf_linear(decode_tile, q, h, x, raw.shape[0], k)


def dequantize(raw: torch.Tensor, k: int) -> torch.Tensor:
    """W [N, K] fp32 by the kernels' tile decoder (equal to gguf-py's dequantizer bit for bit)."""
    q, h = _views(raw, k)
    return tiles.gguf_dequantize(decode_tile, q, h, raw.shape[0], k)

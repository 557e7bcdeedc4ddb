"""INT4 weights with symmetric per-row group scales, eight values per int32: compressed-tensors'
`pack-quantized` W4A16 format (num_bits 4, type int, strategy group, symmetric), in which Kimi-K2.x
ships its routed experts (group 32, bf16 scales).

Notation
  W  [..., N, K]          a weight (experts: [E, N, K]); K a multiple of g (and so of 8)
  q  int in [-8, 7]       the stored value; u = q + 8 in [0, 15] is what is packed
  P  [..., N, K/8] int32  `weight_packed`: column 8j+i in bits 4i..4i+3 of P[..., j] (low nibble first)
  S  [..., N, K/g]        `weight_scale`, in the checkpoint's float dtype (bf16 in the release)
  shape [2] int64         `weight_shape`: (N, K) of the unpacked weight
  W ~= q * S[n, k // g]   (dequantize; exact in fp32: |q| <= 8 and S has <= 24 significant bits)
Quantizer (compressed-tensors' symmetric group rule): S = amax(|W| over the group) / 7.5 (the range
[-8, 7] spans 15 steps), rounded to S's dtype; q = clamp(round(W / S), -8, 7).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

GROUP = 32
PACK = 8  # values per int32
OFFSET = 8  # q + 8: the unsigned nibble that is packed
Q_MIN, Q_MAX = -8, 7


def quantize(w: torch.Tensor, group: int = GROUP, scale_dtype: torch.dtype = torch.bfloat16):
    """W [..., N, K] float -> (P [..., N, K/8] int32, S [..., N, K/g] scale_dtype): the writer's side."""
    k = w.shape[-1]
    if k % group:
        raise ValueError(f"INT4 groups of {group}: the last dim must be a multiple of {group}, got {k}")
    wg = w.float().unflatten(-1, (k // group, group))
    s = (wg.abs().amax(dim=-1) / 7.5).to(scale_dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))  # a zero group: any scale encodes it as zeros
    q = torch.clamp(torch.round(wg / s.float()[..., None]), Q_MIN, Q_MAX).flatten(-2).to(torch.int32)
    return pack(q), s


def pack(q: torch.Tensor) -> torch.Tensor:
    """q int [..., N, K] in [-8, 7] -> P int32 [..., N, K/8]."""
    u = (q.to(torch.int64) + OFFSET).unflatten(-1, (-1, PACK))
    shifts = torch.arange(PACK, dtype=torch.int64, device=q.device) * 4
    packed = (u << shifts).sum(dim=-1)  # the nibbles do not overlap: the sum is the bitwise or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as signed int32 bits


def unpack(p: torch.Tensor) -> torch.Tensor:
    """P int32 [..., N, K/8] -> q int8 [..., N, K] in [-8, 7]."""
    shifts = torch.arange(PACK, dtype=torch.int32, device=p.device) * 4
    u = (p[..., None] >> shifts) & 0xF  # arithmetic shift: the mask drops the sign bits
    return (u - OFFSET).flatten(-2).to(torch.int8)


def dequantize_reference(p: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The oracle: every value times its group's scale, one element at a time -> fp32 [..., N, K]."""
    q = unpack(p).float()
    return q * s.float().repeat_interleave(group, dim=-1)


def dequantize(p: torch.Tensor, s: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """Fast: fp32 [..., N, K], equal to dequantize_reference bit for bit. The int32 words read as their
    little-endian bytes are the columns in order, two per byte (low nibble first), so one lookup of a
    256-entry table of (low - 8, high - 8) pairs decodes them (about half the time of the shifts, measured),
    then one exact product with the group's scale."""
    if sys.byteorder != "little":  # the byte view reads the words' bytes in memory order: use the shifts
        return dequantize_reference(p, s, group)
    table = _BYTE_TABLE.to(p.device)
    q = F.embedding(p.contiguous().view(torch.uint8).int(), table).flatten(-2)  # [..., N, K/2, 2] -> [..., N, K]
    k = q.shape[-1]
    return (q.unflatten(-1, (k // group, group)) * s.float()[..., None]).flatten(-2)


_BYTE_TABLE = torch.tensor([[(b & 0xF) - OFFSET, (b >> 4) - OFFSET] for b in range(256)], dtype=torch.float32)

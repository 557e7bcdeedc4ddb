"""DeepSeek's official-code roundings of V4 (config/v4_numerics.py says which and why), as row maps fixed at
construction: the attention and the compressors call `kv_rounding(rows)`, the indexer `index_rounding(rows)`,
whatever the option; the identity when it is off.

Notation
  rows [..., D]   K=V rows (D = head_dim = nope + rope) or the indexer's queries / keys (D = c = index_head_dim)
  FP8 KV          rows[..., :nope] -> dequantize(quantize(., fmt)): e4m3 codes, a ue8m0 scale per 64 values
                  (cache/quantized_rows.py, the same quantizer the 8-bit cache stores with, so an fp8_e4m3
                  V4 cache holds exactly the values the rounding makes); rows[..., nope:] untouched
  Hadamard        x -> x H / sqrt(c), H Sylvester's c x c +-1 matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]),
                  computed as the fast Walsh-Hadamard transform: log2(c) butterfly stages of sums and
                  differences over pairs h apart (h = 1, 2, 4, ..)
  FP4             per block of 32: s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), y = clamp(x / s, -6, 6)
                  rounded to the nearest e2m1 value (0, .5, 1, 1.5, 2, 3, 4, 6; ties to the even mantissa),
                  x~ = y~ * s (power-of-two scales: both products exact)
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.cache.quantized_rows import dequantize, quantize
from mlaserve.config.row_format import RowFormat
from mlaserve.config.v4_numerics import FP4_BLOCK, FP4_MAX, kv_format


class KeepRows(nn.Module):
    """transformers' numerics: the rows as they are."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


class FP8KVRows(nn.Module):
    """The official FP8 simulation of a K=V row's non-rope part (act_quant(kv[..., :-rd], 64, ue8m0))."""

    def __init__(self, nope_dim: int, rope_dim: int) -> None:
        super().__init__()
        self.fmt: RowFormat = kv_format(nope_dim, rope_dim)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        q = self.fmt.quantized
        flat = rows.reshape(-1, rows.shape[-1])
        codes, scales = quantize(flat[:, :q], self.fmt)
        nope = dequantize(codes, scales, self.fmt).to(rows.dtype)
        return torch.cat([nope, flat[:, q:]], dim=-1).view(rows.shape)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., c] (c a power of two) -> x H / sqrt(c) in x's dtype, H Sylvester's Hadamard matrix."""
    c = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float().reshape(-1, c)
    h = 1
    while h < c:  # pairs (i, i + h) within blocks of 2h: [a | b] -> [a + b | a - b]
        pairs = y.view(-1, c // (2 * h), 2, h)
        y = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], dim=2).view(-1, c)
        h *= 2
    return (y * c**-0.5).view(*lead, c).to(x.dtype)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> the FP4 e2m1 simulation (notation above), in x's dtype."""
    blocks = x.float().unflatten(-1, (-1, FP4_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    mantissa, exponent = torch.frexp(amax * torch.tensor(1.0 / FP4_MAX))
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).to(exponent.dtype))
    y = (blocks / scale).clamp(-FP4_MAX, FP4_MAX)
    # the e2m1 grid's step is 0.5 below 2, 1 below 4, 2 up to 6; round-half-even on multiples of the step is
    # round-half-to-even mantissa (the multiple's parity is the mantissa's last bit)
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    rounded = torch.round(mag / step) * step
    return (torch.copysign(rounded, y) * scale).flatten(-2).to(x.dtype)


class HadamardFP4Rows(nn.Module):
    """The official indexer path: rotate_activation (Hadamard / sqrt(c)), then fp4_act_quant(., 32)."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return fp4_round(hadamard(rows))


def kv_rounding(kind: str, nope_dim: int, rope_dim: int) -> nn.Module:
    """The K=V rows' map for a resolved V4Numerics.kv_rounding ("none" | "fp8_ue8m0")."""
    return FP8KVRows(nope_dim, rope_dim) if kind == "fp8_ue8m0" else KeepRows()


def index_rounding(kind: str) -> nn.Module:
    """The indexer's queries' and keys' map for a V4Numerics.indexer ("exact" | "hadamard_fp4")."""
    return HadamardFP4Rows() if kind == "hadamard_fp4" else KeepRows()

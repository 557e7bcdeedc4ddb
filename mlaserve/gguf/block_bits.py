"""Helpers on a [n_blocks, type_size] uint8 tensor of ggml blocks, shared by the dequantizers of gguf/quants.py
(the legacy and K-quants) and gguf/iquants.py (the i-quants and ternary types): bytes to fp16 scales, bit planes,
nibbles. Each is exact (integer shifts and masks, an fp16 -> fp32 widening).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QK_K = 256  # values per K-quant super-block


def f16_cols(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32 (exact)."""
    return cols.contiguous().view(torch.float16).to(torch.float32)


def shifted(x: torch.Tensor, shifts: Sequence[int], axis_shape: tuple[int, ...]) -> torch.Tensor:
    """x[..., None, :] >> shifts, shifts laid out along a new axis (the ggml bit-plane order)."""
    s = torch.tensor(list(shifts), dtype=torch.int32, device=x.device).reshape(axis_shape)
    return x.to(torch.int32).unsqueeze(-2) >> s


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] ints: low nibbles of all bytes, then high nibbles."""
    n = qs.shape[0]
    return (shifted(qs.reshape(n, -1, 16), (0, 4), (2, 1)) & 0x0F).reshape(n, -1)


def bits32(qh4: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes holding one little-endian uint32 -> [n, 32] of its bits (bit j = value j)."""
    q = qh4.to(torch.int64)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    return ((word.unsqueeze(1) >> torch.arange(32, dtype=torch.int64, device=q.device)) & 1).to(torch.int32)

"""DeepSeek-V4's rotary embedding: interleaved pairs on the trailing `d` dims of a head, two tables.

Notation
  T   tokens (positions), D head width (512 in the released models), d = rope_dim (64), pairs d/2
  x   [T, ..., D] a query, key, compressed row or attention output; x[..., D-d:] is the rope slice
  cos, sin [T, d/2] one angle per pair, scaled by the table's attention factor
Tables: "main" (rope_theta, no scaling) for sliding-only layers; "compress" (compress_rope_theta with YaRN,
attention factor 1 in the released configs) for CSA/HCA layers, their compressors and the indexer.
Unlike the MLA families (models/layers.py apply_rope writes [even', odd']), the rotated pairs stay
interleaved in place: V4's values carry rope (K = V) and the output is de-rotated (sin -> -sin) before the
output projection, whose weights read the channels in the checkpoint's order.
"""

from __future__ import annotations

import torch

from mlaserve.config.deepseek_v4_parts import V4Rope
from mlaserve.models.layers import rope_inv_freq


class V4RopeTables:
    """cos/sin of both tables for a set of positions (fp32 angles, as the reference)."""

    def __init__(self, rope: V4Rope) -> None:
        self.inv_freq = {"main": rope_inv_freq(rope.main), "compress": rope_inv_freq(rope.compress)}
        self.scale = {"main": 1.0, "compress": rope.compress_attention_factor}

    def cos_sin(self, table: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, d/2]."""
        freqs = positions.float()[:, None] * self.inv_freq[table].to(positions.device)[None, :]
        scale = self.scale[table]
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


class StepRope(V4RopeTables):
    """The model's tables for one step: cos / sin of the step's own positions computed once per table and dtype (each
    layer asks for them: 8 computations a decode step of a 4-layer model, 2 once kept), other positions (the
    compressors' window starts) computed as the tables compute them. Made per step (model.forward_spans), dropped
    with it."""

    def __init__(self, tables: V4RopeTables, positions: torch.Tensor) -> None:
        self.inv_freq, self.scale = tables.inv_freq, tables.scale  # the same tables
        self.positions = positions
        self._kept: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, table: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self.positions:
            return super().cos_sin(table, positions, dtype)
        key = (table, dtype)
        if key not in self._kept:
            self._kept[key] = super().cos_sin(table, positions, dtype)
        return self._kept[key]


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D]; cos/sin [T, d/2] broadcast over the middle dims. Rotates pairs (x_{D-d+2i}, x_{D-d+2i+1})
    in fp32 and leaves the leading D-d dims untouched. De-rotation: pass -sin."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape).float(), sin.view(shape).float()
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)

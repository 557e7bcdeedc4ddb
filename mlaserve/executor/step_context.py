"""What every layer needs to know about one step, computed once before the layers run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.attention.backends import AttentionBackend, get_backend
from mlaserve.attention.metadata import SegmentTensors, build_segment_tensors
from mlaserve.attention.router import AttentionPlan
from mlaserve.executor.forward_batch import ForwardBatch
from mlaserve.models.layers import RotaryEmbedding


@dataclass(frozen=True)
class StepContext:
    """Everything a layer needs about this step, computed once before the layers run."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    plan: AttentionPlan
    segments: tuple[SegmentTensors, ...]
    cos: torch.Tensor  # [T, dr/2]
    sin: torch.Tensor
    backends: tuple[AttentionBackend, ...]  # per segment: the backend its route names

    @staticmethod
    def build(batch: ForwardBatch, plan: AttentionPlan, rope: RotaryEmbedding, dtype: torch.dtype) -> StepContext:
        cos, sin = rope.cos_sin(batch.positions, dtype)
        segs = tuple(build_segment_tensors(batch, s) for s in plan.segments)
        backends = tuple(get_backend(s.backend) for s in plan.segments)
        return StepContext(batch.positions, batch.slot_mapping, plan, segs, cos, sin, backends)

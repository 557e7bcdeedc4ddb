"""What every layer needs to know about one step, computed once before the layers run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.attention.backends import AttentionBackend, get_backend
from mlaserve.attention.metadata import SegmentTensors, build_segment_tensors
from mlaserve.attention.plan import AttentionPlan, StepRoute
from mlaserve.attention.pooled_metadata import PooledTensors, build_pooled_tensors
from mlaserve.config.layer_kinds import LATENT_KINDS
from mlaserve.executor.forward_batch import ForwardBatch
from mlaserve.models.layers import RotaryEmbedding


@dataclass(frozen=True)
class KindStep:
    """One attention kind's part of the step: its plan, and per segment its tensors and backend."""

    plan: AttentionPlan
    segments: tuple[SegmentTensors, ...]
    backends: tuple[AttentionBackend, ...]  # per segment: the backend its route names
    pooled: PooledTensors | None = None  # the pooled DSA route's index tensors (plan.pooled), else None

    @staticmethod
    def build(batch: ForwardBatch, plan: AttentionPlan) -> KindStep:
        segs = tuple(build_segment_tensors(batch, s) for s in plan.segments)
        pooled = build_pooled_tensors(batch, plan) if plan.pooled is not None else None
        return KindStep(plan, segs, tuple(get_backend(s.backend) for s in plan.segments), pooled)


@dataclass(frozen=True)
class StepContext:
    """Everything a layer needs about this step, computed once before the layers run."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    route: StepRoute
    kinds: dict[str, KindStep]  # attention kind -> its plan and segment tensors
    cos: torch.Tensor  # [T, dr/2]
    sin: torch.Tensor
    # request-addressed states (ForwardBatch; None on models without them): a layer reads and writes its
    # state at these slots of its LayerState tensors; the runner zeroed the reset slots before the step
    state_slots: torch.Tensor | None = None  # [B] per sequence, in batch order (decodes first)
    token_state_slots: torch.Tensor | None = None  # [T] per token
    # per sequence, in batch order, as plain ints: (query_start, query_len, context_len, state_slot); read by
    # models that run their attention per sequence over request states (DeepSeek-V4)
    seq_spans: tuple[tuple[int, int, int, int | None], ...] = ()
    # per sequence, in batch order: its block table (pages of positions 0 .. seq_len - 1), and the page
    # boundaries its chunk reaches as (k, page): a layer with snapshotted request states saves the state after
    # the chunk's first k tokens into that page's snapshot row (empty unless the cache keeps snapshots)
    block_tables: tuple[tuple[int, ...], ...] = ()
    snapshots: tuple[tuple[tuple[int, int], ...], ...] = ()
    page_size: int = 0
    # per sequence, in batch order: its chunk's draft tokens (speculative verification; 0 otherwise)
    drafts: tuple[int, ...] = ()

    def of(self, kind: str) -> KindStep:
        """The part of the step a layer of this attention kind executes."""
        got = self.kinds.get(kind)
        if got is None:
            raise KeyError(f"the step has no route for attention kind {kind!r}; planned: {list(self.kinds)}")
        return got

    @staticmethod
    def build(batch: ForwardBatch, route: StepRoute, rope: RotaryEmbedding, dtype: torch.dtype) -> StepContext:
        cos, sin = rope.cos_sin(batch.positions, dtype)
        # segment tensors for the kinds that read paged latent rows; the V4 kinds read their request states
        kinds = {p.kind: KindStep.build(batch, p) for p in route.plans if p.kind in LATENT_KINDS}
        spans = tuple((s.query_start, s.query_len, s.context_len, s.state_slot) for s in batch.seqs)
        return StepContext(
            batch.positions,
            batch.slot_mapping,
            route,
            kinds,
            cos,
            sin,
            batch.state_slots,
            batch.token_state_slots,
            spans,
            tuple(s.block_table for s in batch.seqs),
            tuple(s.snapshot_at for s in batch.seqs),
            batch.page_size,
            tuple(s.num_draft for s in batch.seqs),
        )

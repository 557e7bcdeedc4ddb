"""DeepSeek-V4 inside the engine: the runner's model interface over the V4 stack and the cache's request states.

Notation
  T tokens of the step (decodes first), B sequences; per sequence b (StepContext.seq_spans, plain ints):
  rows a_b .. a_b+n_b-1 of the step, positions c_b .. c_b+n_b-1 (c_b = context_len), state slot s_b
  per layer i, the cache's tensors of its request states (config/layer_kinds.py _v4_layer), slot s_b:
    window [W, D]  kv_carry [2, m, width]  kv_overlap [2, m, D]  kv_pool [P, D]  (index_* likewise, CSA)
A sequence's layer state is built as views of its slot (state.py `over`), with the counters derived from
c_b alone: pool rows = c_b // m, carry fill = c_b % m (the window ring needs none). Every write of the
model's state code (ring index_copy_, pool rows, carry rows) lands in the cache slot, so the next step of
that sequence continues exactly; the runner zeroed the slot when the sequence (re)started.
Attention (attention.py): the softmax runs once for the step over keys padded to [B, K] (batched_attention,
the default) or per sequence (the plain reference); the state updates (ring, compressors, indexer) loop over
the step's sequences; projections, MoE and mHC run over all T tokens at once.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.cache.model_cache import LayerState as CacheLayer
from mlaserve.cache.model_cache import ModelCache
from mlaserve.executor.step_context import StepContext
from mlaserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlaserve.models.deepseek_v4.rope import V4RopeTables
from mlaserve.models.deepseek_v4.state import (
    CompressedPool,
    CompressorCarry,
    CSAState,
    HCAState,
    LayerState,
    SlidingRing,
    SlidingState,
)


def slot_state(layer: CacheLayer, slot: int, context_len: int) -> LayerState:
    """One layer's state of the sequence in `slot`, as views of the cache tensors, at context_len tokens."""
    t, m = layer.tensors, layer.kind.ratio
    ring = SlidingRing.over(t["window"][slot])
    if layer.kind.attention == "v4_sliding":
        return SlidingState(ring)
    carry = CompressorCarry.over(t["kv_carry"][slot], t["kv_overlap"][slot] if "kv_overlap" in t else None, 0)
    carry.fill = context_len % m
    pool = CompressedPool.over(t["kv_pool"][slot], context_len // m)
    if layer.kind.attention == "v4_hca":
        return HCAState(ring, carry, pool)
    index_carry = CompressorCarry.over(t["index_carry"][slot], t["index_overlap"][slot], context_len % m)
    return CSAState(ring, carry, pool, index_carry, CompressedPool.over(t["index_pool"][slot], context_len // m))


class _MainRope:
    """StepContext's rope (the MLA models' table): V4's layers take their tables from the model itself."""

    def __init__(self, tables: V4RopeTables) -> None:
        self.tables = tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables.cos_sin("main", positions, dtype)


class V4Serving(nn.Module):
    """The runner's model: forward(input_ids, step, cache, native) -> hidden [T, D]; logits(hidden)."""

    def __init__(self, model: DeepseekV4ForCausalLM, batched_attention: bool = True) -> None:
        super().__init__()
        self.inner = model
        self.batched_attention = batched_attention
        for layer in model.model.layers:  # decided once, before any step (attention.py)
            layer.self_attn.batched = batched_attention
        self.config = model.config
        self.rope = _MainRope(model.tables)
        # what the route records as the softmax that runs (attention/router.py route_v4): the same switch
        self.v4_implementation = "torch:padded_batch" if batched_attention else "torch:per_sequence"

    def fused_decode(self, step: StepContext, cache: ModelCache) -> None:
        return None  # no native decode layer for V4 yet: the ledger says per_op

    def forward(self, input_ids: torch.Tensor, step: StepContext, cache: ModelCache, native=None) -> torch.Tensor:
        spans = []
        for a, n, start, slot in step.seq_spans:
            if slot is None:
                raise ValueError("a DeepSeek-V4 step needs every sequence's state slot")
            spans.append((a, n, start, [slot_state(layer, slot, start) for layer in cache.layers]))
        # the route decided whether the CSA layers run their top-k (plain data of the step, never inferred)
        csa = next((p for p in step.route.plans if p.kind == "v4_csa"), None)
        return self.inner.forward_spans(input_ids, step.positions, spans, csa_dense=csa is not None and not csa.sparse)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.lm_head(hidden).float()

"""DeepSeek-V4 inside the engine: the runner's model interface over the V4 stack and the cache's states.

Notation
  T tokens of the step (decodes first), B sequences; per sequence b (StepContext.seq_spans, plain ints):
  rows a_b .. a_b+n_b-1 of the step, positions c_b .. c_b+n_b-1 (c_b = context_len), state slot s_b, block
  table pages_b (StepContext.block_tables)
  per layer i, the cache's tensors (config/layer_kinds.py _v4_layer):
    request states, slot s_b:  window [W, D]  kv_carry [2, m, width]  kv_overlap [2, m, D]  (index_* likewise)
    paged pools, one row per m tokens:  kv_pool [S + 1, D]  index_pool [S + 1, c]; row r of sequence b at slot
      pages_b[r // R] * R + r % R,  R = page_size / m rows per page
A sequence's layer state is built as views of its slot (state.py `over`) and its pools as state.PagedPool, with the
counters derived from c_b alone: pool rows = c_b // m, carry fill = c_b % m (the ring needs none). The pools' row
slots are computed for all sequences at once per distinct ratio (`pool_slots`), and each layer reads the rows its
sequences had before the step with one index_select (state.StepRows); the rows the step's chunks close are written
with one index_copy_ per pool tensor after the forward (StepRows.flush). Every write of the model's state code (ring
index_copy_, pool rows, carry rows) lands in the cache, so the next step of that sequence continues exactly; the
runner zeroed the slot when the sequence (re)started, or restored it from a page's snapshot at a prefix hit.
Snapshots (prefix caching on): at each page boundary its chunk reaches (StepContext.snapshots), a layer
saves the sequence's ring and overlap halves into that page's snapshot rows (state.Snapshots).
Attention (attention.py): the softmax runs once for the step over keys padded to [B, K] (batched_attention,
the default) or per sequence (the plain reference); with both defaults every sequence's keys (ring rows, pool
rows) and the CSA top-k are read at once through the step's key plan (step_keys.py, computed here once per step
and per ratio), otherwise in a loop over the sequences; the state updates (ring, compressors, indexer) run batched
over the step's sequences (batched_state, the default: step_update.py, the index tensors computed here once per
step, per ratio, with the page-boundary snapshots written from the same data) or per sequence (the plain
reference, snapshots saved between pieces); projections, MoE and mHC run over all T tokens at once. Both
switches are constructor data, recorded in the route's implementation (`torch:<softmax>+<state update>`).
forward returns the mHC streams after the last layer [T, N*D] (the MTP layer's input); `logits` collapses the
logits rows only (hc_head, norm, head). Speculative decoding (mtp.py, rollback.py): a verify step's tape keeps what
`rollback` needs to put the rejected drafts' state changes back; `draft` runs the MTP layer over its own cache.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mlaserve.cache.model_cache import LayerState as CacheLayer
from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.v4_numerics import TRANSFORMERS, V4Numerics
from mlaserve.executor.step_context import StepContext
from mlaserve.kernels.registry import KernelPlan
from mlaserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlaserve.models.deepseek_v4.rollback import RollbackTape, rollback
from mlaserve.models.deepseek_v4.rope import V4RopeTables
from mlaserve.models.deepseek_v4.state import (
    CompressorCarry,
    CSAState,
    HCAState,
    LayerState,
    PagedPool,
    SlidingRing,
    SlidingState,
    Snapshots,
    StepRows,
)
from mlaserve.models.deepseek_v4.step_keys import StepKeys, step_keys
from mlaserve.models.deepseek_v4.step_update import LayerStep, RingPlan, WindowPlan, ring_plan, window_plan

# per sequence: (rows it had before the step, slots of the rows its chunk may close)
PoolSlots = tuple[torch.Tensor, list[int], list[torch.Tensor]]


def pool_slots(
    tables: tuple[tuple[int, ...], ...], spans: tuple, ratio: int, page_size: int, device: torch.device
) -> PoolSlots:
    """For a ratio m, every sequence's pool row slots through its block table, computed for all sequences at
    once: -> (gather: the slots of each sequence's rows before the step, in batch order; starts [B + 1] of
    each sequence's part of it; per sequence the slots of rows c_b // m .. (c_b + n_b) // m - 1)."""
    per_page = page_size // ratio
    old = [c // ratio for _, _, c, _ in spans]
    total = [(c + n) // ratio for _, n, c, _ in spans]
    counts = np.array(total, dtype=np.int64)  # numpy: plain int arithmetic (step_keys.py says why)
    seq = np.repeat(np.arange(len(spans)), counts)
    first = np.cumsum(counts) - counts  # each sequence's first row in the flat list
    r = np.arange(int(counts.sum())) - first[seq]
    flat = np.array([p for t in tables for p in t], dtype=np.int64)
    lens = np.array([len(t) for t in tables], dtype=np.int64)
    table_start = np.cumsum(lens) - lens
    slots = flat[table_start[seq] + r // per_page] * per_page + r % per_page
    gather = torch.from_numpy(slots[r < np.array(old, dtype=np.int64)[seq]]).to(device)
    slots = torch.from_numpy(slots).to(device)
    starts = [0]
    for o in old:
        starts.append(starts[-1] + o)
    at = [0]
    for t in total:
        at.append(at[-1] + t)
    new = [slots[at[b] + old[b] : at[b + 1]] for b in range(len(spans))]  # views: slices of one tensor
    return gather, starts, new


def step_states(
    step: StepContext,
    layer: CacheLayer,
    slots: dict[int, PoolSlots],
    pools: list[StepRows],
    plans: tuple[RingPlan, dict[int, WindowPlan], StepKeys | None] | None = None,
    tape: RollbackTape | None = None,
    index: int = 0,
    per_sequence: bool = True,
) -> tuple[list[LayerState | None], LayerStep | None]:
    """One layer's state of every sequence of the step: views of its slots, its paged pools (one StepRows per
    pool tensor for the step, appended to `pools` for the flush), and where it saves its page snapshots; with
    `plans` (the batched update's, for the step) the layer's LayerStep, which then writes the snapshots.
    per_sequence False (with `plans`, where the layers' attention reads every sequence's keys at once: no form
    then reads a sequence's own state objects) -> None per sequence instead of its objects (~45 us a sequence and
    layer: 0.7 ms of a 16-request step of the 4-layer benchmark model, a 2-core AMX Xeon)."""
    t, kind, m = layer.tensors, layer.kind, layer.kind.ratio
    snapped = [s.name for s in kind.per_request if s.snapshot and s.name + "_snapshot" in t]
    kv_rows = index_rows = None
    if kind.attention != "v4_sliding":
        gather, starts, new = slots[m]
        kv_rows = StepRows(t["kv_pool"], gather, starts)
        index_rows = StepRows(t["index_pool"], gather, starts) if "index_pool" in t else None
        pools.extend(r for r in (kv_rows, index_rows) if r is not None)
    if plans is not None and not per_sequence:
        ring_steps, windows, keys = plans
        return [None] * len(step.seq_spans), LayerStep(
            ring_steps, windows.get(m), t, kv_rows, index_rows, tape, index, keys
        )
    out = []
    for b, ((_, _, context_len, slot), at) in enumerate(zip(step.seq_spans, step.snapshots)):
        reference_saves = at and plans is None  # the batched update writes the snapshots itself
        saves = Snapshots(at, [(t[name][slot], t[name + "_snapshot"]) for name in snapped]) if reference_saves else None
        ring = SlidingRing.over(t["window"][slot])
        if kind.attention == "v4_sliding":
            out.append(SlidingState(ring, saves))
            continue
        carry = CompressorCarry.over(t["kv_carry"][slot], t["kv_overlap"][slot] if "kv_overlap" in t else None, 0)
        carry.fill = context_len % m
        pool = PagedPool(kv_rows, b, context_len // m, new[b])
        if kind.attention == "v4_hca":
            out.append(HCAState(ring, carry, pool, saves))
            continue
        index_carry = CompressorCarry.over(t["index_carry"][slot], t["index_overlap"][slot], context_len % m)
        index_pool = PagedPool(index_rows, b, context_len // m, new[b])
        out.append(CSAState(ring, carry, pool, index_carry, index_pool, saves))
    if plans is None:
        return out, None
    ring_steps, windows, keys = plans
    batched = LayerStep(ring_steps, windows.get(m), t, kv_rows, index_rows, tape, index, keys)
    return out, batched


def v4_implementation(batched_attention: bool, batched_state: bool, softmax_kernel: str = "torch") -> str:
    """What the route records as running (attention/router.py route_v4): the softmax's kernel and form, then the
    state update. padded_batch with batched_state also reads every sequence's keys and CSA top-k at once (the key
    plan comes with the batched update's); padded_batch with per_sequence_state reads them in a loop over the
    sequences. softmax_kernel: the padded softmax's implementation, the KernelPlan's op sink_attention (native:
    one C call over the allowed keys; torch); the per-sequence reference is torch's."""
    softmax = "padded_batch" if batched_attention else "per_sequence"
    kernel = softmax_kernel if batched_attention else "torch"
    return f"{kernel}:{softmax}+{'batched' if batched_state else 'per_sequence'}_state"


class _MainRope:
    """StepContext's rope (the MLA models' table): V4's layers take their tables from the model itself."""

    def __init__(self, tables: V4RopeTables) -> None:
        self.tables = tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables.cos_sin("main", positions, dtype)


class V4Serving(nn.Module):
    """The runner's model: forward(input_ids, step, cache, native) -> hidden [T, D]; logits(hidden)."""

    def __init__(
        self,
        model: DeepseekV4ForCausalLM,
        batched_attention: bool = True,
        batched_state: bool = True,
        numerics: V4Numerics = TRANSFORMERS,
    ) -> None:
        super().__init__()
        self.inner = model
        model.set_numerics(numerics)  # the official-code roundings the engine resolved (config/v4_numerics.py)
        self.batched_attention = batched_attention
        # the state updates: batched over the step's sequences (step_update.py) or the per-sequence reference
        self.batched_state = batched_state
        for layer in model.model.layers:  # decided once, before any step (attention.py)
            layer.self_attn.batched = batched_attention
        self.config = model.config
        # the loader built the MTP layer (speculative="mtp"): it drafts from the trunk's mHC streams
        self.mtp_drafts_streams = hasattr(model, "mtp")
        self.rope = _MainRope(model.tables)
        # what the route records as the softmax that runs (attention/router.py route_v4): the same switch
        # and the state update that runs (the switch forward reads)
        self.v4_implementation = v4_implementation(batched_attention, batched_state)

    def take_plan(self, plan: KernelPlan) -> None:
        """The loader's KernelPlan (made after any expert-parallel cut), kept for the ledger, whose implementation
        then names the padded softmax's kernel the plan bound (op sink_attention)."""
        self.kernel_plan = plan
        kernels = "/".join(sorted({c.impl for c in plan.choices if c.op == "sink_attention"})) or "torch"
        self.v4_implementation = v4_implementation(self.batched_attention, self.batched_state, kernels)

    def fused_decode(self, step: StepContext, cache: ModelCache) -> None:
        return None  # no native decode layer for V4 yet: the ledger says per_op

    @property
    def rolls_back(self) -> bool:
        """Whether a verify step's request states can be rolled back (rollback.py replays the batched update)."""
        return self.batched_state

    def forward(
        self,
        input_ids: torch.Tensor,
        step: StepContext,
        cache: ModelCache,
        native=None,
        tape: RollbackTape | None = None,
    ) -> torch.Tensor:
        """-> the mHC streams after the last layer, flattened [T, N*D] (the MTP layer's input; `logits` applies
        hc_head, the norm and the head). tape: a verify step's RollbackTape (RollbackTape.build), which
        the layers fill with their projections of the verifying rows."""
        if any(slot is None for *_, slot in step.seq_spans):
            raise ValueError("a DeepSeek-V4 step needs every sequence's state slot")
        if tape is not None and not self.batched_state:
            raise ValueError("a verify step's rollback replays the batched state update (batched_state=True)")
        ratios = {layer.kind.ratio for layer in cache.layers if layer.kind.attention != "v4_sliding"}
        device = input_ids.device
        slots = {m: pool_slots(step.block_tables, step.seq_spans, m, step.page_size, device) for m in ratios}
        pools: list[StepRows] = []
        plans = None
        if self.batched_state:  # the step's update as index tensors, once per step (W) and per ratio
            window = self.config.attention.sliding_window
            ring = ring_plan(step.seq_spans, step.snapshots, window, device)
            windows = {m: window_plan(step.seq_spans, step.snapshots, m, torch.cat(slots[m][2])) for m in ratios}
            # the keys every sequence reads (ring rows, pool rows per ratio) and the queries' padded layout
            # the CPU's pool slots as numpy (views) for the native key gather's plan (LayerKeys.direct)
            gathers = {m: slots[m][0].numpy() for m in ratios} if device.type == "cpu" else None
            plans = (ring, windows, step_keys(step.seq_spans, window, ratios, device, gathers))
        # a layer whose attention reads every sequence's keys at once (its `batched`) with the batched update needs
        # no per-sequence state objects: it reads the step's tensors
        attns = [layer.self_attn for layer in self.inner.model.layers]
        built = [
            step_states(step, layer, slots, pools, plans, tape, i, plans is None or not attns[i].batched)
            for i, layer in enumerate(cache.layers)
        ]
        per_layer = [states for states, _ in built]
        steps = [batched for _, batched in built] if plans is not None else None
        spans = [
            (a, n, start, [states[b] for states in per_layer]) for b, (a, n, start, _) in enumerate(step.seq_spans)
        ]
        # the route decided whether the CSA layers run their top-k (plain data of the step, never inferred)
        csa = next((p for p in step.route.plans if p.kind == "v4_csa"), None)
        h = self.inner.forward_spans(
            input_ids, step.positions, spans, csa_dense=csa is not None and not csa.sparse, steps=steps, streams=True
        )
        for rows in pools:  # the rows the step closed, one write per pool tensor
            rows.flush()
        return h.flatten(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, N*D] (forward's streams) -> [n, V] float32."""
        h = hidden.view(hidden.shape[0], self.config.hc.hc_mult, self.config.hidden_size)
        return self.inner.lm_head(self.inner.head_hidden(h)).float()

    def verify_tape(self, step: StepContext, cache: ModelCache, request_ids: tuple[str, ...]) -> RollbackTape | None:
        """The rollback protocol's first half (models/rollback.py): the verifying slots' states before the step."""
        return RollbackTape.build(step, cache, step.drafts, request_ids)

    def rollback(self, tape: RollbackTape, kept: list[int], cache: ModelCache, page_size: int) -> None:
        """After a verify step's verdict: kept[j] tokens of the tape's sequence j stay (rollback.py)."""
        attns = [layer.self_attn for layer in self.inner.model.layers]
        with torch.inference_mode():
            rollback(tape, kept, cache, attns, self.inner.tables, page_size, pool_slots)

    def draft(self, layer, input_ids: torch.Tensor, streams: torch.Tensor, step: StepContext, cache: ModelCache):
        """The MTP layer (mtp.V4MTPLayer) over a draft step: input_ids [T] the next tokens t_{i+1}, streams
        [T, N, D] the trunk's (or its own) streams at i; cache: its own one-layer cache (a ring per slot)
        -> its output streams [T, N, D]."""
        if any(slot is None for *_, slot in step.seq_spans):
            raise ValueError("a DeepSeek-V4 MTP step needs every sequence's state slot")
        window = self.config.attention.sliding_window
        # no key plan: the MTP layer's attention reads each sequence's keys (its `batched` stays False)
        plans = (ring_plan(step.seq_spans, step.snapshots, window, input_ids.device), {}, None)
        states, batched = step_states(step, cache.layers[0], {}, [], plans)
        spans = [(a, n, start, states[b]) for b, (a, n, start, _) in enumerate(step.seq_spans)]
        embedded = self.inner.model.embed_tokens(input_ids)
        return layer.draft(embedded, streams, input_ids, step.positions, spans, self.inner.tables, batched)

    def draft_logits(self, layer, streams: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output streams [n, N, D] -> [n, V] float32 (its hc_head and norm, the trunk's head)."""
        return self.inner.lm_head(layer.collapse(streams)).float()

"""The static-shape decode step a CUDA graph captures: a pure decode batch padded to its GraphPlan's bucket.

Notation
  n      real sequences (rows 0 .. n-1), P = bucket rows, L = context_pages * page_size keys
  input_ids, positions, slot_mapping [P]   padding rows: token 0, position 0, the pad slot
  q_index [P, 1] = arange(P), q_valid [P, 1] all True (padding rows are computed, their outputs dropped)
  kv_slots [P, L]  a real row's cache rows up to its seq_len, the pad slot after; a padding row: the pad slot
  mask [P, 1, L]   key allowed iff key position < seq_len (a padding row: key 0, so its softmax stays finite)
Real rows read only their own keys (masked columns get probability 0), so their logits are those of the eager
unpadded step up to the order of fp32 sums (BLAS blocks by row count, softmax over a longer masked row).

Padding rows write their latent row (and index key) into the pad slot, which every masked key position reads: the
written row is finite (0 x finite = 0 keeps the real rows' sums), and `zero_pad_rows` writes zeros back at the end
of the step (inside the graph), so the pad slot is a zero row again for every later step, as ModelCache promises.
Every shape here is a function of (P, L); the step itself reads nothing on the host (executor/host_sync.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mlaserve.attention.backends import get_backend
from mlaserve.attention.metadata import SegmentTensors
from mlaserve.attention.plan import AttentionPlan, StepRoute
from mlaserve.cache.model_cache import ModelCache
from mlaserve.executor.forward_batch import ForwardBatch
from mlaserve.executor.graph_plan import GraphPlan, graph_scoring
from mlaserve.executor.step_context import KindStep, StepContext
from mlaserve.models.deepseek import DecoderLayer
from mlaserve.models.layers import RotaryEmbedding
from mlaserve.models.moe import Experts, MoE


@dataclass(frozen=True)
class PaddedStep:
    """A padded decode step: its input ids and its StepContext, every tensor of fixed shape for the bucket."""

    input_ids: torch.Tensor  # [P]
    step: StepContext

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor, in a fixed order: a replay copies a new step's tensors into the captured ones."""
        out = [self.input_ids, self.step.positions, self.step.slot_mapping, self.step.cos, self.step.sin]
        for kind in sorted(self.step.kinds):
            for seg in self.step.kinds[kind].segments:
                out += [seg.q_index, seg.q_valid, seg.kv_slots, seg.mask, seg.seq_lens, seg.valid_flat, seg.out_index]
        return out


def pad_decode_step(
    batch: ForwardBatch, route: StepRoute, plan: GraphPlan, rope: RotaryEmbedding, dtype: torch.dtype, page_size: int
) -> PaddedStep:
    """The batch (a pure decode step the plan replays) padded to plan.bucket rows and plan.context_pages pages."""
    if not plan.replay:
        raise ValueError(f"pad_decode_step: the step is not replayed ({plan.reason})")
    p, n, pad = plan.bucket, plan.real_rows, batch.pad_slot
    length = plan.context_pages * page_size
    dev = batch.input_ids.device
    fill = torch.zeros(p - n, dtype=torch.long, device=dev)
    ids = torch.cat([batch.input_ids, fill])
    positions = torch.cat([batch.positions, fill])
    slot_mapping = torch.cat([batch.slot_mapping, fill + pad])
    seg_tensors = _padded_segment(batch, p, length, page_size, pad, dev)
    kinds = {q.kind: _padded_kind(q, seg_tensors, p) for q in route.plans}
    cos, sin = rope.cos_sin(positions, dtype)
    step = StepContext(positions, slot_mapping, StepRoute(tuple(k.plan for k in kinds.values())), kinds, cos, sin)
    return PaddedStep(ids, replace(step, page_size=page_size))


def _padded_kind(plan: AttentionPlan, seg: SegmentTensors, p: int) -> KindStep:
    """The kind's one decode segment, its token range widened to the bucket's rows (its index scoring the graph's)."""
    (segment,) = plan.segments
    wide = replace(segment, token_end=p, seq_end=p, index_scoring=graph_scoring(segment.index_scoring))
    return KindStep(replace(plan, segments=(wide,)), (replace(seg, segment=wide),), (get_backend(wide.backend),))


def _padded_segment(
    batch: ForwardBatch, p: int, length: int, page_size: int, pad: int, dev: torch.device
) -> SegmentTensors:
    """The decode segment's index tensors for P rows and L keys (built on the host, moved once)."""
    seqs = batch.seqs
    n = len(seqs)
    seq_lens = torch.ones(p, dtype=torch.long)  # a padding row: one key (the pad slot)
    seq_lens[:n] = torch.tensor([s.seq_len for s in seqs])
    table = torch.full((p, length // page_size), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    k_pos = torch.arange(length)
    slots = table[:, k_pos // page_size] * page_size + (k_pos % page_size)[None, :]
    keep = k_pos[None, :] < seq_lens[:, None]
    keep[n:] = False  # a padding row reads the pad slot only
    kv_slots = torch.where(keep, slots, torch.tensor(pad, dtype=torch.long))
    mask = (k_pos[None, :] < seq_lens[:, None])[:, None, :]
    rows = torch.arange(p)
    segment = None  # set by _padded_kind
    q_pos = (seq_lens - 1)[:, None]  # each row's one query is its last position (a padding row: 0)
    tensors = (rows[:, None], torch.ones(p, 1, dtype=torch.bool), kv_slots, mask, seq_lens, rows, rows.clone(), q_pos)
    return SegmentTensors(segment, *(t.to(dev) for t in tensors), (length,))


def zero_pad_rows(cache: ModelCache) -> None:
    """Write the pad slot's zero row back into every paged state the padding rows wrote (latent rows, index keys)."""
    pad = cache.pad_slot
    for layer in cache.layers:
        for t in layer.tensors.values():
            if isinstance(t, torch.Tensor) and t.shape[0] > pad:
                t[pad].zero_()


def run_padded(model, cache: ModelCache, padded: PaddedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The step a graph captures: (logits [P, V] float32, hidden [P, D]) of every bucket row; the pad rows zeroed
    after. The eager reference of a replay, and the body of its capture."""
    hidden = model(padded.input_ids, padded.step, cache, None)
    logits = model.logits(hidden)
    zero_pad_rows(cache)
    return logits, hidden


def capture_blocker(model: torch.nn.Module) -> str | None:
    """Why this model's decode step cannot be captured, from its modules (decided once at load), or None: weights
    held quantized (FP8 / GGUF / INT4 holders: their kernels are not checked for capture), routed experts other
    than the grouped bf16 GEMM (the per-expert loop reads the active experts on the host; torch._grouped_mm's
    other dtypes fall back to a loop over offsets copied to the host), experts spread over processes, or decoder
    layers other than models/deepseek.py's DecoderLayer (the one held to the guard in the tests)."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    other = next((type(layer).__name__ for layer in layers if type(layer) is not DecoderLayer), None)
    if other is not None:  # LongCat-Flash's two-sublayer layers, identity experts: not held to the guard
        return f"decoder layers of class {other} (not checked for capture)"
    for name, m in model.named_modules():
        if type(m).__module__.startswith("mlaserve.quant"):
            return f"quantized weights ({name}: {type(m).__name__}) are not checked for capture"
        if not isinstance(m, MoE):
            continue
        if m.expert_shard is not None:
            return f"{name}: expert parallelism (its experts' all-reduce)"
        e = m.experts
        if type(e) is not Experts:
            return f"{name}.experts held as {type(e).__name__} (not checked for capture)"
        if e.impl == "loop":
            return "experts_impl 'loop' (its loop over the active experts reads them on the host)"
        if e.gate_up_proj.dtype != torch.bfloat16:
            return (
                f"routed experts in {str(e.gate_up_proj.dtype).removeprefix('torch.')}: torch._grouped_mm takes "
                "bf16 only and falls back to a loop over group offsets read on the host"
            )
    return None

"""Whether a step replays a CUDA graph, and which one: plain data decided before the step (the ledger records it).

Notation
  n        the step's sequences (each one decode token on a replayed step)
  bucket   the batch rows of the graph: the least of 1, 2, 4, ... >= n (up to max_batch); rows n .. bucket-1 are
           padding (token 0 at position 0, writing the pad slot, reading only the pad slot; their logits dropped)
  pages    the pages of the step's longest sequence, ceil(max seq_len / page_size)
  context  the graph's key axis in pages: the least power of two >= pages (capped at the pool's num_pages): every
           row's kv_slots [bucket, context * page_size], positions past a sequence reading the pad slot, masked
Why a context bucket: a captured graph has fixed shapes, and attention's cost grows with the key axis. One graph
at the longest context would make every short step pay for the longest; one per page count would capture
hundreds. Powers of two cost at most 2x the keys of the step and log2(num_pages) + 1 graphs per batch bucket.

A step is replayed only when it is a pure decode (every sequence one token), on the torch or triton attention
backend (triton: its split of the key axis and every launch grid are functions of the padded shapes, so fixed per
graph; `key_splits` records the split), with
no request states (their slots are zeroed, restored and snapshotted on the host's word), no speculative verify,
no native decode layers (CPU C calls), a cache in the compute dtype, float weights (quantized holders are not
checked for capture), the plain decoder layer (not LongCat-Flash's), routed experts in bf16 (torch._grouped_mm's
other dtypes read the group offsets on the host) and no kind other than MLA / MLA+DSA (DeepSeek-V4's and KDA's
layers run per sequence over request states); each refusal says which. A selecting DSA segment the route scores
bf16_then_fp32 (whose rescoring width is read on the host, torch_index.py) is scored in fp32 in the graph: the
top-k both are built to find. Everything else runs eagerly, as every step always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.attention.backends.triton_kernels.key_split import split_plan
from mlaserve.attention.plan import StepRoute
from mlaserve.config.layer_kinds import LATENT_KINDS
from mlaserve.executor.forward_batch import ForwardBatch

# the backends whose padded decode step is held to executor/host_sync.py's guard in the tests (triton: under
# Triton's interpreter on CPU, whose own host copies of the kernel arguments are no part of a compiled launch)
GRAPH_BACKENDS = ("torch", "triton")
# bf16_then_fp32 index scoring reads its rescoring width on the host (torch_index.py); a replayed step scores every
# key in fp32 instead, the top-k both are built to find (recorded in the ledger's graph field)
GRAPH_SCORING = "fp32"


@dataclass(frozen=True)
class GraphSettings:
    """What the runner knows once: the resolved option and the cache's geometry."""

    enabled: bool  # cuda_graphs resolved (config/machine.py choose_cuda_graphs)
    max_batch: int  # cuda_graph_max_batch
    page_size: int
    num_pages: int  # the pool's pages: no sequence holds more, so no context bucket exceeds it
    disabled_why: str = "cuda_graphs off"  # the provenance of the off switch, for the refusal
    request_states: bool = False  # the model keeps request-addressed states (KDA, DeepSeek-V4)
    quantized_cache: bool = False  # kv_cache_dtype is 8-bit (rows dequantized per read: not checked for capture)
    model_blocker: str | None = None  # why the model's weights cannot be captured (padded_decode.capture_blocker)


@dataclass(frozen=True)
class GraphPlan:
    replay: bool
    reason: str | None = None  # why not replayed (None when replayed)
    bucket: int | None = None  # batch rows of the graph
    context_pages: int | None = None  # key axis of the graph, in pages
    real_rows: int = 0  # the step's sequences (rows 0 .. real_rows - 1 of the bucket)
    # per latent kind, what changes the captured ops: (kind, path, sparse, needs_selection, index_scoring)
    shape: tuple[tuple, ...] = ()
    # a selecting segment the route scores bf16_then_fp32 is scored in fp32 in the graph (GRAPH_SCORING)
    rescored: bool = False
    # the triton backend's latent MQA split of the graph's key axis (context_pages * page_size keys), fixed per
    # graph: the kernels take it from that padded shape, never from the step's real lengths (None: no triton segment)
    key_splits: int | None = None

    @property
    def key(self) -> tuple:
        """The graph this step replays: one capture per key."""
        return (self.bucket, self.context_pages, self.shape)

    def to_record(self) -> dict:
        if not self.replay:
            return {"replayed": False, "reason": self.reason}
        rec = {"replayed": True, "bucket": self.bucket, "context_pages": self.context_pages, "rows": self.real_rows}
        rec |= {"key_splits": self.key_splits} if self.key_splits is not None else {}
        return rec | ({"index_scoring": GRAPH_SCORING} if self.rescored else {})


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch (max_batch itself the last bucket when not a power of two)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The least bucket holding n rows, or None above max_batch."""
    return next((b for b in batch_buckets(max_batch) if b >= n), None)


def context_bucket(pages: int, num_pages: int) -> int:
    """The least power of two >= pages, capped at the pool's num_pages (pages <= num_pages always)."""
    c = 1
    while c < pages:
        c *= 2
    return min(c, num_pages)


def plan_graph(batch: ForwardBatch, route: StepRoute, s: GraphSettings, native_decode: bool = False) -> GraphPlan:
    """The step's graph plan: replayed with its bucket, or not with the reason."""
    why = _refusal(batch, route, s, native_decode)
    if why is not None:
        return GraphPlan(False, why)
    n = len(batch.seqs)
    pages = -(-max(q.seq_len for q in batch.seqs) // s.page_size)
    scorings = [seg.index_scoring for p in route.plans for seg in p.segments]
    shape = tuple(
        (p.kind, seg.path, p.sparse, p.needs_selection, graph_scoring(seg.index_scoring))
        for p in route.plans
        for seg in p.segments
    )
    rescored = "bf16_then_fp32" in scorings
    context = context_bucket(pages, s.num_pages)
    triton = any(seg.backend == "triton" for p in route.plans for seg in p.segments)
    splits = split_plan(context * s.page_size).splits if triton else None
    return GraphPlan(True, None, batch_bucket(n, s.max_batch), context, n, shape, rescored, splits)


def graph_scoring(scoring: str | None) -> str | None:
    """A segment's index scoring in a replayed step."""
    return GRAPH_SCORING if scoring == "bf16_then_fp32" else scoring


def _refusal(batch: ForwardBatch, route: StepRoute, s: GraphSettings, native_decode: bool) -> str | None:
    if not s.enabled:
        return s.disabled_why
    if not batch.seqs:
        return "empty step"
    if batch.num_decode_seqs < len(batch.seqs):
        return "prefill or mixed step (graphs replay pure decode steps only)"
    if any(q.num_draft for q in batch.seqs):
        return "speculative verify step (its drafts are verified eagerly)"
    if any(q.query_len != 1 for q in batch.seqs):
        return "a decode chunk of more than one token (decode_threshold > 1)"
    if s.request_states or batch.state_slots is not None:
        return "the model keeps request states (their slots are reset, restored and snapshotted per step on the host)"
    if s.model_blocker is not None:
        return s.model_blocker
    if s.quantized_cache:
        return "8-bit kv_cache_dtype (its dequantizing reads are not checked for capture)"
    if native_decode:
        return "native decode layers (CPU C calls)"
    if len(batch.seqs) > s.max_batch:
        return f"{len(batch.seqs)} sequences > cuda_graph_max_batch {s.max_batch}"
    for p in route.plans:
        if p.kind not in LATENT_KINDS:
            return f"attention kind {p.kind!r} (runs per sequence over request states)"
        if p.pooled is not None:
            return "pooled DSA route (its completed pools are counted on the host)"
        for seg in p.segments:
            if seg.backend not in GRAPH_BACKENDS:
                return f"attention backend {seg.backend!r} (only {GRAPH_BACKENDS} is checked for capture)"
    return None

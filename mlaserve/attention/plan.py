"""The route as data: per attention kind, the segments of the step and each one's path (made by router.py).

A step's `StepRoute` holds one `AttentionPlan` per attention kind present in the stack
(config/layer_kinds.py), and which layers each one serves. Backends and segment tensors read these
types; nothing here decides anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlaserve.config.layer_kinds import layer_ranges


@dataclass(frozen=True)
class Segment:
    phase: str  # "decode" | "prefill"
    path: str  # "absorbed" | "decompressed" | V4's "window..." | KDA's "recurrent" | "chunked"
    sparse: bool
    token_start: int
    token_end: int
    seq_start: int  # index into batch.seqs
    seq_end: int
    request_ids: tuple[str, ...]
    backend: str = "torch"  # the attention backend that runs this segment (attention.backends registry)
    implementation: str = "torch:absorbed"  # backend:operation, e.g. "torch:sparse_absorbed"
    index_scoring: str | None = None  # "fp32" | "bf16_then_fp32" | "bf16" when this segment selects its top-k
    kind: str = "mla"  # the attention kind whose layers run this segment
    # layers of several attention sublayers (LongCat-Flash): the cache state of each sublayer that runs this
    # segment, in order (the kind's AttentionPlan.sublayers); () for one attention per layer
    sublayers: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class RequestRows:
    """One request's rows under a DeepSeek-V4 kind, at the chunk's last query (position t)."""

    request_id: str
    window_rows: int  # min(t + 1, W): ring rows attended
    compressed_rows: int  # (t + 1) // m: compressed rows visible (HCA attends them all)
    selected_rows: int  # CSA: min(index_topk, compressed_rows), the effective top-k; HCA: = compressed_rows
    carry_fill: int  # tokens buffered in the open compression window after the chunk: seq_len % m


@dataclass(frozen=True)
class KindRows:
    """A DeepSeek-V4 kind's rows for the step: per request, and summed over every query token of the step."""

    window: int
    ratio: int  # 0: sliding only
    index_topk: int  # 0: not CSA
    requests: tuple[RequestRows, ...]
    window_rows: int  # sums over the step's query tokens
    compressed_rows: int
    selected_rows: int

    def to_record(self) -> dict:
        return {
            "window": self.window,
            "ratio": self.ratio,
            "index_topk": self.index_topk or None,
            "window_rows": self.window_rows,
            "compressed_rows": self.compressed_rows,
            "selected_rows": self.selected_rows,
            "requests": [asdict(r) for r in self.requests],
        }


@dataclass(frozen=True)
class PooledRequest:
    """One request's pooled selection (GLM-5.3-Flash) at its chunk's last query, position t."""

    request_id: str
    pools_scored: int  # (t + 1) // kpool: the complete pools the query scores
    pools_selected: int  # min(index_topk // kpool, pools_scored): the effective top-k, in pools
    tail: int  # (t + 1) % kpool: the incomplete pool's tokens, always kept


@dataclass(frozen=True)
class PooledRows:
    """The pooled DSA route of an mla_dsa kind (models/pooled_indexer.py): per request at the chunk's last query,
    and summed over every query token of the step; the same in every layer of the kind (functions of positions)."""

    kpool: int
    pools_per_query: int  # index_topk // kpool: the most pools a query keeps
    selecting_layers: tuple[int, ...]  # layers with their own pooled indexer (they score and select)
    sharing_layers: tuple[int, ...]  # "shared" layers: the selection of the nearest previous selecting layer
    new_pools: int  # pools this step completes (each pooled once and kept in index_pools)
    requests: tuple[PooledRequest, ...]
    pools_scored: int  # sums over the step's query tokens
    pools_selected: int
    tail: int

    def to_record(self) -> dict:
        return {
            "kpool": self.kpool,
            "pools_per_query": self.pools_per_query,
            "selecting_layers": layer_ranges(self.selecting_layers),
            "sharing_layers": layer_ranges(self.sharing_layers),
            "new_pools": self.new_pools,
            "pools_scored": self.pools_scored,
            "pools_selected": self.pools_selected,
            "tail": self.tail,
            "requests": [asdict(r) for r in self.requests],
        }


@dataclass(frozen=True)
class AttentionPlan:
    """One attention kind's route for the step."""

    segments: tuple[Segment, ...]
    sparse: bool
    index_topk: int | None  # configured top-k on sparse steps, None when dense
    effective_topk: int | None  # min(index_topk, longest sequence in the step): rows a query can keep
    # False when every sequence fits in index_topk: the top-k would keep every causal row, so the
    # indexer only writes its keys and attention runs over all rows (identical result, no scoring).
    needs_selection: bool = False
    kind: str = "mla"
    layers: tuple[int, ...] = ()  # the layers of this kind
    rows: KindRows | None = None  # DeepSeek-V4 kinds: the rows each request's queries attend (router.py)
    # layers of several attention sublayers (LongCat-Flash): the latent state each sublayer reads and writes, in
    # order; every sublayer executes these segments. () for one attention per layer
    sublayers: tuple[str, ...] = ()
    state_bytes_per_request: int = 0  # request-addressed state the kind's layers keep per running request (KDA)
    chunk: int = 0  # KDA: the chunked form's length its "chunked" segment runs (router.py KDA_CHUNK)
    pooled: PooledRows | None = None  # a sparse mla_dsa kind with a pooled indexer (GLM-5.3-Flash): its counts
    # "shared" indexer layers: (layer, the selecting layer whose selection it reuses), from LayerKind.reuses
    reuses: tuple[tuple[int, int], ...] = ()

    def counts(self) -> dict[str, int]:
        return _counts(self.segments)

    def to_record(self) -> dict:
        return {
            **self.counts(),
            "sparse": self.sparse,
            "index_topk": self.index_topk,
            "effective_topk": self.effective_topk,
            "needs_selection": self.needs_selection,
            "segments": [_segment_record(s) for s in self.segments],
        }


@dataclass(frozen=True)
class StepRoute:
    """Every attention kind's plan for one step; plan_of(kind) is what a layer of that kind executes."""

    plans: tuple[AttentionPlan, ...]

    def plan_of(self, kind: str) -> AttentionPlan:
        for p in self.plans:
            if p.kind == kind:
                return p
        raise KeyError(f"no route planned for attention kind {kind!r}; planned: {[p.kind for p in self.plans]}")

    @property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(s for p in self.plans for s in p.segments)

    @property
    def sparse(self) -> bool:
        return any(p.sparse for p in self.plans)

    def to_record(self) -> dict:
        """The ledger's route fields. Token counts and segments cover every kind (a token counts once per
        kind that attends it); index fields are the sparse kind's; `kinds` says which layers each serves."""
        sparse = next((p for p in self.plans if p.sparse), None)
        return {
            **_counts(self.segments),
            "sparse": sparse is not None,
            "index_topk": sparse.index_topk if sparse else None,
            "effective_topk": sparse.effective_topk if sparse else None,
            "needs_selection": any(p.needs_selection for p in self.plans),
            "segments": [_segment_record(s) for s in self.segments],
            "kinds": [_kind_record(p) for p in self.plans],
        }


def _counts(segments: tuple[Segment, ...]) -> dict[str, int]:
    mqa = sum(s.num_tokens for s in segments if s.path == "absorbed")
    mha = sum(s.num_tokens for s in segments if s.path == "decompressed")
    sparse = sum(s.num_tokens for s in segments if s.sparse)
    return {"num_mqa_tokens": mqa, "num_mha_tokens": mha, "num_sparse_tokens": sparse}


def _segment_record(s: Segment) -> dict:
    rec = asdict(s)
    if s.sublayers:
        rec["sublayers"] = list(s.sublayers)
    else:
        del rec["sublayers"]  # one attention per layer: nothing to say
    rec["request_ids"] = list(s.request_ids)
    rec["num_tokens"] = s.num_tokens
    return rec


def _kind_record(p: AttentionPlan) -> dict:
    rec = {"kind": p.kind, "layers": layer_ranges(p.layers), "sparse": p.sparse, **p.counts()}
    if p.sublayers:  # which sublayer writes which cache state (a token's segments run once per sublayer)
        rec["sublayers"] = [{"sublayer": j, "state": name} for j, name in enumerate(p.sublayers)]
    if p.state_bytes_per_request:
        rec["state_bytes_per_request"] = p.state_bytes_per_request
    if p.chunk:
        rec["chunk"] = p.chunk
    if p.pooled is not None:
        rec["pooled"] = p.pooled.to_record()
    if p.reuses:  # which selection each shared indexer layer reuses (docs/GLM5_NEXT.md: after KDA layers too)
        rec["reuses"] = [{"layer": layer, "selection_of": of} for layer, of in p.reuses]
    return rec | ({"rows": p.rows.to_record()} if p.rows is not None else {})

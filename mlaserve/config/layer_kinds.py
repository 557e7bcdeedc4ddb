"""Layer kinds and the cache state each one needs, declared per layer as plain data.

A model is a stack of layers; each layer has an *attention kind* and needs some *cache states*. The
router plans each kind's route (attention/router.py), the cache allocates each state (cache/), and the
ledger records both, so nothing downstream infers a layer's kind from a tensor or a config key.

Attention kinds today
  mla      Multi-head Latent Attention over paged latent rows [c_kv | k_pe] (DeepSeek-V2/V3, GLM-4.7-Flash)
  mla_dsa  MLA with a DSA lightning indexer: a "full" layer owns an indexer and caches its keys, a
           "shared" layer reuses the previous full layer's top-k (DeepSeek-V3.2, GLM-5)
  kda      Kimi Delta Attention (Kimi-Linear's linear-attention layers, models/kda): no paged rows; two request
           states, `recurrent` [H, d, d] fp32 and `conv` [K-1, 3 H d] (kda_states), both snapshotted at page
           boundaries (the layer splits a chunk at each boundary it reaches), so prefix caching stays on
A kind is the architecture's: an mla_dsa layer run with attention="dense" keeps its kind, its route says
sparse=False and it caches no index keys (the engine's choice, recorded in provenance).

Cache states (StateSpec)
  addressing "page": rows in the shared page pool. One block table per request serves every paged state;
  a page of page_size tokens holds page_size / tokens_per_row rows of each state (tokens_per_row 1 for
  latent rows and index keys). So page_size must be a multiple of every state's tokens_per_row
  (check_page_size), and a prefix-cached page carries every paged state of its tokens.
  addressing "request": a fixed-size state per running request, [*per_request, width], that does not
  grow with the sequence (a recurrent state, a compressor carry, a ring window). The cache keeps one
  slot of it per running request (cache/slot_pool.py assigns slots on the scheduling rank, at admission;
  freed at finish, abort, failure and preemption) plus a zero pad slot; SeqChunk.state_slot names a
  request's slot and SeqChunk.reset_state says the runner zeroes it before the step (the chunk starts
  the sequence at token 0: first admission, or re-admission after preemption without a prefix hit).
  Prefix caching: a request state cannot be recomputed from paged rows, so a prefix hit is exact only
  if the state can be restored at the page boundary the hit ends at: `snapshot` (the state is saved there)
  or `empty_at_page_boundary` (it holds nothing a later token reads there: a compressor's open window, the
  page being a multiple of its ratio; a hit restores it by zeroing). A stack with a request state that is
  neither runs with prefix caching off (prefix_caching_blocker; the reason is recorded in provenance).
  The snapshot hook (built): with prefix caching on, ModelCache keeps a companion `<name>_snapshot`
  [num_pages + 1, *per_request, width] per snapshotted state, one row per page (the state after the page's
  last token), written by the layer when a chunk crosses or ends on the boundary (SeqChunk.snapshot_at ->
  StepContext.snapshots: (k, page), plain data); a prefix hit restores the slot from the row of the last
  cached page (SeqChunk.restore_page, ModelCache.restore_states) instead of zeroing it. Every page in the
  prefix cache has its rows: a page is named only once full, by the step that wrote them. Speculative
  decoding is refused with request states (a rejected draft cannot be rolled out of a state).

Kinds the next families need, and where they plug in (docs/ARCHITECTURE.md, "Layer and cache kinds"):
  linear attention (KDA): a recurrent state per request ("request", per_request=(H, dk), width dv,
  dtype float32) plus its short-conv state ("request", per_request=(kernel - 1,)), snapshot=True for the
  prefix cache (the layer writes its rows at StepContext.snapshots). A layer reads and writes a request state
  at StepContext.state_slots (per sequence) or token_state_slots (per token) of its LayerState tensor.
Two MLA sublayers per decoder layer (LongCat-Flash, family sublayers=2): one LayerKind of kind mla with two
latent states, "latent" (sublayer 0) then "latent_1" (sublayer 1); `sublayers` names each sublayer's state,
both sublayers execute the kind's plan, and the route records which state each sublayer writes.
DeepSeek-V4 (family layer_kinds "deepseek_v4", config/deepseek_v4.py) declares one kind per layer from
its layer_types / compress_ratios:
  v4_sliding  window [W x D] request, snapshot            the K=V rows of the last W positions (a ring)
  v4_hca      window + kv_carry [2 x m x D] request, empty at page boundaries + kv_pool [D] per m tokens, paged
  v4_csa      window + kv_carry [2 x m x 2D] (empty at page boundaries) + kv_overlap [2 x m x D] request, snapshot
              + kv_pool [D] per m tokens, paged + index_carry [2 x m x 2c] + index_overlap [2 x m x c]
              + index_pool [c] per m tokens, paged
  (W sliding_window, D head_dim, m the layer's ratio, c index_head_dim; a carry holds the open window's raw kv
  rows then its gate rows; an overlap the Ca half of the last closed window)
The pools are paged (a page of page_size tokens holds page_size / m rows; memory grows with the context), so
page_size is a multiple of every ratio: V4's default is 256 (vLLM's) rounded up to one (config/deepseek_v4_layers.py
v4_page_size, recorded in provenance). A page boundary is then a multiple of every m, so every carry is empty there
and only the ring and the overlap halves need snapshots. The counters (rows filled, carry fill) are not stored: they
are functions of the sequence's context_len (rows = context_len // m, fill = context_len % m).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.row_format import RowFormat

ATTENTION_KINDS = ("mla", "mla_dsa", "v4_sliding", "v4_csa", "v4_hca", "kda")
# kinds whose layers read the paged latent rows through the segment tensors (attention/metadata.py)
LATENT_KINDS = ("mla", "mla_dsa")
# how a state's rows are found: "page" by the request's block table, "request" by the request's state slot
ADDRESSING = ("page", "request")


@dataclass(frozen=True)
class StateSpec:
    """One cache state a layer keeps. "page": `width` values per row, one row per `tokens_per_row` tokens.
    "request": one [*per_request, width] block per running request (tokens_per_row does not apply)."""

    name: str  # "latent" | "index_keys" | a request state's name
    width: int
    tokens_per_row: int = 1
    addressing: str = "page"
    per_request: tuple[int, ...] = ()  # "request": the leading dims of a request's block (rows, or heads x dk)
    snapshot: bool = False  # "request": snapshotted at page boundaries (prefix caching stays exact)
    # "request": holds nothing a later token reads at any page boundary, so a prefix hit restores it by zeroing
    # (a compressor's open-window carry: page_size is a multiple of its ratio, so the window is empty there)
    empty_at_page_boundary: bool = False
    dtype: torch.dtype | None = None  # None: the cache dtype (a recurrent state may need float32)
    quant: RowFormat | None = None  # 8-bit rows (config/row_format.py, kv_cache_dtype); None: in the dtype above

    def __post_init__(self) -> None:
        if self.addressing not in ADDRESSING:
            raise ConfigError(f"state {self.name!r}: addressing {self.addressing!r} is not one of {ADDRESSING}")
        if self.addressing == "page" and (self.per_request or self.snapshot or self.empty_at_page_boundary):
            raise ConfigError(
                f"state {self.name!r}: per_request, snapshot and empty_at_page_boundary apply to 'request' "
                "addressing only"
            )
        if self.snapshot and self.empty_at_page_boundary:
            raise ConfigError(f"state {self.name!r}: a state empty at page boundaries needs no snapshot")
        if self.addressing == "request" and self.tokens_per_row != 1:
            raise ConfigError(f"state {self.name!r}: a 'request' state has no rows per token (tokens_per_row 1)")
        if self.width < 1 or any(d < 1 for d in self.per_request):
            raise ConfigError(f"state {self.name!r}: dims must be >= 1, got {(*self.per_request, self.width)}")

    def rows(self, num_pages: int, page_size: int) -> int:
        return num_pages * page_size // self.tokens_per_row

    @property
    def request_shape(self) -> tuple[int, ...]:
        """A "request" state's block per request."""
        return (*self.per_request, self.width)

    def values_per_request(self) -> int:
        return math.prod(self.request_shape) if self.addressing == "request" else 0

    def element_size(self, cache_dtype: torch.dtype) -> int:
        return torch.empty((), dtype=self.dtype or cache_dtype).element_size()

    def request_bytes(self, compute_bytes: int) -> int:
        """A "request" state's bytes per request (or per snapshot row): its rows in 8 bits (quant: codes,
        scales, kept values per row) or its values in its dtype (compute_bytes: the cache dtype's size)."""
        if self.addressing != "request":
            return 0
        rows = math.prod(self.per_request)
        if self.quant:
            return rows * self.quant.bytes_per_row(compute_bytes)
        return rows * self.width * (self.element_size(self.dtype) if self.dtype else compute_bytes)

    @property
    def restorable(self) -> bool:
        """A prefix hit can restore this state at a page boundary: a paged state (its rows are the pages'),
        a snapshotted request state, or one that is empty there."""
        return self.addressing == "page" or self.snapshot or self.empty_at_page_boundary

    def bytes_per_row(self, compute_bytes: int) -> int:
        """A paged row's bytes: its 8-bit codes, scales and kept values (quant), else width values."""
        return self.quant.bytes_per_row(compute_bytes) if self.quant else self.width * compute_bytes


@dataclass(frozen=True)
class LayerKind:
    """What one layer is (its attention kind) and what it keeps (its states, in the engine's running form)."""

    index: int  # the layer's index in its stack
    attention: str  # one of ATTENTION_KINDS
    # mla_dsa: "full" (own indexer and keys) | "shared" | "pooled" (GLM-5.3-Flash's pooled indexer,
    # pooled_indexer_states) | None (no indexer in this layer)
    indexer: str | None
    states: tuple[StateSpec, ...]
    # DeepSeek-V4 kinds (0 elsewhere): what the route records of them (attention/router.py)
    window: int = 0  # sliding_window: ring rows a query may attend
    ratio: int = 0  # tokens per compressed row (v4_csa, v4_hca)
    topk: int = 0  # v4_csa: index_topk, compressed rows a query keeps
    # mla_dsa with a pooled indexer (GLM-5.3-Flash, "pooled" and the "shared" layers after it): index_kpool, the
    # tokens per pooled key its route scores (attention/router.py); 0 elsewhere
    kpool: int = 0
    # several attention sublayers per layer (LongCat-Flash): the latent state each one reads and writes, in
    # sublayer order; () for a layer of one attention (its state is "latent")
    sublayers: tuple[str, ...] = ()
    # a "shared" indexer layer: the index of the selecting layer whose selection it reuses (the nearest previous
    # "full" / "pooled" layer; KDA layers between pass it on, docs/GLM5_NEXT.md); None elsewhere
    reuses: int | None = None

    def state(self, name: str) -> StateSpec | None:
        return next((s for s in self.states if s.name == name), None)

    @property
    def paged(self) -> tuple[StateSpec, ...]:
        return tuple(s for s in self.states if s.addressing == "page")

    @property
    def per_request(self) -> tuple[StateSpec, ...]:
        return tuple(s for s in self.states if s.addressing == "request")


def declare_layers(model: ModelConfig, sparse: bool) -> tuple[LayerKind, ...]:
    """Every layer's kind and states. sparse: the engine runs DSA layers sparse (then "full" indexer layers
    cache their keys); a dense run of a DSA model keeps the kind but caches latent rows only. No state is
    sized by the longest sequence (DeepSeek-V4's pools are paged)."""
    if model.family.layer_kinds == "deepseek_v4":
        return tuple(_v4_layer(model, i) for i in range(model.num_layers))
    return _with_reuse(tuple(_layer(model, i, sparse) for i in range(model.num_layers)))


def _with_reuse(layers: tuple[LayerKind, ...]) -> tuple[LayerKind, ...]:
    """Each "shared" indexer layer names the selecting layer it reuses: the nearest previous one with its own
    indexer (what the model's layers pass on, models/deepseek.py Selections). Decided here, as data."""
    out, last = [], None
    for k in layers:
        if k.indexer in ("full", "pooled"):
            last = k.index
        elif k.indexer == "shared" and last is not None:  # none before it: reuses stays None (nothing to reuse)
            k = replace(k, reuses=last)
        out.append(k)
    return tuple(out)


def _v4_layer(model, i: int) -> LayerKind:
    """A DeepSeek-V4 layer (config/deepseek_v4.py DeepseekV4Config): its kind, its paged pools (one row per m
    tokens) and its request states (the ring and the overlap halves snapshotted at page boundaries; the
    carries empty there, since page_size is a multiple of m)."""
    kind = model.layer_kinds[i]
    d, w = model.attention.head_dim, model.attention.sliding_window
    states = [StateSpec("window", d, addressing="request", per_request=(w,), snapshot=True)]
    if kind != "sliding":
        m = model.ratio(i)
        overlap = kind == "csa"
        carry = {"addressing": "request", "per_request": (2, m), "empty_at_page_boundary": True}
        half = {"addressing": "request", "per_request": (2, m), "snapshot": True}
        states.append(StateSpec("kv_carry", 2 * d if overlap else d, **carry))
        if overlap:
            states.append(StateSpec("kv_overlap", d, **half))
        states.append(StateSpec("kv_pool", d, tokens_per_row=m))
        if overlap:
            c = model.compression.index_head_dim
            states.append(StateSpec("index_carry", 2 * c, **carry))
            states.append(StateSpec("index_overlap", c, **half))
            states.append(StateSpec("index_pool", c, tokens_per_row=m))
    ratio = model.ratio(i)
    topk = model.compression.index_topk if kind == "csa" else 0
    return LayerKind(i, f"v4_{kind}", None, tuple(states), window=w, ratio=ratio, topk=topk)


def indexer_role(model: ModelConfig, i: int) -> str | None:
    """Layer i's DSA indexer: "full" (its own), "shared" (the previous full layer's top-k) or None."""
    if model.indexer is None:
        return None
    role = model.indexer.layer_types[i]
    return role if role in ("full", "shared") else None


def attention_kind(model: ModelConfig, i: int) -> str:
    """The family declares the kind of its layers (config/families: `layer_kinds`); a layer without an
    indexer role (an MTP block without indexer weights) is plain MLA. Kimi-Linear's KDA layers are "kda" (which
    layers: ModelConfig.kda, read from the config's layer pattern)."""
    if model.kda is not None and i in model.kda.layers:
        return "kda"
    declared = model.family.layer_kinds
    if declared not in ATTENTION_KINDS:
        raise ConfigError(f"{model.model_type}: layer kind {declared!r} is not one this engine runs: {ATTENTION_KINDS}")
    if indexer_role(model, i) is None:
        return "mla"
    if declared != "mla_dsa":
        raise ConfigError(f"{model.model_type}: layer {i} has a DSA indexer but the family declares {declared!r}")
    return declared


def sublayer_states(model: ModelConfig) -> tuple[str, ...]:
    """The latent state of each attention sublayer of a decoder layer: "latent", then "latent_1", ..."""
    return tuple("latent" if j == 0 else f"latent_{j}" for j in range(model.sublayers))


def _layer(model: ModelConfig, i: int, sparse: bool) -> LayerKind:
    if attention_kind(model, i) == "kda":
        return LayerKind(i, "kda", None, kda_states(model))
    names = sublayer_states(model)
    latents = tuple(StateSpec(name, model.latent_dim) for name in names)
    role = indexer_role(model, i)
    keys: tuple[StateSpec, ...] = ()
    kpool = model.indexer.kpool if role is not None else 0
    if role == "full" and kpool:  # GLM-5.3-Flash: its own pooled indexer
        role = "pooled"
        keys = pooled_indexer_states(model.indexer.head_dim, kpool) if sparse else ()
    elif sparse and role == "full":
        keys = (StateSpec("index_keys", model.indexer.head_dim),)
    subs = names if len(names) > 1 else ()
    return LayerKind(i, attention_kind(model, i), role, (*latents, *keys), sublayers=subs, kpool=kpool)


def kda_states(model: ModelConfig) -> tuple[StateSpec, ...]:
    """A KDA layer's request states: the delta rule's fp32 state [H, d, d] and the short conv's last K-1 inputs of
    q, k and v [K-1, 3 H d] (the cache dtype: the inputs are the model's projections). Both are snapshotted at
    page boundaries (models/kda/layer.py saves them after each boundary a chunk reaches), so a prefix hit
    restores them exactly and prefix caching stays on."""
    kda = model.kda
    return (
        StateSpec(
            "recurrent",
            kda.head_dim,
            addressing="request",
            per_request=(kda.num_heads, kda.head_dim),
            dtype=torch.float32,
            snapshot=True,
        ),
        StateSpec("conv", 3 * kda.width, addressing="request", per_request=(kda.conv_kernel - 1,), snapshot=True),
    )


def pooled_indexer_states(head_dim: int, kpool: int) -> tuple[StateSpec, ...]:
    """GLM-5.3-Flash's pooled DSA indexer (models/pooled_indexer.py), two paged states: `index_rows` [k | gate]
    per token (the open tail pool and each pool's inputs) and `index_pools`, one pooled key per kpool tokens,
    written once by the step that completes the pool (so page_size is a multiple of kpool: check_page_size).
    A prefix hit reads both from the cached pages: nothing per request, nothing to snapshot."""
    return (StateSpec("index_rows", 2 * head_dim), StateSpec("index_pools", head_dim, tokens_per_row=kpool))


def attention_summary(model: ModelConfig, sparse: bool) -> str:
    """The attention a load runs, in words (the CLI's loaded line, the server's ready line)."""
    if model.family.layer_kinds == "deepseek_v4":
        return "window + compressed (DeepSeek-V4)"
    return "sparse" if sparse else "dense"


def kinds_in_order(layers: tuple[LayerKind, ...]) -> tuple[str, ...]:
    """The distinct attention kinds of a stack, in the order their first layer appears."""
    return tuple(dict.fromkeys(k.attention for k in layers))


def check_page_size(layers: tuple[LayerKind, ...], page_size: int) -> None:
    """A page must hold whole rows of every paged state (a compressed pool's ratio divides the page)."""
    for layer in layers:
        for s in layer.states:
            if s.addressing == "page" and page_size % s.tokens_per_row:
                raise ConfigError(
                    f"page_size={page_size}: layer {layer.index}'s {s.name} keeps one row per {s.tokens_per_row} "
                    f"tokens; page_size must be a multiple of {s.tokens_per_row}"
                )


def describe(layers: tuple[LayerKind, ...], bytes_per_value: int, page_size: int | None = None) -> list[str]:
    """`mlaserve inspect`'s lines: layers grouped by kind, indexer role and states, with cache bytes per token
    (paged states), per request (request states, one slot per running request) and, given page_size, the
    page-boundary snapshots of request states per token (one snapshot per page, kept with prefix caching on)."""
    groups: dict[tuple, list[int]] = {}
    for k in layers:
        groups.setdefault((k.attention, k.indexer, k.states), []).append(k.index)
    lines = []
    for (attention, indexer, states), ids in groups.items():
        role = f", indexer {indexer}" if indexer else ""
        kept = " + ".join(_describe_state(s) for s in states)
        paged = [s for s in states if s.addressing == "page"]
        # a row of one per m tokens counts 1/m of its bytes (not floored: an 8-bit row's bytes need not divide)
        per_token = sum(s.bytes_per_row(bytes_per_value) / s.tokens_per_row for s in paged) * len(ids)
        sizes = f"{per_token:g} bytes/token"

        # a request state of its own dtype (a float32 recurrent state in a bf16 cache) counts its own size, an
        # 8-bit one (DeepSeek-V4's ring under kv_cache_dtype fp8_e4m3) its codes, scales and kept values
        def size(s: StateSpec) -> int:
            return s.request_bytes(bytes_per_value)

        snapped = sum(size(s) for s in states if s.snapshot)
        if snapped and page_size:
            sizes += f" + {snapped * len(ids) / page_size:g} bytes/token of snapshots with prefix caching"
        per_request = sum(size(s) for s in states)
        if per_request:
            sizes += f", {per_request * len(ids)} bytes/request"
        lines.append(f"layers {layer_ranges(ids)}: {attention}{role}; cache: {kept} ({sizes})")
    return lines


def describe_route(layers: tuple[LayerKind, ...], sparse: bool, index_topk: int | None) -> list[str]:
    """`mlaserve inspect`'s "attention route" lines: per attention kind, what its layers attend (the route
    attention/router.py plans every step from these kinds and the engine's sparse / index_topk)."""
    lines = []
    for kind in kinds_in_order(layers):
        of = [k for k in layers if k.attention == kind]
        if kind == "kda":
            text = "linear attention: each request's recurrent state, no cached rows attended"
        elif kind == "mla":
            text = "dense: every cached row"
        elif kind == "mla_dsa":
            text = _dsa_route(of, sparse, index_topk)
        else:
            text = "window + compressed rows (DeepSeek-V4)"
        lines.append(f"layers {layer_ranges([k.index for k in of])}: {kind}: {text}")
    return lines


def _dsa_route(of: list[LayerKind], sparse: bool, topk: int | None) -> str:
    kpool = max(k.kpool for k in of)
    if not sparse:
        exact = topk + kpool - 1 if kpool else topk
        return f"dense (attention='dense'): every cached row, the indexer unused; the same attention while a context is <= {exact} tokens"
    if kpool:
        text = (
            f"pooled DSA sparse: a query scores its complete pools of {kpool} tokens, keeps the top {topk // kpool} "
            f"(index_topk {topk} // index_kpool {kpool}) expanded to their tokens, and its incomplete pool's tokens "
            f"(< {kpool})"
        )
    else:
        text = f"DSA sparse: a query keeps the top {topk} cached rows by its indexer's score"
    shared = [k for k in of if k.indexer == "shared"]
    if shared:
        which = ", ".join(f"{k.index} <- {k.reuses}" for k in shared)
        text += f"; layers {layer_ranges([k.index for k in shared])} reuse the nearest previous selecting layer's selection ({which})"
        across = [k.index for k in shared if k.reuses != k.index - 1]
        if across:
            text += f"; layers {layer_ranges(across)} reuse it across KDA layers (this engine's decision: transformers raises there)"
    return text


def _describe_state(s: StateSpec) -> str:
    if s.addressing == "request":
        dtype = f" {str(s.dtype).removeprefix('torch.')}" if s.dtype else ""
        snap = (
            "snapshots at page boundaries"
            if s.snapshot
            else "empty at page boundaries"
            if s.empty_at_page_boundary
            else "no snapshots"
        )
        quant = f" as {s.quant.label()}" if s.quant else ""  # DeepSeek-V4's ring under kv_cache_dtype fp8_e4m3
        return f"{s.name} [{' x '.join(map(str, s.request_shape))}]{dtype}{quant} per request ({snap})"
    quant = f" as {s.quant.label()}" if s.quant else ""
    return f"{s.name} [{s.width}]{quant}" + (f" per {s.tokens_per_row} tokens" if s.tokens_per_row > 1 else "")


def request_states(layers: tuple[LayerKind, ...]) -> tuple[tuple[int, StateSpec], ...]:
    """(layer index, spec) of every "request" state in the stack; empty for today's models."""
    return tuple((k.index, s) for k in layers for s in k.per_request)


def snapshot_states(layers: tuple[LayerKind, ...]) -> tuple[tuple[int, StateSpec], ...]:
    """(layer index, spec) of every request state kept with page-boundary snapshots."""
    return tuple((i, s) for i, s in request_states(layers) if s.snapshot)


def prefix_caching_blocker(layers: tuple[LayerKind, ...]) -> str | None:
    """Why prefix caching must be off for this stack, or None. A request state that is neither snapshotted at
    page boundaries nor empty there cannot be restored at the end of a cached prefix (it is not a function of
    the paged rows), so a prefix hit would resume from a zeroed state: wrong."""
    for index, s in request_states(layers):
        if not s.restorable:
            return (
                f"layer {index}'s request state {s.name!r} has no page-boundary snapshot, so a prefix-cache hit "
                "could not restore it (prefix caching off)"
            )
    return None


def layer_ranges(ids: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    if not ids:
        return ""
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)

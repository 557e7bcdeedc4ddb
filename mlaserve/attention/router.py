"""The attention route: which tokens take which MLA path, decided as data before the forward pass.

Per attention kind (config/layer_kinds.py): route_step plans every kind present in the stack, each for
the layers of that kind; a kind's plan is sparse when the kind has an indexer (mla_dsa) and the engine
runs sparse. The plans are data (attention/plan.py) that the ledger records before the math runs.

Paths
  absorbed      MQA over the latent rows: W_UK folded into the query, W_UV applied after
  decompressed  MHA: cached context + chunk up-projected through kv_b, causal attention
Phases
  decode   requests whose query length <= decode_threshold (their tokens come first in the batch)
  prefill  the rest (prompt chunks)
mla_path "auto" sends decode -> absorbed, prefill -> decompressed; "absorbed" / "decompressed"
send every token down one path, so a user can check that both give the same answer.
With sparse attention (DSA) every token goes down the absorbed path over its top-k rows
(as vLLM's sparse backend does), unless mla_path="decompressed" asks for masked MHA.
Index scoring (how a selecting segment finds its top-k; the first two give the fp32 top-k)
  fp32            every key scored in fp32 (keys upcast from the cache dtype), as transformers does
  bf16_then_fp32  over a bf16 key cache: bf16 GEMMs score every key with a rounding bound, and only
                  the keys that may be in the top-k are rescored in fp32
  bf16            the engine's index_scores="bf16" (config/index_scores.py): q and keys rounded to bf16,
                  fp32 sums; a lossy choice, recorded as such (the pooled indexer keeps fp32)
Backend
  every segment names the attention backend that runs it (engine option attention_backend; the
  registry in attention/backends), and that backend's index scoring for the key cache's dtype.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlaserve.attention.backends import get_backend
from mlaserve.attention.plan import (
    AttentionPlan,
    KindRows,
    PooledRequest,
    PooledRows,
    RequestRows,
    Segment,
    StepRoute,
)
from mlaserve.attention.pooled_metadata import completed_pools
from mlaserve.config.engine import MLA_PATHS
from mlaserve.config.layer_kinds import LATENT_KINDS, LayerKind, kinds_in_order
from mlaserve.executor.forward_batch import ForwardBatch

KDA_CHUNK = 64  # the KDA chunked form's length (transformers' / fla's), carried by the plan to the layer


def path_for(phase: str, mla_path: str, sparse: bool) -> str:
    if mla_path != "auto":
        return mla_path
    if sparse:
        return "absorbed"
    return "absorbed" if phase == "decode" else "decompressed"


def route(
    batch: ForwardBatch,
    mla_path: str,
    sparse: bool = False,
    index_topk: int | None = None,
    key_dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    kind: str = "mla",
    layers: tuple[int, ...] = (),
    sublayers: tuple[str, ...] = (),
    kpool: int = 0,
    sharing: tuple[int, ...] = (),
    index_scores: str = "fp32",
) -> AttentionPlan:
    """Split the batch into at most two segments (decode, prefill) and name each one's path.
    key_dtype: the indexer key cache's dtype (it picks the index scoring of selecting segments).
    sublayers: the cache state of each attention sublayer of these layers (LongCat-Flash), recorded.
    kpool: a pooled indexer's tokens per pooled key (GLM-5.3-Flash; 0: DSA's per-token indexer); sharing: the
    layers of `layers` that reuse a previous layer's selection ("shared"), recorded. index_scores: the engine's
    (config/index_scores.py): "bf16" names every selecting per-token segment's scoring "bf16"."""
    if mla_path not in MLA_PATHS:
        raise ValueError(f"mla_path must be one of {MLA_PATHS}, got {mla_path!r}")
    if sparse and index_topk is None:
        raise ValueError("a sparse route needs index_topk")
    kernels = get_backend(backend)  # an unknown name fails here, before the ledger records it
    longest = max((s.seq_len for s in batch.seqs), default=0)
    pooled = sparse and kpool > 0
    # per-token DSA selects once a sequence is longer than index_topk; the pooled route once a query has more
    # complete pools than it keeps (below that its selection is every complete pool plus the tail: every token)
    select = sparse and (longest // kpool > index_topk // kpool if pooled else longest > index_topk)
    scoring = None
    if select:
        scoring = "fp32" if pooled else "bf16" if index_scores == "bf16" else kernels.index_scoring(key_dtype)
    n_dec = batch.num_decode_seqs
    bounds = [("decode", 0, n_dec), ("prefill", n_dec, len(batch.seqs))]
    segments = []
    for phase, lo, hi in bounds:
        if lo == hi:
            continue
        seqs = batch.seqs[lo:hi]
        path = path_for(phase, mla_path, sparse)
        segments.append(
            Segment(
                phase=phase,
                path=path,
                sparse=sparse,
                token_start=seqs[0].query_start,
                token_end=seqs[-1].query_start + seqs[-1].query_len,
                seq_start=lo,
                seq_end=hi,
                request_ids=tuple(s.request_id for s in seqs),
                backend=backend,
                implementation=_implementation(backend, path, sparse, select, pooled),
                index_scoring=scoring,
                kind=kind,
                sublayers=sublayers,
            )
        )
    effective = min(index_topk, longest) if sparse else None
    if pooled:  # the selected pools' rows (the tail adds up to kpool - 1 more)
        effective = min(index_topk // kpool, longest // kpool) * kpool
    return AttentionPlan(
        segments=tuple(segments),
        sparse=sparse,
        index_topk=index_topk if sparse else None,
        effective_topk=effective,
        needs_selection=select,
        kind=kind,
        layers=layers,
        sublayers=sublayers,
        pooled=pooled_rows(batch, kpool, index_topk, layers, sharing) if pooled else None,
    )


def pooled_rows(
    batch: ForwardBatch, kpool: int, index_topk: int, layers: tuple[int, ...], sharing: tuple[int, ...]
) -> PooledRows:
    """The pooled route's counts (models/pooled_indexer.py), from the chunks' positions alone: a query at t scores
    the (t + 1) // kpool complete pools, keeps min(index_topk // kpool, that) of them and the (t + 1) % kpool tokens
    of its incomplete pool; sums over a chunk's queries in closed form (pooled_sums)."""
    k = index_topk // kpool
    requests, sums, new = [], [0, 0, 0], 0
    for s in batch.seqs:
        hi, lo = pooled_sums(s.seq_len, kpool, k), pooled_sums(s.context_len, kpool, k)
        for i in range(3):
            sums[i] += hi[i] - lo[i]
        new += len(completed_pools(s.context_len, s.seq_len, kpool))
        scored = s.seq_len // kpool
        requests.append(PooledRequest(s.request_id, scored, min(k, scored), s.seq_len % kpool))
    selecting = tuple(i for i in layers if i not in sharing)
    return PooledRows(kpool, k, selecting, sharing, new, tuple(requests), *sums)


def pooled_sums(n: int, kpool: int, k: int) -> tuple[int, int, int]:
    """Over queries at t = 0 .. n - 1 (m = t + 1 = 1 .. n): sum of m // P (pools scored), of min(k, m // P) (pools
    selected) and of m % P (tail tokens), P = kpool. With F(n) = sum m // P = P q (q - 1) / 2 + q (r + 1) for
    n = q P + r: m // P <= k exactly while m <= (k + 1) P - 1 = n0, so the selected sum is F(min(n, n0)) plus k per
    query after n0; the tails are sum m - P F(n)."""

    def f(n: int) -> int:
        q, r = divmod(n, kpool)
        return kpool * q * (q - 1) // 2 + q * (r + 1)

    n0 = (k + 1) * kpool - 1
    scored = f(n)
    return scored, f(min(n, n0)) + k * max(0, n - n0), n * (n + 1) // 2 - kpool * scored


def route_step(
    batch: ForwardBatch,
    layers: tuple[LayerKind, ...],
    mla_path: str,
    sparse: bool = False,
    index_topk: int | None = None,
    key_dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    v4_csa_dense: bool = False,
    v4_implementation: str = "torch:padded_batch+batched_state",
    index_scores: str = "fp32",
) -> StepRoute:
    """One plan per attention kind of the stack. sparse: the engine runs DSA kinds sparse. DeepSeek-V4:
    v4_csa_dense, its CSA layers attend every visible compressed row (no top-k); v4_implementation, the
    softmax the model runs (V4Serving.implementation: one padded batch, or per sequence). index_scores: the
    engine's DSA index scores (route's)."""
    plans = []
    for kind in kinds_in_order(layers):
        ids = tuple(k.index for k in layers if k.attention == kind)
        if kind == "kda":  # Kimi-Linear's linear attention over its request states
            kind_of = next(k for k in layers if k.attention == kind)
            plans.append(route_kda(batch, ids, state_bytes(kind_of, key_dtype) * len(ids)))
            continue
        if kind not in LATENT_KINDS:  # DeepSeek-V4: window + compressed rows, per sequence
            kind_of = next(k for k in layers if k.attention == kind)
            plans.append(route_v4(batch, kind_of, ids, v4_csa_dense, v4_implementation))
            continue
        kind_sparse = sparse and kind == "mla_dsa"
        topk = index_topk if kind_sparse else None
        subs = next(k.sublayers for k in layers if k.attention == kind)  # one stack: every layer has the same
        kpool = max(k.kpool for k in layers if k.attention == kind)  # GLM-5.3-Flash's pooled indexer, else 0
        sharing = tuple(k.index for k in layers if k.attention == kind and k.indexer == "shared")
        plan = route(
            batch, mla_path, kind_sparse, topk, key_dtype, backend, kind, ids, subs, kpool, sharing, index_scores
        )
        reuses = tuple((k.index, k.reuses) for k in layers if k.attention == kind and k.reuses is not None)
        plans.append(replace(plan, reuses=reuses) if reuses else plan)
    return StepRoute(tuple(plans))


def route_kda(batch: ForwardBatch, layers: tuple[int, ...], bytes_per_request: int = 0) -> AttentionPlan:
    """The KDA kind's plan (models/kda/layer.py): the leading sequences with one new token each take the batched
    recurrent step ("recurrent", one op over their slots' states), every other sequence its chunk through the
    chunked form ("chunked", KDA_CHUNK tokens at a time). Decided from the chunks' lengths alone, before the math.
    bytes_per_request: the request state the kind's layers keep per running request (the ledger records it)."""
    n_one = 0
    while n_one < len(batch.seqs) and batch.seqs[n_one].query_len == 1:
        n_one += 1
    segments = []
    for path, lo, hi in (("recurrent", 0, n_one), ("chunked", n_one, len(batch.seqs))):
        if lo == hi:
            continue
        seqs = batch.seqs[lo:hi]
        segments.append(
            Segment(
                phase="decode" if lo < batch.num_decode_seqs else "prefill",
                path=path,
                sparse=False,
                token_start=seqs[0].query_start,
                token_end=seqs[-1].query_start + seqs[-1].query_len,
                seq_start=lo,
                seq_end=hi,
                request_ids=tuple(s.request_id for s in seqs),
                backend="torch",
                implementation="torch:kda_step" if path == "recurrent" else f"torch:kda_chunked({KDA_CHUNK})",
                kind="kda",
            )
        )
    return AttentionPlan(
        segments=tuple(segments),
        sparse=False,
        index_topk=None,
        effective_topk=None,
        kind="kda",
        layers=layers,
        state_bytes_per_request=bytes_per_request,
        chunk=KDA_CHUNK,
    )


def state_bytes(kind: LayerKind, cache_dtype: torch.dtype) -> int:
    """One layer's request-state bytes per running request (a state of its own dtype counts its own size)."""
    size = torch.empty((), dtype=cache_dtype).element_size()
    return sum(s.request_bytes(size) for s in kind.per_request)


V4_PATHS = {"v4_sliding": "window", "v4_csa": "window+csa", "v4_hca": "window+hca"}


def route_v4(
    batch: ForwardBatch,
    kind: LayerKind,
    layers: tuple[int, ...],
    csa_dense: bool = False,
    implementation: str = "torch:padded_batch+batched_state",
) -> AttentionPlan:
    """A DeepSeek-V4 kind's plan: its decode and prefill segments (the softmax `implementation` the model
    runs: one padded softmax per step over the sequences' keys, or one per sequence,
    models/deepseek_v4/attention.py) and the rows every query attends, counted from the chunks' positions
    alone (plain data, before the math): query at t attends min(t + 1, W) window rows and (t + 1) // m
    compressed rows, of which CSA keeps min(index_topk, that) (csa_dense: all of them, no top-k); the carry
    then holds seq_len % m tokens."""
    w, m, k = kind.window, kind.ratio, kind.topk
    csa = kind.attention == "v4_csa" and not csa_dense  # the CSA kind runs its indexer's top-k
    if csa_dense:
        k = 0  # every visible compressed row: the counts below then record all of them as selected
    segments, requests, sums = [], [], [0, 0, 0]
    n_dec = batch.num_decode_seqs
    for phase, lo, hi in (("decode", 0, n_dec), ("prefill", n_dec, len(batch.seqs))):
        if lo == hi:
            continue
        seqs = batch.seqs[lo:hi]
        segments.append(
            Segment(
                phase=phase,
                path=V4_PATHS[kind.attention] + ("(dense)" if csa_dense and kind.attention == "v4_csa" else ""),
                sparse=csa,
                token_start=seqs[0].query_start,
                token_end=seqs[-1].query_start + seqs[-1].query_len,
                seq_start=lo,
                seq_end=hi,
                request_ids=tuple(s.request_id for s in seqs),
                backend="torch",
                implementation=implementation,
                kind=kind.attention,
            )
        )
    for s in batch.seqs:
        counts = [_v4_rows(t, w, m, k) for t in range(s.context_len, s.seq_len)]
        for i in range(3):
            sums[i] += sum(c[i] for c in counts)
        last = counts[-1]
        requests.append(RequestRows(s.request_id, *last, carry_fill=s.seq_len % m if m else 0))
    rows = KindRows(w, m, k, tuple(requests), *sums)
    topk = k or None
    longest = max((s.seq_len for s in batch.seqs), default=0)
    return AttentionPlan(
        segments=tuple(segments),
        sparse=csa,
        index_topk=topk,
        effective_topk=min(k, longest // m) if topk else None,
        needs_selection=bool(topk) and longest // m > k,
        kind=kind.attention,
        layers=layers,
        rows=rows,
    )


def _v4_rows(t: int, window: int, ratio: int, topk: int) -> tuple[int, int, int]:
    compressed = (t + 1) // ratio if ratio else 0
    return min(t + 1, window), compressed, min(topk, compressed) if topk else compressed


def _implementation(backend: str, path: str, sparse: bool, select: bool, pooled: bool = False) -> str:
    if not sparse:
        return f"{backend}:{path}"
    if pooled:
        return f"{backend}:pooled_sparse_{path}" + ("" if select else "(every pool within index_topk)")
    return f"{backend}:sparse_{path}" + ("" if select else "(all rows within index_topk)")

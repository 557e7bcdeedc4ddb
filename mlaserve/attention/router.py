"""The attention route: which tokens take which MLA path, decided as data before the forward pass.

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
Index scoring (how a selecting segment finds its top-k; both give the fp32 top-k)
  fp32            every key scored in fp32 (keys upcast from the cache dtype), as transformers does
  bf16_then_fp32  over a bf16 key cache: bf16 GEMMs score every key with a rounding bound, and only
                  the keys that may be in the top-k are rescored in fp32
Backend
  every segment names the attention backend that runs it (engine option attention_backend; the
  registry in attention/backends), and that backend's index scoring for the key cache's dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mlaserve.attention.backends import get_backend
from mlaserve.config.engine import MLA_PATHS
from mlaserve.executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class Segment:
    phase: str  # "decode" | "prefill"
    path: str  # "absorbed" | "decompressed"
    sparse: bool
    token_start: int
    token_end: int
    seq_start: int  # index into batch.seqs
    seq_end: int
    request_ids: tuple[str, ...]
    backend: str = "torch"  # the attention backend that runs this segment (attention.backends registry)
    implementation: str = "torch:absorbed"  # backend:operation, e.g. "torch:sparse_absorbed"
    index_scoring: str | None = None  # "fp32" | "bf16_then_fp32" when this segment selects its top-k

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class AttentionPlan:
    segments: tuple[Segment, ...]
    sparse: bool
    index_topk: int | None  # configured top-k on sparse steps, None when dense
    effective_topk: int | None  # min(index_topk, longest sequence in the step): rows a query can keep
    # False when every sequence fits in index_topk: the top-k would keep every causal row, so the
    # indexer only writes its keys and attention runs over all rows (identical result, no scoring).
    needs_selection: bool = False

    def counts(self) -> dict[str, int]:
        mqa = sum(s.num_tokens for s in self.segments if s.path == "absorbed")
        mha = sum(s.num_tokens for s in self.segments if s.path == "decompressed")
        sparse = sum(s.num_tokens for s in self.segments if s.sparse)
        return {"num_mqa_tokens": mqa, "num_mha_tokens": mha, "num_sparse_tokens": sparse}

    def to_record(self) -> dict:
        return {
            **self.counts(),
            "sparse": self.sparse,
            "index_topk": self.index_topk,
            "effective_topk": self.effective_topk,
            "needs_selection": self.needs_selection,
            "segments": [_segment_record(s) for s in self.segments],
        }


def _segment_record(s: Segment) -> dict:
    rec = asdict(s)
    rec["request_ids"] = list(s.request_ids)
    rec["num_tokens"] = s.num_tokens
    return rec


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
) -> AttentionPlan:
    """Split the batch into at most two segments (decode, prefill) and name each one's path.
    key_dtype: the indexer key cache's dtype (it picks the index scoring of selecting segments)."""
    if mla_path not in MLA_PATHS:
        raise ValueError(f"mla_path must be one of {MLA_PATHS}, got {mla_path!r}")
    if sparse and index_topk is None:
        raise ValueError("a sparse route needs index_topk")
    kernels = get_backend(backend)  # an unknown name fails here, before the ledger records it
    longest = max((s.seq_len for s in batch.seqs), default=0)
    select = sparse and longest > index_topk
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
                implementation=_implementation(backend, path, sparse, select),
                index_scoring=kernels.index_scoring(key_dtype) if select else None,
            )
        )
    return AttentionPlan(
        segments=tuple(segments),
        sparse=sparse,
        index_topk=index_topk if sparse else None,
        effective_topk=min(index_topk, longest) if sparse else None,
        needs_selection=select,
    )


def _implementation(backend: str, path: str, sparse: bool, select: bool) -> str:
    if not sparse:
        return f"{backend}:{path}"
    return f"{backend}:sparse_{path}" + ("" if select else "(all rows within index_topk)")

"""`mlaserve verify` with index_scores="bf16" (config/index_scores.py): the DSA indexer's bf16 scores against fp32
ones, on the prompt, with index_topk lowered to half the prompt where the prompt fits in it (so the top-k selects):
  top-k, bf16 vs fp32 index scores   every per-token indexer's every selecting query: the positions the reference
                                     scoring keeps from the bf16-rounded q and keys vs from fp32, mean and lowest
                                     overlap (reported, not asserted: a rounding may swap a near-tie)
  logits, bf16 vs fp32 index scores  the prompt's logits through the two scorings: max |diff| and top-1, reported
The identities of verify.py run with the engine's bf16 scores on both of their routes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from mlaserve.attention.reference import ReferenceBackend
from mlaserve.entrypoints.verify_kv8 import selection_overlap
from mlaserve.models.indexer import Indexer

if TYPE_CHECKING:
    from mlaserve.config.engine import EngineConfig
    from mlaserve.entrypoints.llm import LLM

REF = ReferenceBackend()


def index_score_checks(llm: LLM, base: EngineConfig, ids: list[int], logits_with: Callable, check: Callable) -> list:
    """-> the two Checks above (built by `check(name, value, top1, tolerance, note)`); base: the identities' config
    (index_scores "bf16")."""
    k = min(base.attention.index_topk, max(1, len(ids) // 2))
    rounded = replace(base, attention=replace(base.attention, sparse=True, index_topk=k))
    exact = replace(rounded, attention=replace(rounded.attention, index_scores="fp32"))
    overlaps: list[torch.Tensor] = []
    with _observed(llm, overlaps):
        got = logits_with(llm, rounded, ids)
    want = logits_with(llm, exact, ids)
    out = []
    if overlaps:
        ov = torch.cat(overlaps)
        note = f"mean overlap {ov.mean().item():.2%}, lowest {ov.min().item():.1%} over {len(ov)} selecting queries"
        out.append(check(f"top-{k}, bf16 vs fp32 index scores", 1.0 - ov.mean().item(), ov.mean().item(), None, note))
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    note = "reported (a swapped near-tie moves the rows attended)"
    out.append(check("logits, bf16 vs fp32 index scores", (got - want).abs().max().item(), top1, None, note))
    return out


@contextmanager
def _observed(llm: LLM, overlaps: list) -> Iterator[None]:
    """Wraps every per-token indexer's select on this model for one run: each selecting query's kept positions from
    bf16 and from fp32 scores (the reference backend's scoring under each label) go into overlaps."""
    indexers = [m for m in llm.loaded.model.modules() if isinstance(m, Indexer)]
    try:
        for ix in indexers:
            ix.select = _select_observer(ix, overlaps)
        yield
    finally:
        for ix in indexers:
            vars(ix).pop("select", None)


def _select_observer(indexer: Indexer, overlaps: list) -> Callable:
    original = indexer.select

    def select(q, w, keys, seg, topk, backend):
        chosen = original(q, w, keys, seg, topk, backend)
        w_scaled = w * indexer.cfg.head_dim**-0.5
        exact, rounded = (
            REF.index_topk(q, w_scaled, keys, replace(seg, segment=replace(seg.segment, index_scoring=s)), topk)
            for s in ("fp32", "bf16")
        )
        overlap = selection_overlap(seg, exact, rounded, topk)
        if overlap is not None:
            overlaps.append(overlap)
        return chosen

    return select

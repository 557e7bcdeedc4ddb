"""`mlaserve verify` with an 8-bit cache (kv_cache_dtype int8 / fp8_e4m3) or a 16-bit one (float16 / bfloat16):
the stored rows against the full ones (the checks below name the 16-bit ones "16-bit cache", "float16 index keys";
their bound starts from the unit roundoff instead of the scales, config/row_format.py).

Run on the prompt through the full cache (the route identities above it run there too: a value within fp32 noise
of a rounding boundary lands on either neighbouring code, so two routes over 8-bit rows may differ by one code
step, which no fp32 tolerance promises away; tests/identities/test_kv8_engine.py):
  8-bit vs full, attention      every layer's every attention call, on the call's own queries and rows: the
                                reference over the rows quantized as the cache keeps them vs over the full rows,
                                against the bound derived from the stored scales (attention/cache_error.py) plus
                                fp32 rounding; reported as the worst |error| / allowed ratio (ok <= 1)
  8-bit vs full, logits         the prompt's logits through the 8-bit cache vs the full cache: max |diff| and
                                top-1, reported (no bound through the whole stack is derived)
  top-k, FP8 vs exact keys      DSA models, full indexer layers: the positions the reference scoring keeps
                                from the FP8 keys vs from the exact keys, mean and lowest overlap over queries
                                that select (reported, not asserted: near-ties may swap); GLM-5.3-Flash's
                                pooled indexer: the tokens its selection keeps from the FP8 pooled keys vs the
                                exact ones, over queries with more complete pools than they keep
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from mlaserve.attention.cache_error import attention_error_bound
from mlaserve.attention.reference import ReferenceBackend
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.row_format import HALF_CODES, index_key_format, latent_format
from mlaserve.models.deepseek import MLAAttention
from mlaserve.models.pooled_indexer import PooledIndexer

if TYPE_CHECKING:
    from mlaserve.config.engine import EngineConfig
    from mlaserve.entrypoints.llm import LLM

REF = ReferenceBackend()
FP32_SLACK = 1e-5  # the two reference runs' fp32 rounding, relative to the output's scale (the backend harness's)


def kv8_pairs(llm: LLM, base: EngineConfig, ids: list[int], logits_with: Callable, check: Callable) -> list:
    """-> Checks (built by `check(name, value, top1, tolerance, note)`) for the engine's kv_cache_dtype; `base`
    is the full-cache config the identities ran with."""
    codes = llm.config.cache.kv_cache_dtype
    half = codes in HALF_CODES
    stats = {"ratio": 0.0, "calls": 0, "overlaps": []}
    with _observed(llm, codes, stats):
        full = logits_with(llm, base, ids)
    eight = logits_with(llm, replace(base, cache=replace(base.cache, kv_cache_dtype=codes)), ids)
    what = f"{16 if half else 8}-bit cache ({codes}) vs full"
    out = cache_checks(check, what, stats, eight, full, "the bound is per attention call")
    if stats["overlaps"]:
        ov = torch.cat(stats["overlaps"])
        out.append(
            check(
                f"top-k from {codes if half else 'FP8'} index keys vs exact keys",
                1.0 - ov.mean().item(),
                ov.mean().item(),
                None,
                f"mean overlap {ov.mean().item():.1%}, lowest {ov.min().item():.1%} over {len(ov)} selecting queries",
            )
        )
    return out


@contextmanager
def _observed(llm: LLM, codes: str, stats: dict) -> Iterator[None]:
    """Wraps every MLA layer's attend (and its indexer's select) on this model, for one full-cache run."""
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, MLAAttention)]
    try:
        for attn in layers:
            attn.attend = _attend_observer(attn, codes, stats)
            if isinstance(attn.indexer, PooledIndexer):
                attn.indexer.select = _pooled_select_observer(attn.indexer, codes, stats)
            elif attn.indexer is not None:
                attn.indexer.select = _select_observer(attn.indexer, codes, stats)
        yield
    finally:
        for attn in layers:
            vars(attn).pop("attend", None)
            if attn.indexer is not None:
                vars(attn.indexer).pop("select", None)


def _attend_observer(attn: MLAAttention, codes: str, stats: dict) -> Callable:
    original = attn.attend
    fmt = latent_format(codes, attn.cfg.latent_dim, attn.cfg.qk_rope_head_dim)

    def attend(backend, q_nope, q_pe, cache, seg, sel, kv_b, tiles=False):
        out = original(backend, q_nope, q_pe, cache, seg, sel, kv_b, tiles)
        eight = QuantizedRows.of(cache.float(), fmt)
        w_uk, w_uv = attn.w_uk_uv(kv_b)
        scale = attn.cfg.softmax_scale
        allowed = sel.as_mask(seg.mask.shape[-1]) if sel is not None else None
        want = REF.absorbed(q_nope, q_pe, cache, w_uk, w_uv, seg, scale, allowed)[seg.q_valid].float()
        got = REF.absorbed(q_nope, q_pe, eight, w_uk, w_uv, seg, scale, allowed)[seg.q_valid].float()
        rows, delta = cache[seg.kv_slots].float(), eight.error(seg.kv_slots)
        bound = attention_error_bound(q_nope, q_pe, rows, delta, w_uk, w_uv, seg, scale, allowed)[seg.q_valid]
        allowed_err = bound + FP32_SLACK * max(1.0, want.abs().max().item())
        stats["ratio"] = max(stats["ratio"], ((got - want).abs() / allowed_err).max().item())
        stats["calls"] += 1
        return out

    return attend


def _select_observer(indexer, codes: str, stats: dict) -> Callable:
    original = indexer.select
    fmt = index_key_format(indexer.cfg.head_dim, codes)

    def select(q, w, keys, seg, topk, backend):
        chosen = original(q, w, keys, seg, topk, backend)
        w_scaled = w * indexer.cfg.head_dim**-0.5
        exact = REF.index_topk(q, w_scaled, keys, seg, topk)
        eight = REF.index_topk(q, w_scaled, QuantizedRows.of(keys.float(), fmt), seg, topk)
        overlap = selection_overlap(seg, exact, eight, topk)
        if overlap is not None:
            stats["overlaps"].append(overlap)
        return chosen

    return select


def selection_overlap(seg, a: torch.Tensor, b: torch.Tensor, topk: int) -> torch.Tensor | None:
    """|kept_a & kept_b| / |kept_a| per selecting query (more allowed keys than topk) of two selections [B, Q, k]
    (positions on the segment's key axis; those the mask disallows not counted); None when no query selects."""
    kept_a, kept_b = (torch.zeros_like(seg.mask).scatter_(2, i, seg.mask.gather(2, i)) for i in (a, b))
    selecting = seg.q_valid & (seg.mask.sum(-1) > topk)
    if not selecting.any():
        return None
    return ((kept_a & kept_b).sum(-1).float() / kept_a.sum(-1).clamp(min=1))[selecting]


def _pooled_select_observer(indexer: PooledIndexer, codes: str, stats: dict) -> Callable:
    """GLM-5.3-Flash's pooled selection (models/pooled_indexer.py select) from the exact pooled keys vs from the
    same keys in FP8 as the cache keeps them (index_key_format): the kept tokens' overlap per selecting query."""
    original = indexer.select
    fmt = index_key_format(indexer.cfg.head_dim, codes)
    keep = indexer.cfg.topk // indexer.cfg.kpool

    def select(q, w, pooled, positions):
        exact = original(q, w, pooled, positions)
        flat = pooled.reshape(-1, pooled.shape[-1])
        eight = QuantizedRows.of(flat.float(), fmt).rows(torch.arange(flat.shape[0])).view(pooled.shape)
        other = original(q, w, eight.to(pooled.dtype), positions)
        selecting = exact.pools_scored > keep  # a query with no more complete pools than it keeps keeps them all
        if selecting.any():
            n = int(positions.max()) + 2  # token positions 0 .. max, then a column for the unused entries
            a, b = (torch.zeros(*s.index.shape[:-1], n, dtype=torch.bool, device=q.device) for s in (exact, other))
            a.scatter_(-1, exact.index.masked_fill(~exact.valid, n - 1), True)
            b.scatter_(-1, other.index.masked_fill(~other.valid, n - 1), True)
            a, b = a[..., : n - 1], b[..., : n - 1]
            stats["overlaps"].append(((a & b).sum(-1).float() / a.sum(-1).clamp(min=1))[selecting])
        return exact

    return select


def cache_checks(check: Callable, what: str, stats: dict, eight: torch.Tensor, full: torch.Tensor, note: str) -> list:
    """The two rows every 8-bit cache check reports: the worst attention call against its derived bound (no call
    observed, e.g. every step ran a fused decode layer, checks nothing: a failure, not a pass), and the logits,
    reported (no bound through the whole stack is claimed)."""
    calls = stats["calls"]
    return [
        check(
            f"{what}: attention, every layer",
            stats["ratio"] if calls else float("inf"),
            1.0,
            1.0,
            f"worst |error| / derived bound over {calls} attention calls (ok <= 1)"
            if calls
            else "no attention call was observed, so nothing was checked",
        ),
        check(
            f"{what}: logits",
            (eight - full).abs().max().item(),
            (eight.argmax(-1) == full.argmax(-1)).float().mean().item(),
            None,
            f"reported ({note})",
        ),
    ]

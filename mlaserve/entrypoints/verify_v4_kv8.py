"""`mlaserve verify` on DeepSeek-V4 with kv_cache_dtype fp8_e4m3: the 8-bit rows against transformers' numerics.

The 8-bit cache equals the full cache with the official FP8 rounding bit for bit (verify.py's identity); these
checks measure what that rounding, which the cache implies, costs against the exact rows (the run's numerics
with v4_kv_rounding none and the compute-dtype cache):
  8-bit vs exact rows, attention  every layer's every attention call of a one-pass prefill, on the call's own
                                  queries, K=V rows (ring, new and compressed rows) and mask (the CSA selection
                                  held fixed; observed at the padded softmax, each sequence's part): the
                                  layer's softmax over the rows quantized as the cache keeps them
                                  vs over the exact rows, against attention/cache_error.py shared_kv_error_bound
                                  plus fp32 rounding (verify_kv8.FP32_SLACK); the worst |error| / allowed (ok <= 1)
  8-bit vs exact rows, logits     the prompt's logits: max |diff| and top-1, reported (no whole-stack bound)
The exact run sets kv_rounding none on the model's layers and puts the engine's numerics back after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mlaserve.attention.cache_error import shared_kv_error_bound
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.engine import EngineConfig
from mlaserve.config.v4_numerics import kv_format
from mlaserve.entrypoints.verify_kv8 import FP32_SLACK, cache_checks
from mlaserve.models.deepseek_v4.attention import V4Attention
from mlaserve.models.deepseek_v4.sink_softmax import keyed_of


def v4_kv8_checks(llm, base: EngineConfig, ids: list[int], logits_with: Callable, check: Callable) -> list:
    """-> Checks (`check(name, value, top1, tolerance, note)`); base: the config the identities ran with."""
    codes = llm.config.cache.kv_cache_dtype
    exact = replace(base, cache=replace(base.cache, kv_cache_dtype="auto"))
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, V4Attention)]
    resolved = llm.config.attention.v4_numerics
    stats = {"ratio": 0.0, "calls": 0}
    try:
        for attn in layers:  # for this run only: the exact rows, and observers over what forward calls
            attn.set_numerics(replace(resolved, kv_rounding="none"))
            attn._attend_padded, attn.attend_step = _observers(attn, stats)
        full = logits_with(llm, exact, ids)
    finally:
        for attn in layers:  # the model's numerics as the engine resolved them (set at load)
            vars(attn).pop("_attend_padded", None)
            attn.kernel = attn.kernel  # attend_step bound again to the plan's implementation
            attn.set_numerics(resolved)
    eight = logits_with(llm, replace(base, cache=replace(base.cache, kv_cache_dtype=codes)), ids)
    what, note = (
        f"8-bit cache ({codes}) vs exact rows",
        "the official FP8 rounding the cache implies; the bound is per attention call",
    )
    return cache_checks(check, what, stats, eight, full, note)


def _observers(attn: V4Attention, stats: dict) -> tuple[Callable, Callable]:
    """Observers of the layer's padded softmax in both its forms: over the loop's per-sequence keys
    (_attend_padded) and over every sequence's keys read at once (attend_step, the engine's path: the plan's
    bound implementation)."""
    padded, step = attn._attend_padded, attn.attend_step
    a = attn.cfg.attention
    fmt = kv_format(a.nope_dim, a.rope_dim)

    def observe(q, keyed):
        # loops over the step's sequences (their key counts differ): a check, off the serving path
        for first, n, keys, visible in keyed:
            rows = keys.float()
            eight = QuantizedRows.of(rows, fmt)
            slots = torch.arange(rows.shape[0], device=rows.device)
            delta = torch.cat([eight.error(slots), rows.new_zeros(rows.shape[0], a.rope_dim)], dim=-1)
            qs = q[first : first + n].float()
            want = attn._attend(qs, rows, visible)
            got = attn._attend(qs, eight.rows(slots), visible)
            bound = shared_kv_error_bound(qs, rows, delta, visible, attn.sinks, attn.scale)
            allowed = bound + FP32_SLACK * max(1.0, want.abs().max().item())
            stats["ratio"] = max(stats["ratio"], ((got - want).abs() / allowed).max().item())
            stats["calls"] += 1

    def attend_padded(q, keyed):
        observe(q, keyed)
        return padded(q, keyed)

    def attend_step(q, keys, mask, queries):
        observe(q, keyed_of(keys, mask, queries))
        return step(q, keys, mask, queries)

    return attend_padded, attend_step

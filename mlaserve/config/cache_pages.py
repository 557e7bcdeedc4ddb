"""The cache pool's geometry, resolved with provenance: tokens per page (the user's, a family's own, or 16) and
pages (the user's, as many as kv_cache_memory GiB holds at the bytes a page takes, or enough for 16 sequences of
2048 tokens)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlaserve.config.deepseek_v4 import v4_page_size
from mlaserve.config.kv_cache import check_kv_cache_dtype, quantize_states
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.options import EngineOptions
from mlaserve.config.provenance import ProvenanceLog

if TYPE_CHECKING:
    import torch

DEFAULT_PAGE_SIZE = 16


def page_size(model: ModelConfig, page_size: int | None, log: ProvenanceLog) -> int:
    """The page size: the user's (recorded as given, and checked against the stack's ratios by the cache), else a
    family's own default (DeepSeek-V4: its compressed pools need a multiple of every compress ratio;
    config/deepseek_v4.py v4_page_size), else the engine's 16. A given value is never replaced."""
    if page_size is not None:
        return page_size
    if model.family is not None and model.family.layer_kinds == "deepseek_v4":
        chosen, why = v4_page_size(model)
        return log.record("page_size", chosen, why)
    return log.record("page_size", DEFAULT_PAGE_SIZE, f"engine default ({DEFAULT_PAGE_SIZE})")


def num_pages(
    opts: EngineOptions,
    page_size: int,
    max_len: int,
    log: ProvenanceLog,
    model: ModelConfig,
    sparse: bool,
    dtype: torch.dtype,
) -> int:
    if opts.kv_cache_memory is not None:
        return _pages_in_memory(opts, page_size, log, model, sparse, dtype)
    if opts.num_pages is not None:
        return log.record("num_pages", opts.num_pages, "user option")
    # Enough for max_num_seqs sequences of up to 2048 tokens, capped: the cache is small (latent rows).
    per_seq = -(-min(max_len, 2048) // page_size)
    n = max(per_seq * min(opts.max_num_seqs, 16), 64)
    return log.record("num_pages", n, f"engine default (16 sequences x {min(max_len, 2048)} tokens)")


def _pages_in_memory(
    opts: EngineOptions, page_size: int, log: ProvenanceLog, model: ModelConfig, sparse: bool, dtype: torch.dtype
) -> int:
    """kv_cache_memory GiB / the bytes a page takes: page_size x the bytes a token's paged rows take in the
    kv_cache_dtype layout, plus the page's snapshot rows of the request states that keep them (with prefix
    caching on, one row per page of each snapshotted state: Kimi-Linear's recurrent states, DeepSeek-V4's rings;
    the cache allocates them per page, so a budget without them is overrun)."""
    # imports torch, which this module otherwise does not
    from mlaserve.config.layer_kinds import declare_layers, prefix_caching_blocker, snapshot_states

    gib = opts.kv_cache_memory
    if opts.num_pages is not None:
        raise ConfigError("kv_cache_memory and num_pages both size the cache pool: give one")
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ConfigError(f"kv_cache_memory must be a number of GiB > 0, got {gib!r}")
    kinds = quantize_states(declare_layers(model, sparse), check_kv_cache_dtype(opts.kv_cache_dtype), model)
    size = dtype.itemsize
    per_token = sum(s.bytes_per_row(size) // s.tokens_per_row for k in kinds for s in k.paged)
    if per_token == 0:
        raise ConfigError(f"kv_cache_memory sizes paged cache rows; {model.model_type} keeps none (use num_pages)")
    snapshots = opts.enable_prefix_caching and prefix_caching_blocker(kinds) is None
    per_snapshot = sum(s.values_per_request() * s.element_size(dtype) for _, s in snapshot_states(kinds))
    per_page = per_token * page_size + (per_snapshot if snapshots else 0)
    pages = int(gib * 2**30 // per_page)
    snap = f" + {per_snapshot} bytes of page-boundary snapshots" if snapshots and per_snapshot else ""
    if pages < 1:
        raise ConfigError(f"kv_cache_memory={gib} GiB holds no page of {page_size} tokens x {per_token} bytes{snap}")
    log.record("kv_cache_memory", gib, "user option")
    why = f"kv_cache_memory {gib} GiB / ({page_size} tokens x {per_token} bytes per token{snap}, {opts.kv_cache_dtype})"
    return log.record("num_pages", pages, why)

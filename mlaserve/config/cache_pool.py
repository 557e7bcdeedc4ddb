"""The cache pool's size: the page size (the user's, a family's own, else 16) and the number of pages (the user's,
kv_cache_memory GiB over a page's bytes, else 16 sequences x 2048 tokens, bounded where pages keep snapshot rows),
each recorded with its source; a page's bytes in the kv_cache_dtype layout, and the pool's footprint in words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlaserve.config.deepseek_v4_layers import v4_page_size
from mlaserve.config.kv_cache import check_kv_cache_dtype, quantize_states
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.options import EngineOptions
from mlaserve.config.provenance import ProvenanceLog

if TYPE_CHECKING:
    import torch


DEFAULT_PAGE_SIZE = 16


def choose_page_size(model: ModelConfig, page_size: int | None, log: ProvenanceLog) -> int:
    """The page size: the user's (recorded as given, and checked against the stack's ratios by the cache), else a
    family's own default (DeepSeek-V4: its compressed pools need a multiple of every compress ratio;
    config/deepseek_v4_layers.py v4_page_size), else the engine's 16. A given value is never replaced."""
    if page_size is not None:
        return page_size
    if model.family is not None and model.family.layer_kinds == "deepseek_v4":
        chosen, why = v4_page_size(model)
        return log.record("page_size", chosen, why)
    return log.record("page_size", DEFAULT_PAGE_SIZE, f"engine default ({DEFAULT_PAGE_SIZE})")


# The default pool of a stack that keeps page-boundary snapshots (prefix caching on a hybrid model) is bounded by
# this many GiB of cache, rows and snapshots counted: vLLM's CPU backend sizes its KV cache from a budget,
# VLLM_CPU_KVCACHE_SPACE, 4 GiB when unset. A rows-only stack keeps the 16 x 2048-token default (its rows are small).
DEFAULT_SNAPSHOT_POOL_GIB = 4


def choose_num_pages(
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
    tokens = min(max_len, 2048)
    per_seq = -(-tokens // page_size)
    n = max(per_seq * min(opts.max_num_seqs, 16), 64)
    rows, snapshot = page_bytes(opts, page_size, model, sparse, dtype)
    if not snapshot:
        return log.record("num_pages", n, f"engine default (16 sequences x {tokens} tokens)")
    # Each page also keeps a snapshot row of every snapshotted request state (a recurrent state per KDA layer,
    # DeepSeek-V4's rings), hundreds of times its rows: the pool is bounded by a budget, but holds at least one
    # sequence of `tokens`.
    fit = DEFAULT_SNAPSHOT_POOL_GIB * 2**30 // (rows + snapshot)
    pages = min(n, max(fit, per_seq))
    why = (
        f"engine default: 16 sequences x {tokens} tokens, bounded by {DEFAULT_SNAPSHOT_POOL_GIB} GiB of cache (vLLM's "
        f"CPU KV cache default; at least one {tokens}-token sequence): {pages_footprint(pages, rows, snapshot)}"
    )
    return log.record("num_pages", pages, why)


def pages_footprint(pages: int, rows: int, snapshot: int) -> str:
    """The pool's bytes in words: pages x (rows + snapshot rows of a page) = total."""
    total = pages * (rows + snapshot)
    return f"{pages} pages x ({rows} bytes of rows + {snapshot} bytes of page-boundary snapshots) = {total / 2**30:.3g} GiB"


def page_bytes(
    opts: EngineOptions, page_size: int, model: ModelConfig, sparse: bool, dtype: torch.dtype
) -> tuple[int, int]:
    """(bytes of one page's rows, bytes of its snapshot rows): page_size / tokens_per_row rows of each paged state
    in the kv_cache_dtype layout, and one snapshot row per page of every snapshotted request state where the
    cache keeps them (prefix caching on and every request state restorable at a page boundary; else 0)."""
    # imports torch, which this module otherwise does not
    from mlaserve.config.layer_kinds import declare_layers, prefix_caching_blocker, snapshot_states

    kinds = quantize_states(declare_layers(model, sparse), check_kv_cache_dtype(opts.kv_cache_dtype), model)
    size = dtype.itemsize
    # a whole number of rows per page (check_page_size), so an 8-bit row whose bytes do not divide by its
    # tokens is counted exactly
    rows = sum(s.bytes_per_row(size) * (page_size // s.tokens_per_row) for k in kinds for s in k.paged)
    snapshots = opts.enable_prefix_caching and prefix_caching_blocker(kinds) is None
    snapshot = sum(s.request_bytes(size) for _, s in snapshot_states(kinds)) if snapshots else 0
    return rows, snapshot


def _pages_in_memory(
    opts: EngineOptions, page_size: int, log: ProvenanceLog, model: ModelConfig, sparse: bool, dtype: torch.dtype
) -> int:
    """kv_cache_memory GiB / the bytes a page takes: page_size x the bytes a token's paged rows take in the
    kv_cache_dtype layout, plus the page's snapshot rows of the request states that keep them (with prefix
    caching on, one row per page of each snapshotted state: Kimi-Linear's recurrent states, DeepSeek-V4's rings;
    the cache allocates them per page, so a budget without them is overrun)."""
    gib = opts.kv_cache_memory
    if opts.num_pages is not None:
        raise ConfigError("kv_cache_memory and num_pages both size the cache pool: give one")
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ConfigError(f"kv_cache_memory must be a number of GiB > 0, got {gib!r}")
    rows_per_page, per_snapshot = page_bytes(opts, page_size, model, sparse, dtype)
    per_token = rows_per_page / page_size
    if per_token == 0:
        raise ConfigError(f"kv_cache_memory sizes paged cache rows; {model.model_type} keeps none (use num_pages)")
    pages = int(gib * 2**30 // (rows_per_page + per_snapshot))
    snap = f" + {per_snapshot} bytes of page-boundary snapshots" if per_snapshot else ""
    if pages < 1:
        raise ConfigError(f"kv_cache_memory={gib} GiB holds no page of {page_size} tokens x {per_token:g} bytes{snap}")
    log.record("kv_cache_memory", gib, "user option")
    why = (
        f"kv_cache_memory {gib} GiB / ({page_size} tokens x {per_token:g} bytes per token{snap}, {opts.kv_cache_dtype})"
    )
    return log.record("num_pages", pages, why)

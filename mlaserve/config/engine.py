"""Engine switches resolved against the model: dense or sparse attention, MLA path, dtype,
page size, budgets -- each with its value's source, so nothing flips by accident.

attention="auto" is sparse exactly when the architecture has an indexer (a DSA model type
whose checkpoint carries indexer weights), never because a config happens to have
`index_topk` (transformers' DSA config classes always define it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from mlaserve.attention.router import MLA_PATHS
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import ProvenanceLog, Setting
from mlaserve.models.moe import EXPERT_IMPLS

ATTENTION_MODES = ("auto", "dense", "sparse")
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class EngineOptions:
    """What the user asked for (None = let the engine decide)."""

    dtype: str | None = None
    attention: str = "auto"
    mla_path: str = "auto"
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    num_pages: int | None = None
    decode_threshold: int = 1
    index_topk: int | None = None
    enable_prefix_caching: bool = True
    experts_impl: str = "grouped_mm"
    malloc_tuning: bool = True  # keep freed large blocks in the process (see allocator.py)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    dtype: torch.dtype
    sparse: bool
    index_topk: int | None
    mla_path: str
    page_size: int
    num_pages: int
    max_num_batched_tokens: int
    max_num_seqs: int
    decode_threshold: int
    enable_prefix_caching: bool
    experts_impl: str
    malloc_tuning: bool
    provenance: tuple[Setting, ...] = field(default=(), compare=False, repr=False)

    def all_provenance(self) -> tuple[Setting, ...]:
        """Engine switches first; a model field the engine re-decided (index_topk) shows its final value."""
        mine = {s.name for s in self.provenance}
        return self.provenance + tuple(s for s in self.model.provenance if s.name not in mine)


def resolve(
    model: ModelConfig, opts: EngineOptions, has_indexer_weights: bool, max_model_len: int | None = None
) -> EngineConfig:
    log = ProvenanceLog()
    dtype = _dtype(opts.dtype, log)
    sparse = _attention(model, opts.attention, has_indexer_weights, log)
    topk = _index_topk(model, opts.index_topk, sparse, log)
    if opts.mla_path not in MLA_PATHS:
        raise ConfigError(f"mla_path must be one of {MLA_PATHS}, got {opts.mla_path!r}")
    _user(log, "mla_path", opts.mla_path, "auto")
    _user(log, "decode_threshold", opts.decode_threshold, 1)
    _user(log, "page_size", opts.page_size, 16)
    _user(log, "max_num_batched_tokens", opts.max_num_batched_tokens, 2048)
    _user(log, "max_num_seqs", opts.max_num_seqs, 64)
    if opts.page_size < 1 or opts.max_num_batched_tokens < 1 or opts.decode_threshold < 1:
        raise ConfigError("page_size, max_num_batched_tokens and decode_threshold must be >= 1")
    if opts.experts_impl not in EXPERT_IMPLS:
        raise ConfigError(f"experts_impl must be one of {EXPERT_IMPLS}, got {opts.experts_impl!r}")
    _user(log, "experts_impl", opts.experts_impl, "grouped_mm")
    log.record(
        "malloc_tuning",
        opts.malloc_tuning,
        "user option"
        if not opts.malloc_tuning
        else "engine default (glibc keeps freed large blocks: no page faults on every step's big tensors)",
    )
    num_pages = _num_pages(opts, max_model_len or model.max_position_embeddings, log)
    return EngineConfig(
        model=model,
        dtype=dtype,
        sparse=sparse,
        index_topk=topk,
        mla_path=opts.mla_path,
        page_size=opts.page_size,
        num_pages=num_pages,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_num_seqs=opts.max_num_seqs,
        decode_threshold=opts.decode_threshold,
        enable_prefix_caching=opts.enable_prefix_caching,
        experts_impl=opts.experts_impl,
        malloc_tuning=opts.malloc_tuning,
        provenance=log.freeze(),
    )


def _user(log: ProvenanceLog, name: str, value, default) -> None:
    log.record(name, value, "user option" if value != default else "engine default")


def _dtype(requested: str | None, log: ProvenanceLog) -> torch.dtype:
    if requested in (None, "auto"):
        # fp32 is exact against the reference. Speed depends on the CPU (measured on 2-core EPYCs):
        # bf16 is ~4x slower than fp32 without AVX512-BF16/AMX and ~2x faster with it.
        return log.record(
            "dtype",
            torch.float32,
            "engine default (float32: exact against the reference; "
            "bfloat16 is ~2x faster on CPUs with AVX512-BF16/AMX)",
        )
    if requested not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {requested!r}")
    return log.record("dtype", DTYPES[requested], "user option")


def _attention(model: ModelConfig, mode: str, has_indexer_weights: bool, log: ProvenanceLog) -> bool:
    if mode not in ATTENTION_MODES:
        raise ConfigError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    dsa = model.is_dsa_architecture
    if has_indexer_weights and not dsa:
        raise ConfigError(f"checkpoint has indexer weights but model_type {model.model_type} is not a DSA architecture")
    if dsa and not has_indexer_weights:
        raise ConfigError(
            f"model_type {model.model_type} is a DSA architecture but the checkpoint has no indexer weights"
        )
    if mode == "sparse" and not dsa:
        raise ConfigError(
            f"attention='sparse' needs a DSA model (deepseek_v32, glm_moe_dsa); {model.model_type} has no indexer"
        )
    if mode == "dense" and dsa:
        warnings.warn(
            f"attention='dense' on {model.model_type}: the indexer is skipped; results equal the sparse "
            f"model only while every context is <= index_topk ({model.indexer.topk}) tokens",
            stacklevel=3,
        )
        return log.record(
            "is_sparse", False, "user option attention='dense' (DSA model run dense; exact only up to index_topk)"
        )
    if mode == "sparse":
        return log.record("is_sparse", True, "user option attention='sparse'")
    reason = (
        f"attention='auto': {model.model_type} is a DSA architecture with indexer weights"
        if dsa
        else f"attention='auto': {model.model_type} has no indexer"
    )
    return log.record("is_sparse", dsa, reason)


def _index_topk(model: ModelConfig, override: int | None, sparse: bool, log: ProvenanceLog) -> int | None:
    if model.indexer is None:
        if override is not None:
            raise ConfigError("index_topk was given but the model has no indexer")
        return None
    if override is not None:
        if override < 1:
            raise ConfigError(f"index_topk must be >= 1, got {override}")
        return log.record("index_topk", override, "user option")
    src = next((s.source for s in model.provenance if s.name == "index_topk"), "model config")
    log.record("index_topk", model.indexer.topk, src + ("" if sparse else " (unused: dense attention)"))
    return model.indexer.topk


def _num_pages(opts: EngineOptions, max_len: int, log: ProvenanceLog) -> int:
    if opts.num_pages is not None:
        return log.record("num_pages", opts.num_pages, "user option")
    # Enough for max_num_seqs sequences of up to 2048 tokens, capped: the cache is small (latent rows).
    per_seq = -(-min(max_len, 2048) // opts.page_size)
    n = max(per_seq * min(opts.max_num_seqs, 16), 64)
    return log.record("num_pages", n, f"engine default (16 sequences x {min(max_len, 2048)} tokens)")

"""Engine switches resolved against the model: dense or sparse attention, MLA path, dtype,
page size, budgets -- each with its value's source, so nothing flips by accident. resolve() reads the
user's EngineOptions (config/options.py) and returns the frozen EngineConfig (config/engine_parts.py); the
package imports all of these names from here.

attention="auto" is sparse exactly when the architecture has an indexer (a DSA model type
whose checkpoint carries indexer weights), never because a config happens to have
`index_topk` (transformers' DSA config classes always define it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from mlaserve.config import families
from mlaserve.config.cache_pool import choose_num_pages, choose_page_size
from mlaserve.config.engine_parts import (
    AttentionConfig,
    CacheConfig,
    ChatConfig,
    EngineConfig,
    KernelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from mlaserve.config.index_scores import choose_index_scores
from mlaserve.config.kv_cache import check_kv_cache_dtype
from mlaserve.config.machine import (
    check_choice,
    choose_activations,
    choose_attention_backend,
    choose_cuda_graphs,
    choose_device,
    choose_dtype,
    choose_gguf_weights,
    choose_kernels,
    choose_prefill_matmul,
    choose_quantization,
    choose_threads,
)
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.options import (
    ATTENTION_MODES,
    EXPERT_IMPLS,
    MAX_SPECULATIVE_TOKENS,
    MLA_PATHS,
    REASONING_PARSERS,
    SPECULATIVE,
    TOOL_CALL_PARSERS,
    EngineOptions,
    make_options,
    option_default,
)
from mlaserve.config.provenance import ProvenanceLog
from mlaserve.config.v4_numerics import resolve_v4_numerics

# The options (config/options.py) and the resolved parts (config/engine_parts.py) are imported from here by the
# rest of the package: this module is the engine configuration's one entry.
__all__ = [
    "ATTENTION_MODES",
    "EXPERT_IMPLS",
    "MAX_SPECULATIVE_TOKENS",
    "MLA_PATHS",
    "REASONING_PARSERS",
    "SPECULATIVE",
    "TOOL_CALL_PARSERS",
    "AttentionConfig",
    "CacheConfig",
    "ChatConfig",
    "ConfigError",
    "EngineConfig",
    "EngineOptions",
    "KernelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "make_options",
    "option_default",
    "resolve",
]


def resolve(
    model: ModelConfig,
    opts: EngineOptions,
    has_indexer_weights: bool,
    max_model_len: int | None = None,
    native_kernels: Callable[[], tuple[bool, str]] | None = None,
    gguf: bool = False,
    stored_bf16: Callable[[], bool] | None = None,
    torch_holders: str | None = None,
    triton: Callable | None = None,
    indexer_bits: Callable[[], tuple[int, str] | None] | None = None,
) -> EngineConfig:
    """native_kernels: the loader's probe of the native kernels (builds them; -> (available, detail)),
    passed only when the checkpoint holds quantized weights that native kernels serve. torch_holders: why
    quantized weights without native kernels run in torch (the kernels line's reason; None: none held). gguf: the checkpoint is a GGUF file
    (gguf_weights applies). stored_bf16: whether the checkpoint's matrices are stored in bfloat16 (asked
    only when dtype=auto could pick bfloat16). triton: how Triton kernels run on a device
    (platform/triton_runtime.py triton_mode: kernels='triton' and attention_backend='triton'). indexer_bits: the
    widest stored bits of a GGUF's DSA indexer projections and their type (loading/probes.py; asked only when
    index_scores=auto could pick bf16)."""
    log = ProvenanceLog()
    device = choose_device(opts.device, log)
    quantization = choose_quantization(opts.quantization, log)
    kernels = choose_kernels(opts.kernels, device, native_kernels, log, torch_holders, triton)
    activations = choose_activations(opts.activations, kernels, gguf, log)
    prefill_matmul = choose_prefill_matmul(opts.prefill_matmul, kernels, gguf, log, activations)
    ranks = opts.tensor_parallel_size * opts.expert_parallel_size
    dtype = choose_dtype(opts.dtype, device, native_kernels is not None, ranks, stored_bf16, log)
    sparse = _attention(model, opts.attention, has_indexer_weights, log)
    topk = _index_topk(model, opts.index_topk, sparse, log)
    _check_plain_options(opts, log)
    speculative, num_spec = _speculative(opts, log)
    decode_threshold = _decode_threshold(opts.decode_threshold, num_spec, log)
    page_size = choose_page_size(model, opts.page_size, log)
    backend = choose_attention_backend(opts.attention_backend, kernels, dtype, log, device, opts.kv_cache_dtype, triton)
    index_scores = choose_index_scores(opts.index_scores, model, sparse, kernels, backend, log, indexer_bits)
    world = opts.tensor_parallel_size * opts.expert_parallel_size
    gguf_weights = choose_gguf_weights(opts.gguf_weights, gguf, world, log)
    gguf_mmap = _gguf_mmap(opts.gguf_mmap, gguf_weights, log)
    gguf_prefetch = _gguf_prefetch(opts.gguf_prefetch, gguf_mmap, log)
    threads, why = choose_threads(model, opts.threads, world)
    log.record("threads", threads, why)
    if world > 1 and device != "cpu":
        raise ConfigError(
            f"tensor_parallel_size={opts.tensor_parallel_size} / expert_parallel_size={opts.expert_parallel_size}"
            f" run on CPU (gloo) only; device={device!r}: the GPU path's collectives (NCCL) are not implemented, "
            "and no machine with 2+ GPUs was available to test one (pass device='cpu')"
        )
    graphs, graph_max_batch = choose_cuda_graphs(opts.cuda_graphs, device, opts.cuda_graph_max_batch, log)
    log.record(
        "malloc_tuning",
        opts.malloc_tuning,
        "on: glibc keeps freed large blocks (turned on by the mlaserve CLI and server, or LLM(malloc_tuning=True))"
        if opts.malloc_tuning
        else "off: library default (a process-wide policy is the host's choice; LLM(malloc_tuning=True) turns it on)",
    )
    num_pages = choose_num_pages(
        opts, page_size, max_model_len or model.max_position_embeddings, log, model, sparse, dtype
    )
    _user(log, "kv_cache_dtype", check_kv_cache_dtype(opts.kv_cache_dtype))
    v4_numerics = resolve_v4_numerics(model, opts.v4_kv_rounding, opts.v4_indexer, opts.kv_cache_dtype, log)
    _check_prefix_cache_dir(opts, log)
    return EngineConfig(
        model=model,
        runtime=RuntimeConfig(
            device=device,
            dtype=dtype,
            threads=threads,
            malloc_tuning=opts.malloc_tuning,
            cuda_graphs=graphs,
            cuda_graph_max_batch=graph_max_batch,
        ),
        cache=CacheConfig(
            page_size=page_size,
            num_pages=num_pages,
            enable_prefix_caching=opts.enable_prefix_caching,
            kv_prefault=opts.kv_prefault,
            kv_cache_dtype=opts.kv_cache_dtype,
            prefix_cache_dir=opts.prefix_cache_dir,
            prefix_cache_dir_gib=float(opts.prefix_cache_dir_gib),
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=_token_budget(opts.max_num_batched_tokens, device, log),
            max_num_seqs=opts.max_num_seqs,
            decode_threshold=decode_threshold,
        ),
        attention=AttentionConfig(
            sparse=sparse,
            index_topk=topk,
            mla_path=opts.mla_path,
            backend=backend,
            index_scores=index_scores,
            v4_kv_rounding=v4_numerics.kv_rounding,
            v4_indexer=v4_numerics.indexer,
        ),
        kernels=KernelConfig(
            impl=kernels,
            activations=activations,
            prefill_matmul=prefill_matmul,
            quantization=quantization,
            experts_impl=opts.experts_impl,
            gguf_weights=gguf_weights,
            gguf_mmap=gguf_mmap,
            gguf_prefetch=gguf_prefetch,
        ),
        speculative=SpeculativeConfig(
            method=speculative,
            num_tokens=num_spec,
            max_seqs=_speculative_max_seqs(opts.speculative_max_seqs, speculative, log),
            **_speculation_switch(opts, speculative, log),
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=opts.tensor_parallel_size, expert_parallel_size=opts.expert_parallel_size
        ),
        server=ServerConfig(ui=opts.ui),
        provenance=log.freeze(),
    )


def _check_plain_options(opts: EngineOptions, log: ProvenanceLog) -> None:
    """The options taken as given (named choices, counts, switches): checked, and recorded as the user's."""
    for name, allowed in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        check_choice(name, getattr(opts, name), allowed)  # decided with the chat template, by the loader
    for name, allowed in (("mla_path", MLA_PATHS), ("experts_impl", EXPERT_IMPLS)):
        check_choice(name, getattr(opts, name), allowed)
        _user(log, name, getattr(opts, name))
    for name in ("page_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "expert_parallel_size"):
        value = getattr(opts, name)
        if name in ("page_size", "max_num_batched_tokens") and value is None:
            continue  # chosen per family (choose_page_size) or per device (_token_budget)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        _user(log, name, value)
    for name in ("check_tensors", "kv_prefault", "ui"):
        value = getattr(opts, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be a bool, got {value!r}")
        _user(log, name, value)


# The step's token budget where none is given. On the CPU every step-sized temporary (the linears' outputs, the MoE
# activations, the attention's queries and outputs) is resident memory, and glibc keeps the heap at its peak: a
# 1024-token step holds about half of a 2048-token one's, and 16 prompts of 128 tokens prefill as fast in two steps
# as in one. Measured on a 2-core Xeon with AMX, 2 threads, Q4_K_M files, alternating (benchmarks/README.md, runs of
# 2026-12-07, morning): peak RSS 0.06-0.33 GiB lower; 16 concurrent requests level; a 4096-token prompt 0-17% faster
# (the standard model, glm-real) or 4-12% slower (ds-real: each chunk expands its prefix's K / V again), 8000 tokens
# 3-6% slower. A GPU keeps 2048 (its memory is the cache pool's budget, and larger steps fill it better).
CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET = 1024, 2048


def _token_budget(given: int | None, device: str, log: ProvenanceLog) -> int:
    if given is not None:
        return given  # recorded with the plain options
    if device == "cpu":
        return log.record("max_num_batched_tokens", CPU_TOKEN_BUDGET, f"engine default on the CPU ({CPU_TOKEN_BUDGET})")
    return log.record("max_num_batched_tokens", GPU_TOKEN_BUDGET, f"engine default on {device} ({GPU_TOKEN_BUDGET})")


def _check_prefix_cache_dir(opts: EngineOptions, log: ProvenanceLog) -> None:
    d, gib = opts.prefix_cache_dir, opts.prefix_cache_dir_gib
    if d is not None and (not isinstance(d, str) or not d):
        raise ConfigError(f"prefix_cache_dir must be a directory path, got {d!r}")
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ConfigError(f"prefix_cache_dir_gib must be a positive number of GiB, got {gib!r}")
    if d is not None and opts.tensor_parallel_size != 1:
        # each rank holds a slice of every row: a page file would need every rank's slice
        raise ConfigError(f"prefix_cache_dir runs with tensor_parallel_size 1, got {opts.tensor_parallel_size}")
    if d is not None and not opts.enable_prefix_caching:
        raise ConfigError("prefix_cache_dir needs enable_prefix_caching (the disk keeps the prefix cache's pages)")
    _user(log, "prefix_cache_dir", d)
    _user(log, "prefix_cache_dir_gib", gib)


def _user(log: ProvenanceLog, name: str, value) -> None:
    default = option_default(name)
    log.record(name, value, "user option" if value != default else f"engine default ({default!r})")


def _speculative(opts: EngineOptions, log: ProvenanceLog) -> tuple[str | None, int]:
    check_choice("speculative", opts.speculative, SPECULATIVE)
    k = opts.num_speculative_tokens
    if opts.speculative is None:
        log.record("speculative", None, "engine default (None: one token per step)")
        return None, 0
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    log.record("speculative", opts.speculative, "user option")
    _user(log, "num_speculative_tokens", k)
    return opts.speculative, k


def _speculative_max_seqs(value: int | None, speculative: str | None, log: ProvenanceLog) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"speculative_max_seqs must be an integer >= 1 or None, got {value!r}")
    if speculative is None:
        raise ConfigError("speculative_max_seqs was given but speculative is None")
    return log.record("speculative_max_seqs", value, "user option")


def _speculation_switch(opts: EngineOptions, speculative: str | None, log: ProvenanceLog) -> dict:
    """The acceptance switch's three knobs (checked; recorded only when speculating)."""
    names = ("speculative_min_acceptance", "speculative_probe_interval", "speculative_acceptance_weight")
    given = [n for n in names if getattr(opts, n) != option_default(n)]
    if speculative is None:
        if given:
            raise ConfigError(f"{', '.join(given)} given but speculative is None")
        return {}
    t, n, w = (getattr(opts, name) for name in names)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
        raise ConfigError(f"speculative_min_acceptance must be a number in [0, 1] (0: never pause), got {t!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"speculative_probe_interval must be an integer >= 1, got {n!r}")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1:
        raise ConfigError(f"speculative_acceptance_weight must be a number in (0, 1], got {w!r}")
    for name in names:
        _user(log, name, getattr(opts, name))
    return {"min_acceptance": float(t), "probe_interval": n, "acceptance_weight": float(w)}


def _decode_threshold(requested: int | None, num_spec: int, log: ProvenanceLog) -> int:
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"decode_threshold must be an integer >= 1, got {requested!r}")
        if requested < 1 + num_spec:
            warnings.warn(
                f"decode_threshold={requested} < 1 + num_speculative_tokens: verification tokens take the "
                "decompressed (prefill) path",
                stacklevel=3,
            )
        return log.record("decode_threshold", requested, "user option")
    if num_spec:
        # A verify chunk is [last token, d_1..d_k] per request: k + 1 queries that are decodes in every
        # other sense (short, deep context), so they take the absorbed MQA path, as vLLM does.
        return log.record("decode_threshold", 1 + num_spec, "1 + num_speculative_tokens, because MTP verification")
    return log.record("decode_threshold", 1, "engine default (1: a one-token query is a decode)")


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
        dsa_types = ", ".join(f.name for f in families.FAMILIES if f.is_dsa)
        raise ConfigError(f"attention='sparse' needs a DSA model ({dsa_types}); {model.model_type} has no indexer")
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
    if dsa and model.indexer.kpool:  # GLM-5.3-Flash: the pooled route (models/pooled_indexer.py)
        reason += f" (pooled indexer: top index_topk // {model.indexer.kpool} pools + the incomplete tail)"
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


def _gguf_mmap(requested: bool, gguf_weights: str | None, log) -> bool:
    """On only where there are kept blocks to map (a GGUF with gguf_weights 'quantized')."""
    unused = None
    if gguf_weights != "quantized":
        unused = "not a GGUF" if gguf_weights is None else "gguf_weights='dequantized': the blocks are expanded at load"
    return _file_switch(
        log,
        "gguf_mmap",
        requested,
        unused,
        on="kept blocks are views of the file mapped read-only (shared pages, no copy at load)",
        off="kept blocks copied into the process at load",
    )


def _gguf_prefetch(requested: bool, gguf_mmap: bool, log) -> bool:
    """On only where the kept blocks are the mapped file's pages (gguf_mmap); whether the files fit in the available
    memory is the load's reading (loading/prefetch.py), said in the load report."""
    return _file_switch(
        log,
        "gguf_prefetch",
        requested,
        None if gguf_mmap else "the blocks are not a mapped GGUF's",
        on="the mapped files are read into the page cache in the background after load",
        off="pages are read from disk as steps first touch them",
    )


def _file_switch(log, name: str, requested: bool, unused: str | None, on: str, off: str) -> bool:
    """A bool option about how a GGUF's file is held, recorded with its source: off where it does not apply
    (`unused` says why), else as asked (`on` / `off`: what each means, said where it is the engine's default)."""
    if not isinstance(requested, bool):
        raise ConfigError(f"{name} must be a bool, got {requested!r}")
    if unused is not None:
        return log.record(name, False, f"unused ({requested!r}): {unused}")
    if requested != option_default(name):
        return log.record(name, requested, f"user option: {off}" if not requested else "user option")
    return log.record(name, requested, f"engine default: {on if requested else off}")

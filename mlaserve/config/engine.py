"""Engine switches resolved against the model: dense or sparse attention, MLA path, dtype,
page size, budgets -- each with its value's source, so nothing flips by accident.

attention="auto" is sparse exactly when the architecture has an indexer (a DSA model type
whose checkpoint carries indexer weights), never because a config happens to have
`index_topk` (transformers' DSA config classes always define it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlaserve.config import families
from mlaserve.config.deepseek_v4 import v4_page_size
from mlaserve.config.kv_cache import KV_CACHE_DTYPES, check_kv_cache_dtype, quantize_states
from mlaserve.config.machine import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    DEVICES,
    GGUF_WEIGHTS,
    KERNELS,
    QUANTIZATIONS,
    check_choice,
    choose_activations,
    choose_attention_backend,
    choose_device,
    choose_dtype,
    choose_gguf_weights,
    choose_kernels,
    choose_quantization,
    choose_threads,
)
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import ProvenanceLog, Setting
from mlaserve.config.v4_numerics import V4_INDEXERS, V4_KV_ROUNDINGS, V4Numerics, resolve_v4_numerics

if TYPE_CHECKING:
    import torch

# The vocabulary of the switches (those about the machine -- devices, kernels, dtypes, attention backends --
# are in config/machine.py with their resolvers). Implementation modules import these names from config
# (config imports no implementation module); the attention backend registry checks it serves each name.
ATTENTION_MODES = ("auto", "dense", "sparse")
MLA_PATHS = ("auto", "absorbed", "decompressed")
EXPERT_IMPLS = ("grouped_mm", "loop")
SPECULATIVE = (None, "mtp")
MAX_SPECULATIVE_TOKENS = 3
# The chat output's formats (mlaserve/tools/: one file per tool-call format; a test holds the two lists equal).
TOOL_CALL_PARSERS = (None, "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "glm45", "kimi_k2")
REASONING_PARSERS = (None, "think", "none")


def _opt(default, help: str, choices: tuple | None = None, cli: bool = True):
    """An engine option: its default and help live here, and only here. The CLI's flags
    (entrypoints/cli.py), LLM's keywords and the provenance labels all read them."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class EngineOptions:
    """What the user asked for. "auto" / None = let the engine decide (and record why)."""

    dtype: str = _opt(
        "auto",
        "compute and cache dtype (auto: float32, exact against the reference; bfloat16 for a checkpoint stored "
        "in bf16 on a CPU with AVX512-BF16/AMX, one process)",
        ("auto", "float32", "bfloat16", "float16"),
    )
    attention: str = _opt(
        "auto", "sparse (DSA indexer + top-k) or dense; auto = sparse iff the model has an indexer", ATTENTION_MODES
    )
    mla_path: str = _opt(
        "auto", "auto: decode -> absorbed MQA, prefill -> decompressed MHA; or one path for all", MLA_PATHS
    )
    page_size: int | None = _opt(
        None,
        "tokens per page of the cache (None: 16, or the family's own: DeepSeek-V4 256 rounded up to a multiple of "
        "every compress ratio)",
    )
    max_num_batched_tokens: int = _opt(2048, "token budget per step (long prompts are prefilled in chunks of it)")
    max_num_seqs: int = _opt(64, "running requests at most")
    num_pages: int | None = _opt(None, "pages in the cache pool (default: 16 sequences of up to 2048 tokens)")
    kv_cache_memory: float | None = _opt(
        None,
        "GiB for the paged cache pool instead of num_pages: as many pages as fit at the bytes a token takes in the "
        "kv_cache_dtype layout (every layer's latent row and index key), so an 8-bit cache holds ~2.9x the tokens "
        "of float32 in the same memory (r 512, dr 64)",
    )
    decode_threshold: int | None = _opt(
        None,
        "a request whose query length is <= this is a decode (absorbed path); default 1, or "
        "1 + num_speculative_tokens with speculative decoding (verification runs as decodes)",
    )
    index_topk: int | None = _opt(None, "override the DSA top-k of the model")
    enable_prefix_caching: bool = _opt(True, "reuse cached pages of a shared prompt prefix")
    prefix_cache_dir: str | None = _opt(
        None,
        "directory where full prefix-cache pages are also kept on disk (written in the background, keyed by the "
        "hash chain and the model's identity), so a restarted engine loads a repeated prefix instead of "
        "recomputing it; shareable by several engines",
    )
    prefix_cache_dir_gib: float = _opt(8.0, "size cap of prefix_cache_dir in GiB (least recently used files go)")
    experts_impl: str = _opt(
        "grouped_mm", "routed experts: one grouped GEMM per step, or the per-expert loop", EXPERT_IMPLS
    )
    attention_backend: str = _opt(
        "auto",
        "attention kernels (auto: native with the native kernels and float32, else torch; reference: the plain oracle)",
        ATTENTION_BACKENDS,
    )
    device: str = _opt("auto", "where weights, cache and step tensors live (auto: cuda when torch sees one)", DEVICES)
    kernels: str = _opt(
        "auto",
        "for checkpoints with quantized weights (GGUF blocks, FP8, quantization=): native = C kernels built at first "
        "use with the system compiler (decode-and-dot matmuls, the MoE router and routed experts of a decode step, "
        "RMSNorm, each layer's rope and cache write); torch = dequantize, then GEMM, and torch ops (the reference); "
        "auto = native on CPU if it builds",
        KERNELS,
    )
    activations: str = _opt(
        "auto",
        "how the native kernels take activations on their small-batch path (<= 16 rows per weight: decode): "
        "float = exact products over the stored weights; int8 = quantized to int8 as llama.cpp does (32-value "
        "blocks for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL, 256-value q8_K blocks for Q4_K / Q5_K / Q6_K / "
        "IQ4_XS and the grid i-quants IQ1_S ... IQ3_S) with integer dot products "
        "(faster, not exact); int8_6bit = the same for weights of 6 bits or fewer only, Q8_0 exact; auto = "
        "int8_6bit for GGUF files with the native kernels (llama.cpp's choice), else float",
        ACTIVATIONS,
    )
    quantization: str | None = _opt(
        None,
        "quantize a float checkpoint's weights at load: int8 = Q8_0 blocks (32 values, one fp16 scale), "
        "int4 = Q4_0 blocks (embedding and lm_head stay int8); the GGUF kernels then run them",
        QUANTIZATIONS,
    )
    threads: int | None = _opt(
        None, "CPU threads for torch ops (default: 1 for models under 50M parameters, else every core)"
    )
    gguf_weights: str = _opt(
        "auto",
        "a GGUF file's block-quantized weights (Q8_0, Q4_K, ...): 'quantized' keeps them in their ggml blocks "
        "(resident memory ~ the file's size; products through `kernels`), 'dequantized' expands them at load; "
        "auto: quantized (each tensor-parallel rank keeps its slice's blocks)",
        GGUF_WEIGHTS,
    )
    gguf_mmap: bool = _opt(
        True,
        "a GGUF's kept blocks are views of the file mapped read-only (no copy at load; the pages are shared with "
        "the page cache and with every process that maps the file); off: copied into the process at load. Only "
        "the fused routed-expert gate/up blocks are copied either way (the kernels read them as one [E, 2I] stack)",
    )
    check_tensors: bool = _opt(
        False,
        "scan every weight for NaN/Inf at load (and each block scale of a GGUF) and refuse the model naming "
        "each bad tensor; costs one pass over the weights",
    )
    tensor_parallel_size: int = _opt(
        1,
        "processes the model is split across on this machine (heads, MLP/expert intermediate dims and "
        "vocabulary split; latent cache and DSA indexer replicated); workers are started by the engine",
    )
    expert_parallel_size: int = _opt(
        1,
        "processes the routed experts are spread across on this machine (each holds a contiguous range of every "
        "MoE layer's experts and reads only those; attention, shared expert, router, norms and embedding "
        "replicated; one all-reduce per MoE layer); with tensor_parallel_size T: T x N processes, each of the "
        "N expert groups split T ways",
    )
    speculative: str | None = _opt(
        None,
        "speculative decoding: 'mtp' drafts with the checkpoint's multi-token-prediction layer and verifies the "
        "drafts in one target forward (greedy output identical; sampling keeps the target distribution)",
        SPECULATIVE,
    )
    num_speculative_tokens: int = _opt(
        1,
        f"draft tokens per step with speculative decoding (1..{MAX_SPECULATIVE_TOKENS}; deeper drafts reuse the layer)",
    )
    speculative_max_seqs: int | None = _opt(
        None,
        "speculate only while at most this many requests sample in a step (a compute-bound batch gains "
        "little from drafts); None: always",
    )
    # The acceptance switch (engine/spec_switch.py). Defaults measured on this project's CPUs: a
    # speculative step with failing drafts costs 1.4x (embedded model) to 2x (standard model) a plain
    # step at batch 1, so drafts must be accepted >= ~45% of the time to pay on the cheaper of the two.
    speculative_min_acceptance: float = _opt(
        0.45,
        "pause drafting for a request whose moving-average acceptance (accepted / proposed drafts) falls "
        "below this; it drafts once every speculative_probe_interval steps to see if it recovered; 0: never pause",
    )
    speculative_probe_interval: int = _opt(
        16,
        "steps a paused request decodes plainly before a probe (one step with drafts, then the switch decides); "
        "doubled after each probe that fails, up to 8x",
    )
    speculative_acceptance_weight: float = _opt(
        0.2,
        "weight of the newest verification in a request's acceptance average (0 < w <= 1; larger reacts "
        "faster and pauses on shorter runs of bad luck)",
    )
    tool_call_parser: str | None = _opt(
        None,
        "tool-call format of the model's chat output (default: from the chat template's markers, else the model "
        "type; recorded with the reason)",
        TOOL_CALL_PARSERS,
    )
    reasoning_parser: str | None = _opt(
        None,
        "reasoning separation of the chat output: think = <think>...</think> to reasoning_content, none = the text "
        "as it is (default: think when the chat template writes </think>; recorded with the reason)",
        REASONING_PARSERS,
    )
    # Process-wide, so a library does not change it behind its host's back: off unless asked; the
    # CLI and the server turn it on (see platform/allocator.py).
    malloc_tuning: bool = _opt(False, "glibc keeps freed large blocks (+~15% prefill; RSS stays near peak)", cli=False)
    kv_cache_dtype: str = _opt(
        "auto",
        "storage of the latent cache rows: auto = the compute dtype; int8 / fp8_e4m3 = c_kv as 8-bit codes with an "
        "fp32 scale per 128 values (k_pe kept in the compute dtype) and, on DSA models, the indexer keys as FP8 e4m3 "
        "with a scale per token: ~2.5-2.9x the tokens of float32 in the same memory (c_kv alone ~3.9x), every "
        "attention call within a bound derived from the scales (mlaserve verify)",
        KV_CACHE_DTYPES,
    )
    v4_kv_rounding: str = _opt(
        "auto",
        "DeepSeek-V4: fp8_ue8m0 = DeepSeek's own inference code's FP8 simulation of every K=V row's non-rope part "
        "(e4m3 in blocks of 64, power-of-two scales; docs/DEEPSEEK_V4.md); none = transformers' rows in the compute "
        "dtype; auto = none, or fp8_ue8m0 with kv_cache_dtype=fp8_e4m3 (which stores those rows)",
        V4_KV_ROUNDINGS,
    )
    v4_indexer: str = _opt(
        "exact",
        "DeepSeek-V4's CSA indexer: hadamard_fp4 = DeepSeek's own inference code (queries and keys rotated by a "
        "Hadamard matrix, then rounded through FP4 e2m1 in blocks of 32); exact = transformers",
        V4_INDEXERS,
    )
    kv_prefault: bool = _opt(
        False,
        "write every KV cache page at start, so the whole pool is resident from the first request (RSS then "
        "measures leaks, not pages first written; costs the pool's memory at once)",
    )
    ui: bool = _opt(
        True,
        "`mlaserve serve` shows a web page at / (chat playground, the live route, configuration and health; "
        "docs/UI.md); --no-ui serves the API alone",
    )


def _gguf_mmap(requested: bool, gguf_weights: str | None, log) -> bool:
    """On only where there are kept blocks to map (a GGUF with gguf_weights 'quantized')."""
    if not isinstance(requested, bool):
        raise ConfigError(f"gguf_mmap must be a bool, got {requested!r}")
    if gguf_weights != "quantized":
        why = "not a GGUF" if gguf_weights is None else "gguf_weights='dequantized': the blocks are expanded at load"
        return log.record("gguf_mmap", False, f"unused ({requested!r}): {why}")
    if requested:
        return log.record(
            "gguf_mmap",
            True,
            "engine default: kept blocks are views of the file mapped read-only (shared pages, no copy at load)"
            if requested == option_default("gguf_mmap")
            else "user option",
        )
    return log.record("gguf_mmap", False, "user option: kept blocks copied into the process at load")


def option_default(name: str):
    return EngineOptions.__dataclass_fields__[name].default


def make_options(**kwargs) -> EngineOptions:
    """EngineOptions from keywords, with an error that lists the valid names."""
    unknown = sorted(set(kwargs) - set(EngineOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(EngineOptions.__dataclass_fields__)}")
    return EngineOptions(**{k: v for k, v in kwargs.items()})


@dataclass(frozen=True)
class RuntimeConfig:
    """Where the math runs and with which process resources: device, compute/cache dtype, torch threads
    (per process: ranks on different machines may differ), glibc malloc policy (process-wide)."""

    device: str
    dtype: torch.dtype
    threads: int
    malloc_tuning: bool


@dataclass(frozen=True)
class CacheConfig:
    """The paged cache pool: its geometry (tokens per page, pages), prefix reuse, prefaulting."""

    page_size: int
    num_pages: int
    enable_prefix_caching: bool
    kv_prefault: bool  # the cache tensors are written once at allocation (cache/model_cache.py)
    kv_cache_dtype: str = "auto"  # "int8" | "fp8_e4m3": 8-bit latent rows and index keys (config/kv_cache.py)
    prefix_cache_dir: str | None = None  # full pages also kept on disk (cache/disk_tier.py)
    prefix_cache_dir_gib: float = 8.0  # its size cap


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold (token budget, running requests) and where a decode ends."""

    max_num_batched_tokens: int
    max_num_seqs: int
    decode_threshold: int  # a query of <= this many tokens is a decode (absorbed path)


@dataclass(frozen=True)
class AttentionConfig:
    """How attention is routed: sparse (DSA) or dense, its top-k, the MLA path, the backend; DeepSeek-V4's
    numerics (the official code's roundings, when asked for)."""

    sparse: bool
    index_topk: int | None
    mla_path: str
    backend: str  # name in attention.backends' registry; the router writes it per segment
    # DeepSeek-V4's official-code roundings (config/v4_numerics.py; the defaults are transformers' numerics)
    v4_kv_rounding: str = "none"  # "fp8_ue8m0": FP8 e4m3 of every K=V row's non-rope part
    v4_indexer: str = "exact"  # "hadamard_fp4": Hadamard rotation + FP4 of the indexer's queries and keys

    @property
    def v4_numerics(self) -> V4Numerics:
        return V4Numerics(self.v4_kv_rounding, self.v4_indexer)


@dataclass(frozen=True)
class KernelConfig:
    """How weights are held and multiplied: the kernel family, activation quantization, load-time
    quantization, the routed experts' implementation, a GGUF's blocks kept or expanded."""

    impl: str  # "native" | "torch": quantized matmuls and decode-step glue (kernels/)
    activations: str  # "float" | "int8_6bit" | "int8": machine.INT8_BITS, the weights whose products take int8
    quantization: str | None  # "int8" | "int4": float weights put into Q8_0 / Q4_0 blocks at load
    experts_impl: str
    gguf_weights: str | None  # a GGUF's block-quantized weights: "quantized" | "dequantized" (None: not GGUF)
    gguf_mmap: bool = False  # kept blocks are views of the read-only mapped file (loading/gguf_mapping.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding and its acceptance switch (engine/spec_switch.py). method None: one token
    per step, num_tokens 0 and the switch off."""

    method: str | None = None  # "mtp": draft with the MTP layer, verify in one target forward
    num_tokens: int = 0  # k drafts per decoding request per step (0 without speculation)
    max_seqs: int | None = None  # no drafts in a step where more requests sample
    min_acceptance: float = 0.0  # 0: the switch never pauses a request
    probe_interval: int = 16  # steps between a paused request's probes
    acceptance_weight: float = 0.2  # newest verification's weight in the acceptance average


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across processes."""

    tensor_parallel_size: int = 1  # ranks holding a slice of the weights (mlaserve/distributed)
    expert_parallel_size: int = 1  # ranks holding a range of the routed experts (distributed/expert_parallel.py)

    @property
    def world_size(self) -> int:
        """Processes of the group: T x E (distributed/mesh.py: rank = e * T + t)."""
        return self.tensor_parallel_size * self.expert_parallel_size


@dataclass(frozen=True)
class ChatConfig:
    """The chat output's formats, decided with the chat template (tools/select.py chat_formats): None until then."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    """What `mlaserve serve` adds around the engine (the engine itself never reads it)."""

    ui: bool = True  # the web page at / (entrypoints/openai/ui/)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved, frozen configuration the engine runs with, as parts of one concept each, so a reader
    names the concern it depends on (`cfg.cache.page_size`) and a part can be passed alone. The grouping
    follows who reads what: the cache manager reads `cache`, the scheduler `scheduler`, the router
    `attention`, the loader `kernels` and `parallel`, the speculative loop `speculative`, the server `chat` and `server`;
    `runtime` holds what every tensor is made with (device, dtype) and the process's resources. Every
    resolved switch lives in exactly one part; the names are EngineOptions' except where the part already
    says it (attention_backend -> attention.backend, kernels -> kernels.impl, speculative ->
    speculative.method, num_speculative_tokens -> speculative.num_tokens, speculative_X -> speculative.X).
    Provenance keeps the option names (what the user typed)."""

    model: ModelConfig
    runtime: RuntimeConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    attention: AttentionConfig
    kernels: KernelConfig
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    chat: ChatConfig = ChatConfig()
    server: ServerConfig = ServerConfig()
    provenance: tuple[Setting, ...] = field(default=(), compare=False, repr=False)

    def all_provenance(self) -> tuple[Setting, ...]:
        """Engine switches first; a model field the engine re-decided (index_topk) shows its final value."""
        mine = {s.name for s in self.provenance}
        return self.provenance + tuple(s for s in self.model.provenance if s.name not in mine)


def resolve(
    model: ModelConfig,
    opts: EngineOptions,
    has_indexer_weights: bool,
    max_model_len: int | None = None,
    native_kernels: Callable[[], tuple[bool, str]] | None = None,
    gguf: bool = False,
    stored_bf16: Callable[[], bool] | None = None,
    torch_holders: str | None = None,
) -> EngineConfig:
    """native_kernels: the loader's probe of the native kernels (builds them; -> (available, detail)),
    passed only when the checkpoint holds quantized weights that native kernels serve. torch_holders: why
    quantized weights without native kernels run in torch (the kernels line's reason; None: none held). gguf: the checkpoint is a GGUF file
    (gguf_weights applies). stored_bf16: whether the checkpoint's matrices are stored in bfloat16 (asked
    only when dtype=auto could pick bfloat16)."""
    log = ProvenanceLog()
    device = choose_device(opts.device, log)
    quantization = choose_quantization(opts.quantization, log)
    kernels = choose_kernels(opts.kernels, device, native_kernels, log, torch_holders)
    activations = choose_activations(opts.activations, kernels, gguf, log)
    ranks = opts.tensor_parallel_size * opts.expert_parallel_size
    dtype = choose_dtype(opts.dtype, device, native_kernels is not None, ranks, stored_bf16, log)
    sparse = _attention(model, opts.attention, has_indexer_weights, log)
    topk = _index_topk(model, opts.index_topk, sparse, log)
    for name, allowed in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        check_choice(name, getattr(opts, name), allowed)  # decided with the chat template, by the loader
    for name, allowed in (("mla_path", MLA_PATHS), ("experts_impl", EXPERT_IMPLS)):
        check_choice(name, getattr(opts, name), allowed)
        _user(log, name, getattr(opts, name))
    speculative, num_spec = _speculative(opts, log)
    decode_threshold = _decode_threshold(opts.decode_threshold, num_spec, log)
    for name in ("page_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "expert_parallel_size"):
        value = getattr(opts, name)
        if name == "page_size" and value is None:
            continue  # chosen below, per family
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        _user(log, name, value)
    page_size = _page_size(model, opts.page_size, log)
    if not isinstance(opts.check_tensors, bool):
        raise ConfigError(f"check_tensors must be a bool, got {opts.check_tensors!r}")
    _user(log, "check_tensors", opts.check_tensors)
    backend = choose_attention_backend(opts.attention_backend, kernels, dtype, log)
    world = opts.tensor_parallel_size * opts.expert_parallel_size
    gguf_weights = choose_gguf_weights(opts.gguf_weights, gguf, world, log)
    gguf_mmap = _gguf_mmap(opts.gguf_mmap, gguf_weights, log)
    threads, why = choose_threads(model, opts.threads, world)
    log.record("threads", threads, why)
    if world > 1 and device != "cpu":
        raise ConfigError(
            f"tensor_parallel_size={opts.tensor_parallel_size} / expert_parallel_size={opts.expert_parallel_size}"
            f" run on CPU (gloo) only; device={device!r} "
            "(pass device='cpu')"
        )
    log.record(
        "malloc_tuning",
        opts.malloc_tuning,
        "on: glibc keeps freed large blocks (turned on by the mlaserve CLI and server, or LLM(malloc_tuning=True))"
        if opts.malloc_tuning
        else "off: library default (a process-wide policy is the host's choice; LLM(malloc_tuning=True) turns it on)",
    )
    num_pages = _num_pages(opts, page_size, max_model_len or model.max_position_embeddings, log, model, sparse, dtype)
    if not isinstance(opts.kv_prefault, bool):
        raise ConfigError(f"kv_prefault must be a bool, got {opts.kv_prefault!r}")
    _user(log, "kv_prefault", opts.kv_prefault)
    if not isinstance(opts.ui, bool):
        raise ConfigError(f"ui must be a bool, got {opts.ui!r}")
    _user(log, "ui", opts.ui)
    _user(log, "kv_cache_dtype", check_kv_cache_dtype(opts.kv_cache_dtype))
    v4_numerics = resolve_v4_numerics(model, opts.v4_kv_rounding, opts.v4_indexer, opts.kv_cache_dtype, log)
    _check_prefix_cache_dir(opts, log)
    return EngineConfig(
        model=model,
        runtime=RuntimeConfig(device=device, dtype=dtype, threads=threads, malloc_tuning=opts.malloc_tuning),
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
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_num_seqs=opts.max_num_seqs,
            decode_threshold=decode_threshold,
        ),
        attention=AttentionConfig(
            sparse=sparse,
            index_topk=topk,
            mla_path=opts.mla_path,
            backend=backend,
            v4_kv_rounding=v4_numerics.kv_rounding,
            v4_indexer=v4_numerics.indexer,
        ),
        kernels=KernelConfig(
            impl=kernels,
            activations=activations,
            quantization=quantization,
            experts_impl=opts.experts_impl,
            gguf_weights=gguf_weights,
            gguf_mmap=gguf_mmap,
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


DEFAULT_PAGE_SIZE = 16


def _page_size(model: ModelConfig, page_size: int | None, log: ProvenanceLog) -> int:
    """The page size: the user's (recorded as given, and checked against the stack's ratios by the cache), else a
    family's own default (DeepSeek-V4: its compressed pools need a multiple of every compress ratio;
    config/deepseek_v4.py v4_page_size), else the engine's 16. A given value is never replaced."""
    if page_size is not None:
        return page_size
    if model.family is not None and model.family.layer_kinds == "deepseek_v4":
        chosen, why = v4_page_size(model)
        return log.record("page_size", chosen, why)
    return log.record("page_size", DEFAULT_PAGE_SIZE, f"engine default ({DEFAULT_PAGE_SIZE})")


def _num_pages(
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

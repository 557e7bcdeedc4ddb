"""EngineConfig: the resolved, frozen configuration the engine runs with (config/engine.py resolve() builds it from
EngineOptions), a composition of frozen parts, one concern each, read as `cfg.<part>.<field>`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlaserve.config.model import ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.config.v4_numerics import V4Numerics

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RuntimeConfig:
    """Where the math runs and with which process resources: device, compute/cache dtype, torch threads
    (per process: ranks on different machines may differ), glibc malloc policy (process-wide)."""

    device: str
    dtype: torch.dtype
    threads: int
    malloc_tuning: bool
    # pure decode steps replay a CUDA graph per batch bucket (executor/cuda_graphs.py); off on the CPU
    cuda_graphs: bool = False
    cuda_graph_max_batch: int = 64  # the largest batch bucket captured (1, 2, 4, ... up to this)


@dataclass(frozen=True)
class CacheConfig:
    """The paged cache pool: its geometry (tokens per page, pages), prefix reuse, prefaulting."""

    page_size: int
    num_pages: int
    enable_prefix_caching: bool
    kv_prefault: bool  # the cache tensors are written once at allocation (cache/model_cache.py)
    kv_cache_dtype: str = "auto"  # "int8" | "fp8_e4m3" | "float16" | "bfloat16": 8/16-bit rows (config/kv_cache.py)
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
    index_scores: str = "fp32"  # "fp32" | "bf16": a DSA indexer's scores (config/index_scores.py)
    # DeepSeek-V4's official-code roundings (config/v4_numerics.py; the defaults are transformers' numerics)
    v4_kv_rounding: str = "none"  # "fp8_ue8m0": FP8 e4m3 of every K=V row's non-rope part
    v4_indexer: str = "exact"  # "hadamard_fp4": Hadamard rotation + FP4 of the indexer's queries and keys

    @property
    def v4_numerics(self) -> V4Numerics:
        return V4Numerics(self.v4_kv_rounding, self.v4_indexer)


@dataclass(frozen=True)
class KernelConfig:
    """How weights are held and multiplied: the kernel family, activation quantization, bf16 prefill GEMMs, load-time
    quantization, the routed experts' implementation, a GGUF's blocks kept or expanded."""

    impl: str  # "native" | "triton" | "torch": quantized matmuls and decode-step glue (kernels/)
    # "float" | "int8_6bit" | "int8_6bit_int16" | "int8": machine.INT8_BITS, the weights whose products take int8
    activations: str
    # "float" | "bf16_6bit" | "bf16" | "int8" | "int8_float": machine.BF16_BITS (the weights whose prefill
    prefill_matmul: str
    # GEMMs are bf16) and machine.PREFILL_TILES (int8 prefill products on the AMX-INT8 tiles up to ggml.tile_rows rows)
    quantization: str | None  # "int8" | "int4": float weights put into Q8_0 / Q4_0 blocks at load
    experts_impl: str
    gguf_weights: str | None  # a GGUF's block-quantized weights: "quantized" | "dequantized" (None: not GGUF)
    gguf_mmap: bool = False  # kept blocks are views of the read-only mapped file (loading/gguf_mapping.py)
    gguf_prefetch: bool = False  # the mapped files read into the page cache after load (loading/prefetch.py)


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

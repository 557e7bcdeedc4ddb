"""The engine's options as the user gives them: EngineOptions, every engine default once with its help text (the
CLI's flags, LLM's keywords and the provenance labels all read it), and the switches' vocabularies.
config/engine.py resolves them against the model into an EngineConfig (config/engine_parts.py).

EngineOptions stays flat (what the user types); "auto" / None = let the engine decide (and record why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaserve.config.index_scores import INDEX_SCORES
from mlaserve.config.kv_cache import KV_CACHE_DTYPES
from mlaserve.config.machine import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    CUDA_GRAPHS,
    DEVICES,
    GGUF_WEIGHTS,
    KERNELS,
    PREFILL_MATMULS,
    QUANTIZATIONS,
)
from mlaserve.config.v4_numerics import V4_INDEXERS, V4_KV_ROUNDINGS

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
    max_num_batched_tokens: int | None = _opt(
        None,
        "token budget per step (long prompts are prefilled in chunks of it; None: 1024 on the CPU, 2048 on a GPU)",
    )
    max_num_seqs: int = _opt(64, "running requests at most")
    num_pages: int | None = _opt(
        None,
        "pages in the cache pool (default: 16 sequences of up to 2048 tokens; where each page also keeps "
        "page-boundary snapshots of request states, i.e. prefix caching on Kimi-Linear, GLM-5.3-Flash or "
        "DeepSeek-V4, at most 4 GiB of rows and snapshots, and at least one 2048-token sequence)",
    )
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
    index_scores: str = _opt(
        "auto",
        "the DSA indexer's scores: fp32 = the reference's; bf16 = queries and keys rounded to bf16, fp32 sums "
        "(AVX512-BF16 dot products: a 16K-key top-k ~1.6x faster on a 2-core AMD EPYC; DeepSeek's own code scores in FP8, and "
        "`mlaserve verify --index-scores bf16` reports the kept positions' overlap with fp32); auto = bf16 for a GGUF whose indexer "
        "projections are block types of 6 bits or fewer (Q4_K_M and below: bf16 measured within half the file's own "
        "change) on the native kernels on a CPU with AVX512-BF16 or AMX-BF16, else fp32 (config/index_scores.py)",
        INDEX_SCORES,
    )
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
        "attention kernels (auto: native with the native kernels and float32, else torch; triton: the latent MQA "
        "(dense and DSA-sparse), the MHA of the decompressed path and the DSA index scores as Triton kernels over "
        "the paged cache, compiled on CUDA or run by Triton's interpreter where TRITON_INTERPRET=1 (tests), never "
        "chosen by auto, not with an 8-bit kv_cache_dtype; reference: the plain oracle)",
        ATTENTION_BACKENDS,
    )
    device: str = _opt("auto", "where weights, cache and step tensors live (auto: cuda when torch sees one)", DEVICES)
    cuda_graphs: str = _opt(
        "auto",
        "pure decode steps (every sequence one token, no prefill, no speculative verify, no request states) replay "
        "a CUDA graph captured per batch bucket (1, 2, 4, ... cuda_graph_max_batch) and context bucket (a power of "
        "two of pages), padded rows masked; every other step runs eagerly, and the ledger says which and why. auto = "
        "on for device cuda, off elsewhere; on with another device is refused. Capture time and graph memory are "
        "logged; not yet measured on a GPU",
        CUDA_GRAPHS,
    )
    cuda_graph_max_batch: int = _opt(
        64, "the largest batch bucket a CUDA graph is captured for (a larger decode step runs eagerly)"
    )
    kernels: str = _opt(
        "auto",
        "for checkpoints with quantized weights (GGUF blocks, FP8, quantization=): native = C kernels built at first "
        "use with the system compiler (decode-and-dot matmuls, the MoE router and routed experts of a decode step, "
        "RMSNorm, each layer's rope and cache write); triton = Triton kernels on a CUDA GPU for FP8 blocks and GGUF "
        "Q8_0 / Q4_K blocks (decode-and-multiply up to 16 rows, else decode, then GEMM; other weights as torch) "
        "and each MLA layer's kv_a norm, rope and cache write in one kernel (fp32 steps; "
        "on CPU only with TRITON_INTERPRET=1, Triton's interpreter, for tests); torch = dequantize, then GEMM, and "
        "torch ops (the reference); auto = native on CPU if it builds, triton on CUDA where Triton compiles (not yet run on a GPU)",
        KERNELS,
    )
    activations: str = _opt(
        "auto",
        "how the native kernels take activations on their small-batch path (<= 16 rows per weight: decode): "
        "float = exact products over the stored weights; int8 = quantized to int8 as llama.cpp does (32-value "
        "blocks for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL, 256-value q8_K blocks for Q4_K / Q5_K / Q6_K / "
        "IQ4_XS and the grid i-quants IQ1_S ... IQ3_S) with integer dot products "
        "(faster, not exact); int8_6bit = the same for weights of 6 bits or fewer only, Q8_0 / Q5_0 / Q5_1 exact; "
        "int8_6bit_int16 = int8_6bit, and Q8_0 / Q5_0 / MXFP4 with int16 activations (AVX512-VNNI or AVX2) at every "
        "decode row count (an int16 code per 32-value block, the integer sums exact, ~2^-16 of the block's largest "
        "activation per value: fp32 grade); auto = int8_6bit_int16 for GGUF files with the native kernels on a CPU "
        "with AVX512-VNNI or AVX2, int8_6bit on other CPUs (llama.cpp's choice for weights of 6 bits or fewer), else float",
        ACTIVATIONS,
    )
    prefill_matmul: str = _opt(
        "auto",
        "how the native kernels multiply on their many-rows path (> 16 rows per weight: prefill), where each weight "
        "is decoded, then one GEMM runs: float = fp32 GEMM on the exact decoded weights; bf16 = the decoded weight "
        "and the activations rounded to bfloat16, a bf16 GEMM with fp32 accumulation (oneDNN: AMX-BF16 / "
        "AVX512-BF16 where the CPU has them; not exact, within bf16's rounding); bf16_6bit = the same for weights of "
        "6 bits or fewer only, Q8_0 on the AMX-BF16 tiles where the CPU has them (its int8 codes exact in bf16, "
        "each activation split into its bf16 rounding and remainder, the sums and block scales in fp32: ~2^-16 per "
        "product, fp32 grade; kernels/bf16_pairs.py), without them on AVX512-VNNI with int16 activations (an int16 code "
        "per 32-value block, the integer sums exact, ~2^-16 of the block's largest activation per value, fp32 grade; "
        "kernels/int16_prefill.py, which the other 32-value block types Q4_0, Q5_0, IQ4_NL, MXFP4 take there too), else "
        "fp32; int8 = the products of up to 128 rows per weight "
        "(256 for the grid i-quants IQ2_* / IQ3_*; per active expert) whose weights take int8 activations (the "
        "activations option) and have AMX-INT8 tile kernels stay int8 on the tiles (measured faster than bf16 there; not exact, the int8 activations' rounding instead of bf16's); "
        "where the CPU has no tiles but AVX512-VNNI, the products of the weights with q8_K activations (Q4_K, Q5_K, "
        "Q6_K, the i-quants), dense and routed, stay int8 at every row count on 16-row weight panels (the same bits; "
        "measured 1.1-5.3x faster than bf16 decode-then-GEMM on a 2-core AVX-512 EPYC), and without AVX512-VNNI the "
        "same on 8-row AVX2 panels; "
        "the rest as bf16_6bit; needs int8 activations; int8_float = the same int8 products (on a CPU with neither "
        "tiles nor AVX512-VNNI, the same weights' products of 8+ rows at every row count on 8-row AVX2 weight "
        "panels, the same bits, the other routed experts' products of up to 128 rows per active expert on the int8 "
        "row kernels, and "
        "under int16 activations the Q8_0 / Q5_0 / MXFP4 experts' on the int16 row products), the rest fp32; auto = int8 for GGUF files with the native kernels and int8 "
        "activations on a CPU with AMX-INT8, or with AMX-BF16 / AVX512-BF16 and VNNI, else bf16_6bit on a CPU with "
        "AMX-BF16 or AVX512-BF16 (plain bf16's added error on Q8_0 is over half its own, so Q8_0 takes the pairs, "
        "int16 or fp32), else int8_float with int8 activations (a CPU without bf16 units: measured 1.2-1.5x faster "
        "prefill than fp32 on the Q4_K_M files of a 2-core AVX2 EPYC), else float. bf16 raises peak memory (~+0.3 GiB after a "
        "2048-token step of the standard model's Q4_K_M file: oneDNN's cached primitives and the heap they pin; rows "
        "are padded to a ladder of row counts so they do not grow with every prompt length, docs/PERFORMANCE.md); "
        "float keeps the lower peak",
        PREFILL_MATMULS,
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
        "the page cache and with every process that maps the file; the routed experts' gate, up and down stacks "
        "included); off: copied into the process at load",
    )
    gguf_prefetch: bool = _opt(
        True,
        "with gguf_mmap, read the GGUF's files into the page cache in a background thread once the model is "
        "loaded (as llama.cpp reads its file at load), so the first prompts do not wait on the disk; skipped when "
        "the files exceed four fifths of the available memory",
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
        "storage of the latent cache rows: auto = the compute dtype; float16 / bfloat16 = every value of the row "
        "[c_kv | k_pe] (and, on DSA models, of the indexer keys) as one 16-bit float, compute stays fp32: half the "
        "bytes of float32 (float16 is llama.cpp's default F16 cache for MLA models), every attention call within a "
        "bound from the rounding (u = 2^-11 / 2^-8; mlaserve verify); int8 / fp8_e4m3 = c_kv as 8-bit codes with "
        "an fp32 scale per 128 values (k_pe kept in the compute dtype) and, on DSA models, the indexer keys as FP8 "
        "e4m3 with a scale per token: ~2.5-2.9x the tokens of float32 in the same memory (c_kv alone ~3.9x), every "
        "attention call within a bound derived from the scales (mlaserve verify); DeepSeek-V4: fp8_e4m3 only, its "
        "compressed pools and window rings (and their prefix-cache snapshots) as the official FP8 rows, e4m3 per 64 "
        "with a 1-byte e8m0 scale, the rope part kept",
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


def option_default(name: str):
    return EngineOptions.__dataclass_fields__[name].default


def make_options(**kwargs) -> EngineOptions:
    """EngineOptions from keywords, with an error that lists the valid names."""
    unknown = sorted(set(kwargs) - set(EngineOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(EngineOptions.__dataclass_fields__)}")
    return EngineOptions(**{k: v for k, v in kwargs.items()})

"""The switches about the machine and the weights' form: device, quantization at load, the native kernels and
their activations, how a GGUF's blocks are held, the attention backend, dtype and threads. Each resolver
takes the user's request and what it depends on, records the value and why in provenance, and refuses what
cannot run (ConfigError). config/engine.py composes them (resolve) with the model-dependent switches; these
names are re-exported there, with the rest of the switches' vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlaserve.config.cpu import amx_int8, fast_bf16, int8_row_kernels, int8_rows, int16_rows
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import ProvenanceLog

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("auto", "torch", "native", "triton", "reference")
DEVICES = ("auto", "cpu", "cuda")
CUDA_GRAPHS = ("auto", "on", "off")
# what auto's GPU choices (kernels triton, cuda_graphs on) say until a GPU run has checked them (tests/gpu/)
NOT_RUN_ON_GPU = "not yet run on a GPU: benchmarks/gpu_check.sh's tests check it"
KERNELS = ("auto", "native", "triton", "torch")
ACTIVATIONS = ("auto", "float", "int8", "int8_6bit", "int8_6bit_int16")
# a resolved activations value -> the widest weight (bits per value) whose products take int8 activations (0: none;
# kernels/native.takes_int8 applies it per weight type), with 0x100 (kernels/native.INT16_REST) where the 32-value
# block types it leaves in fp32 take int16 activations (kernels/int16_prefill.takes_rest)
INT8_BITS = {"float": 0, "int8_6bit": 6, "int8": 8, "int8_6bit_int16": 6 | 0x100}
PREFILL_MATMULS = ("auto", "float", "bf16", "bf16_6bit", "int8", "int8_float")
# a resolved prefill_matmul value -> the widest weight (bits per value) whose many-rows products run in bf16 (0: none;
# kernels/bf16_prefill.takes_bf16 applies it per weight type, BF16_ALL = every type); "int8": bf16_6bit above the
# tiles' rows; "int8_float": fp32 there
BF16_BITS = {"float": 0, "bf16_6bit": 6, "bf16": 64, "int8": 6, "int8_float": 0}
# the resolved prefill_matmul values whose int8 products of up to kernels/ggml.tile_rows rows run on the AMX-INT8
# tiles, the VNNI panels or (routed experts) the row kernels (registry.KernelContext.tiles; each holder asks
# native.takes_tiles / takes_expert_int8 per weight at load)
PREFILL_TILES = frozenset({"int8", "int8_float"})
QUANTIZATIONS = (None, "int8", "int4")
GGUF_WEIGHTS = ("auto", "quantized", "dequantized")
DTYPES = {  # name -> torch's attribute (torch is imported when a config is built, not for `--help`)
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


def choose_device(requested: str, log: ProvenanceLog) -> str:
    import torch

    check_choice("device", requested, DEVICES)
    if requested == "auto":
        cuda = torch.cuda.is_available()
        return log.record(
            "device",
            "cuda" if cuda else "cpu",
            "engine default (auto: torch sees " + ("a CUDA device)" if cuda else "no CUDA device)"),
        )
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device (a CPU build of torch, or no GPU)")
    return log.record("device", requested, "user option")


def choose_quantization(requested: str | None, log: ProvenanceLog) -> str | None:
    check_choice("quantization", requested, QUANTIZATIONS)
    if requested is None:
        return log.record("quantization", None, "engine default (None: weights as the checkpoint stores them)")
    blocks = "Q8_0" if requested == "int8" else "Q4_0 (embedding and lm_head Q8_0)"
    return log.record("quantization", requested, f"user option: float weights put into {blocks} blocks at load")


def choose_kernels(
    requested: str, device: str, probe, log: ProvenanceLog, torch_holders: str | None = None, triton=None
) -> str:
    """probe: the native kernels' probe, given when the checkpoint's quantized weights have native kernels.
    torch_holders: without a probe, why quantized weights the checkpoint does hold run in torch (None: it
    holds none), so the recorded reason is what is true of this checkpoint. triton: the loader's probe of
    Triton on a device (platform/triton_runtime.py triton_mode: device -> .mode, .reason): "compiled" on a CUDA GPU, where
    auto takes it; "interpreter" (TRITON_INTERPRET=1, tests) only when asked for by name."""
    check_choice("kernels", requested, KERNELS)
    if requested == "torch":
        return log.record("kernels", "torch", "user option")
    if probe is None:
        how = "user option" if requested != "auto" else "engine default (auto)"
        return log.record("kernels", "torch", f"{how}: {torch_holders or 'the checkpoint holds no quantized weights'}")
    probed = triton(device) if triton is not None else None
    mode, why = (probed.mode, probed.reason) if probed is not None else (None, "Triton was not probed")
    if requested == "triton":
        if mode is None:
            raise ConfigError(f"kernels='triton' cannot run on {device}: {why}")
        return log.record("kernels", "triton", f"user option: {why}")
    if device != "cpu":
        if requested == "native":
            raise ConfigError(f"kernels='native' runs on the CPU; device is {device!r} (pass kernels='torch')")
        if mode == "compiled":
            return log.record(
                "kernels", "triton", f"engine default (auto: {why}; FP8 / GGUF Q8_0 / Q4_K weights; {NOT_RUN_ON_GPU})"
            )
        return log.record(
            "kernels", "torch", f"engine default (auto: the native kernels are CPU code; device {device}; {why})"
        )
    available, detail = probe()
    if not available:
        if requested == "native":
            raise ConfigError(f"kernels='native' but the native kernels are not available: {detail}")
        return log.record("kernels", "torch", f"engine default (auto: {detail})")
    how = "user option" if requested == "native" else "engine default (auto: built for this CPU)"
    return log.record("kernels", "native", f"{how}: {detail}")


INT8_SCOPE = (
    "products of <= 16 activation rows per weight (decode; routed experts and attn_k_b / attn_v_b of small "
    "chunks) quantize their activations to int8 as llama.cpp does (32-value blocks for Q4_0 / Q4_1 / Q5_0 / Q5_1 / "
    "Q8_0 / IQ4_NL, q8_K's 256-value blocks for Q4_K / Q5_K / Q6_K / IQ4_XS / IQ3_XXS / IQ3_S / IQ2_XXS / IQ2_XS "
    "/ IQ2_S / IQ1_S / IQ1_M) and take integer dot products (not exact: |dy| <= sum |w| |d_x| / 2)"
)


INT16_SCOPE = (
    "Q8_0, Q5_0 and MXFP4 (left in fp32 by the int8 rule: Q5_0's int8 logits moved over half a fixture's own error) "
    "take int16 activations at every decode row count (each an int16 code per 32 values, ~2^-16 of the block's "
    "largest, fp32 grade; the blocks read as they lie: AVX512-VNNI's vpdpwssd, where their prefill takes them too, or "
    "AVX2's vpmaddwd; kernels/int16_prefill.py)"
)


def choose_activations(requested: str, kernels: str, gguf: bool, log: ProvenanceLog) -> str:
    """float | int8_6bit | int8 (INT8_BITS). auto: int8 activations for a GGUF's weights of 6 bits or fewer with the
    native kernels (llama.cpp's own choice; the added error stays well inside the file's own quantization error,
    which `verify --against` measures per layer), exact float for Q8_0 and wider; float elsewhere."""
    check_choice("activations", requested, ACTIVATIONS)
    if requested == "float":
        return log.record("activations", "float", "user option (exact products)")
    if requested == "auto":
        if kernels != "native" or not gguf:
            why = f"kernels={kernels}" if kernels != "native" else "not a GGUF file"
            return log.record("activations", "float", f"engine default (auto: exact products; {why})")
        int16, why16 = int16_rows()
        if int16:
            return log.record(
                "activations",
                "int8_6bit_int16",
                f"engine default (auto, llama.cpp's choice for weights of 6 bits or fewer): {INT8_SCOPE}; {INT16_SCOPE} "
                f"({why16}); Q5_1 and other weights stay exact, as do the attention over the cache "
                "(activations='float': exact everywhere)",
            )
        return log.record(
            "activations",
            "int8_6bit",
            f"engine default (auto, llama.cpp's choice for weights of 6 bits or fewer): {INT8_SCOPE}; Q8_0, "
            "Q5_0 / Q5_1 (their int8 logits moved over half a fixture's own error) and other weights stay exact, "
            f"as do larger chunks and the attention over the cache ({why16}: no int16 activations; "
            "activations='float': exact everywhere)",
        )
    if kernels != "native":
        raise ConfigError(
            f"activations={requested!r} runs in the native kernels, but kernels resolved to {kernels!r} "
            f"({log.source('kernels')}); it needs quantized weights (a GGUF, FP8 or quantization=...) on CPU"
        )
    if requested == "int8_6bit_int16" and not (int16 := int16_rows())[0]:
        raise ConfigError(
            f"activations='int8_6bit_int16' needs the int16 dot products of AVX512-VNNI or AVX2: {int16[1]}"
        )
    which = {
        "int8": "every weight type with int8 kernels (Q8_0 too)",
        "int8_6bit": "weights of <= 6 bits but Q5_0 / Q5_1",
        "int8_6bit_int16": f"weights of <= 6 bits but Q5_0 / Q5_1; {INT16_SCOPE}",
    }[requested]
    return log.record(
        "activations",
        requested,
        f"user option: {which}: {INT8_SCOPE}; other weight types, larger chunks and the attention over the cache "
        "stay exact",
    )


BF16_SCOPE = (
    "products of more than 16 activation rows per weight (prefill: the weight decoded natively, then one GEMM) "
    "round the decoded weight and the activations to bfloat16 and run a bf16 GEMM with fp32 accumulation "
    "(oneDNN; not exact: |dy| <= u |y| + (2u + K 2^-24) sum |x| |w|, u = 2^-8)"
)
BF16_RULE = (
    "weights of 6 bits or fewer (bf16 adds 0.04-0.16x their own quantization error on the fixtures' products); "
    "Q8_0 takes bf16 pairs on AMX-BF16 tiles (fp32 grade), int16 activations on AVX512-VNNI without them (fp32 "
    "grade), fp32 elsewhere (plain bf16: 0.54-0.57x, over the rule's 1/2; the pairs: its int8 codes exact in bf16 "
    "times each activation's bf16 rounding and remainder, the sums and block scales in fp32, ~2^-16 per product; "
    "int16: an int16 code per activation and 32-value block, exact integer sums, ~2^-16 of the block's largest "
    "activation per value, which the 4-5 bit 32-value block types Q4_0, Q5_0, IQ4_NL, MXFP4 take there instead of "
    "bf16)"
)


INT8_PREFILL_SCOPE = (
    "products of up to 128 rows per weight (256 for the grid i-quants IQ2_* / IQ3_*; per active expert on "
    "average: kernels/ggml.tile_rows, measured crossovers) whose weights take int8 activations (activations) and "
    "have AMX-INT8 tile kernels stay int8 on the tiles instead of bf16 decode-then-GEMM (the decode kernels' bits; the rounding is the int8 activations' "
    "instead of bf16's, within the same rule: verify --against reports it per layer as act)"
)
# measured where auto takes int8_float: a 2-core AMD EPYC with AVX2 only (Zen 3), 2 threads, prefill of a 512-token
# prompt, 3 alternated rounds in one process (the experts' int8 rows against decode + fp32 grouped GEMMs)
INT8_FLOAT_MEASURED = (
    "prefill 512 on a 2-core AVX2-only EPYC: glm-real Q4_K_M 3.3-4.2 -> 2.5-2.6 s, ds-real Q4_K_M 3.4-3.6 -> 2.8-3.0, "
    "the standard Q4_K_M 1.9-2.4 -> 1.9-2.0; with the AVX2 panels since, 174 -> 253-281 tok/s, 153 -> 229, 260 -> 408 "
    "(1.31-1.46x llama.cpp's)"
)
INT8_ROWS_SCOPE = (
    "without AMX-INT8 tiles, on a CPU with AVX512-VNNI the products of the weights with q8_K activations (Q4_K, Q5_K, "
    "Q6_K and the i-quants: kernels/native.INT8_PANEL_TYPES), dense and routed, stay int8 at every row count on "
    "16-row weight panels (the decode kernels' bits; measured 1.1-5.3x faster than bf16 decode-then-GEMM by type and "
    "row count on a 2-core AVX-512 EPYC: kernels/ggml.PANEL_INT8_ROWS); without AVX512-VNNI (AVX-VNNI, AVX2) the same "
    "on 8-row AVX2 panels from 8 rows (the same bits); routed experts of a type without panels keep their products of "
    "up to 128 rows per active expert (on average: kernels/ggml.ROW_KERNEL_ROWS) int8 on the row kernels instead of "
    "the experts decoded for a bf16 GEMM (measured 1.05-1.5x faster prefill on the real-shape Q4_K_M files and the IQ "
    "mix of that EPYC before the panels; level at 128 rows); the other dense weights as bf16_6bit"
)
INT8_FLOAT_SCOPE = (
    "the int8 products of int8's choice (the AMX-INT8 tiles, the AVX512-VNNI panels, the AVX2 panels at every row count, "
    "or the routed experts' products "
    "of up to 128 rows per active expert on the int8 row kernels: the decode kernels' bits, the int8 activations' "
    "rounding within the rule; under int16 activations without int16 panels, the Q8_0 / Q5_0 / MXFP4 experts' on the "
    "int16 row products, fp32 grade), every other many-rows product fp32 GEMMs on the exact decoded weights (no bf16)"
)


def choose_prefill_matmul(
    requested: str,
    kernels: str,
    gguf: bool,
    log: ProvenanceLog,
    activations: str = "float",
) -> str:
    """float | bf16_6bit | bf16 | int8 | int8_float (BF16_BITS, PREFILL_TILES). auto: bf16 GEMMs for a GGUF's weights of 6 bits or
    fewer with the native kernels on a CPU whose bf16 GEMMs are fast (config/cpu.fast_bf16: AMX-BF16 or
    AVX512-BF16), their added error measured well inside the file's own (kernels/bf16_prefill.py), and on a CPU
    with AMX-INT8 where int8 activations apply (activations resolved, not float) int8: the products of up to
    kernels/ggml.tile_rows rows of the weights with tile kernels stay int8 on the tiles (measured faster there),
    bf16_6bit above; on a CPU without the tiles but with VNNI (config/cpu.int8_rows) int8 too: the q8_K types on
    the AVX512-VNNI panels at every row count, or without them the routed experts' products of up to
    kernels/ggml.ROW_KERNEL_ROWS rows per expert on the row kernels (INT8_ROWS_SCOPE); on a CPU whose bf16 GEMMs are
    slow (an AVX2 CPU) with int8 activations int8_float: those int8 products, fp32 GEMMs for the rest (measured faster
    than fp32 everywhere: INT8_FLOAT_MEASURED); exact fp32 elsewhere."""
    check_choice("prefill_matmul", requested, PREFILL_MATMULS)
    if requested == "float":
        return log.record("prefill_matmul", "float", "user option (fp32 GEMMs on the exact decoded weights)")
    if requested in PREFILL_TILES and INT8_BITS[activations] == 0:
        raise ConfigError(
            f"prefill_matmul={requested!r} keeps int8 activations on the prefill products, but activations resolved to "
            f"'float' ({log.source('activations')}); use activations='auto' / 'int8_6bit' / 'int8', or another "
            "prefill_matmul"
        )
    fast, cpu = fast_bf16()
    if requested == "auto":
        if kernels != "native" or not gguf:
            why = f"kernels={kernels}" if kernels != "native" else "not a GGUF file"
            return log.record("prefill_matmul", "float", f"engine default (auto: fp32 GEMMs; {why})")
        rows8, rows8_cpu = int8_row_kernels()
        if not fast and rows8 and INT8_BITS[activations]:
            return log.record(
                "prefill_matmul",
                "int8_float",
                f"engine default (auto: {cpu}: bf16 GEMMs are slower than fp32 here; {rows8_cpu}; activations "
                f"{activations}): "
                f"{INT8_FLOAT_SCOPE} ({INT8_FLOAT_MEASURED}); prefill_matmul='float': fp32 everywhere",
            )
        if not fast:
            why = f"engine default (auto: {cpu}: bf16 GEMMs are slower than fp32 here, so fp32 GEMMs)"
            return log.record("prefill_matmul", "float", why)
        tiles, tiles_cpu = amx_int8()
        rows, rows_cpu = int8_rows()
        if (tiles or rows) and INT8_BITS[activations]:
            scope = INT8_PREFILL_SCOPE if tiles else INT8_ROWS_SCOPE
            return log.record(
                "prefill_matmul",
                "int8",
                f"engine default (auto: {tiles_cpu if tiles else rows_cpu}, activations {activations}): {scope}; "
                f"above, and for the other weights, {BF16_SCOPE}, for {BF16_RULE} (prefill_matmul='bf16_6bit': "
                "bf16 GEMMs only; 'float': fp32 everywhere)",
            )
        return log.record(
            "prefill_matmul",
            "bf16_6bit",
            f"engine default (auto: {cpu}): {BF16_SCOPE}, for {BF16_RULE}; decode products unchanged "
            "(prefill_matmul='float': fp32 everywhere)",
        )
    if kernels != "native":
        raise ConfigError(
            f"prefill_matmul={requested!r} runs in the native kernels, but kernels resolved to {kernels!r} "
            f"({log.source('kernels')}); it needs quantized weights (a GGUF or quantization=...) on CPU"
        )
    which = "every weight type (Q8_0 too)" if requested == "bf16" else BF16_RULE
    slow = "" if fast else f"; {cpu}: slower than fp32 here"
    if requested == "int8_float":
        return log.record("prefill_matmul", requested, f"user option: {INT8_FLOAT_SCOPE}")
    if requested == "int8":
        tiles, tiles_cpu = amx_int8()
        none = "" if tiles else f"; {tiles_cpu}: no product takes the tiles here; {INT8_ROWS_SCOPE}"
        why = f"user option: {INT8_PREFILL_SCOPE}{none}; above, and for the other weights, {BF16_SCOPE}, for {which}"
        return log.record("prefill_matmul", requested, why + slow)
    return log.record("prefill_matmul", requested, f"user option: {which}: {BF16_SCOPE}{slow}")


def choose_gguf_weights(requested: str, gguf: bool, ranks: int, log: ProvenanceLog) -> str | None:
    check_choice("gguf_weights", requested, GGUF_WEIGHTS)
    if not gguf:
        log.record("gguf_weights", None, f"unused ({requested!r}): the checkpoint is not a GGUF file")
        return None
    if requested == "auto":
        return log.record(
            "gguf_weights",
            "quantized",
            "engine default (auto: block-quantized tensors stay in their ggml blocks"
            + (f"; each of the {ranks} ranks reads its slice's blocks)" if ranks > 1 else ")"),
        )
    return log.record("gguf_weights", requested, "user option")


def choose_attention_backend(
    requested: str,
    kernels: str,
    dtype: torch.dtype,
    log: ProvenanceLog,
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
    triton: Callable | None = None,
) -> str:
    """triton: the loader's probe of how Triton kernels run on a device (platform/triton_runtime.py triton_mode:
    device -> .mode "compiled" | "interpreter" | None, .reason), asked only for attention_backend='triton'."""
    import torch

    check_choice("attention_backend", requested, ATTENTION_BACKENDS)
    fits = kernels == "native" and dtype == torch.float32
    if requested == "auto":
        # never triton: on a CPU only its interpreter runs the kernels (for tests), and on CUDA it is unmeasured
        if fits:
            why = "engine default (auto: native kernels and an fp32 cache: the latent MQA in one C call per layer)"
            return log.record("attention_backend", "native", why)
        return log.record("attention_backend", "torch", "engine default (auto: torch; 'reference' is the plain oracle)")
    if requested == "native" and not fits:
        raise ConfigError(
            f"attention_backend='native' needs the native kernels and dtype float32 (kernels {kernels!r}: "
            f"{log.source('kernels')}; dtype {dtype})"
        )
    if requested == "triton":
        return log.record("attention_backend", "triton", "user option; " + _triton_runs(device, kv_cache_dtype, triton))
    return log.record("attention_backend", requested, "user option")


def _triton_runs(device: str, kv_cache_dtype: str, triton: Callable | None) -> str:
    """How the triton backend's kernels run on `device` (compiled or interpreted, for provenance), or a ConfigError
    naming why they cannot."""
    if triton is None:
        raise ConfigError("attention_backend='triton': how Triton kernels run on this device was not probed")
    mode = triton(device)
    if mode.mode is None:
        raise ConfigError(f"attention_backend='triton' cannot run on device {device!r}: {mode.reason}")
    if kv_cache_dtype not in (None, "auto"):
        raise ConfigError(
            f"attention_backend='triton' reads cache rows in the compute dtype (fp32 / bf16 / fp16); "
            f"kv_cache_dtype={kv_cache_dtype!r} (rows stored apart from it: 8-bit codes or 16-bit rows under an fp32 "
            "compute dtype) is not supported by its kernels (use attention_backend='torch' or 'native'; an engine "
            "with dtype float16 / bfloat16 keeps its cache in 16 bits with kv_cache_dtype='auto')"
        )
    return f"Triton kernels {mode.mode}: {mode.reason}"


def choose_dtype(
    requested: str | None, device: str, quantized: bool, ranks: int, stored_bf16, log: ProvenanceLog
) -> torch.dtype:
    import torch

    if requested not in (None, "auto"):
        if requested not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {requested!r}")
        return log.record("dtype", getattr(torch, DTYPES[requested]), "user option")
    # bfloat16 only where it is fast and rounds no stored weight: float matrices stored in bf16, on a CPU with
    # AVX512-BF16/AMX, one process (under torchrun each machine would read its own CPU's flags)
    if device != "cpu":
        why = f"float32 on {device}: exact against the reference"
    elif quantized:
        why = "float32 activations for quantized weights (the native kernels' products are fp32)"
    elif ranks > 1:
        why = "float32 with tensor_parallel_size > 1 (every rank the same, whatever its CPU)"
    else:
        fast, cpu = fast_bf16()
        if fast and stored_bf16 is not None and stored_bf16():
            return log.record(
                "dtype",
                torch.bfloat16,
                f"engine default (auto: {cpu} and the checkpoint stores its matrices in bf16: bfloat16, "
                "~2x faster than float32 there; pass dtype='float32' for results exact against the reference)",
            )
        if fast:
            why = f"{cpu}, but the checkpoint's matrices are not all bf16 (bfloat16 would round them): float32"
        else:
            why = f"{cpu}, so float32 (exact against the reference); bfloat16 is ~4x slower here"
    return log.record("dtype", torch.float32, f"engine default (auto: {why})")


# Below this many weights a model is bound by per-op overhead: one thread is fastest and does not stall
# when another process holds a core (measured; see platform/threads.py).
SMALL_MODEL_PARAMS = 50_000_000


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(cfg: ModelConfig, requested: int | None, ranks: int = 1) -> tuple[int, str]:
    """-> (threads per process, the reason recorded in provenance). Tensor parallel: the N ranks on
    this machine share its cores."""
    cores = _usable_cores()
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"threads must be an integer >= 1, got {requested!r}")
        return requested, "user option"
    n = cfg.estimated_params()
    if n < SMALL_MODEL_PARAMS:
        return 1, (
            f"engine default (auto: ~{n / 1e6:.1f}M parameters < {SMALL_MODEL_PARAMS // 10**6}M: per-op overhead "
            "bound, one thread is fastest and does not stall when another process holds a core)"
        )
    if ranks > 1:
        per_rank = max(1, cores // ranks)
        return per_rank, f"engine default (auto: ~{n / 1e6:.0f}M parameters: {cores} usable cores / {ranks} ranks)"
    return cores, f"engine default (auto: ~{n / 1e6:.0f}M parameters: every usable core, {cores})"


def choose_cuda_graphs(requested: str, device: str, max_batch: int, log: ProvenanceLog) -> tuple[bool, int]:
    """Whether pure decode steps replay a captured CUDA graph (executor/cuda_graphs.py), and the largest batch
    bucket captured. auto = on for device cuda, off elsewhere; on with another device is refused: a CUDA graph
    replays CUDA kernels, and there is nothing to capture on a CPU."""
    check_choice("cuda_graphs", requested, CUDA_GRAPHS)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"cuda_graph_max_batch must be an integer >= 1, got {max_batch!r}")
    if requested == "on" and device != "cuda":
        raise ConfigError(
            f"cuda_graphs='on' needs device 'cuda' (device is {device!r}: {log.source('device')}); a CUDA graph "
            "replays captured CUDA kernels, so there is nothing to capture there (use 'auto' or 'off')"
        )
    if requested == "auto":
        on = device == "cuda"
        why = "engine default (auto: " + (
            f"device cuda; {NOT_RUN_ON_GPU})" if on else f"off on device {device!r}, on for cuda only)"
        )
    else:
        on, why = requested == "on", "user option"
    log.record("cuda_graphs", on, why)
    log.record("cuda_graph_max_batch", max_batch, "user option" if max_batch != 64 else "engine default (64)")
    return on, max_batch

"""How a DSA indexer's scores are computed (`index_scores`), decided once from the model, the file and the machine.

  fp32  q and every key in fp32, fp32 dot products: the reference's arithmetic (transformers' indexer).
  bf16  q and every key rounded to bf16 (to nearest even) before the dot products, which are summed in fp32, as are
        the head-weighted ReLUs: on AVX512-BF16 the products run as vdpbf16ps, half the instructions of the fp32
        fmas (csrc/indexer.c); the torch and reference backends round the same values and score them in fp32.
        A lossy choice: a key whose score lies within the rounding of the k-th best may swap with its neighbour,
        and every later layer attends a little differently. DeepSeek's own inference code and vLLM score this
        indexer coarser still, in FP8 (queries and keys e4m3 with a scale per 128 values).
auto takes bf16 by the rule of int8 activations (config/machine.py): where the change it adds is measured at no
more than half the file's own. benchmarks/index_scores.py measures both on the DSA benchmark model as the share
of kept positions that move over a 1024-token prompt at top-128 (every layer's change carried into the next):
its Q8_0 file moves them 24.5% from the float checkpoint's and bf16 scores 17.1% more (0.70x: over the rule, so
fp32), its Q4_K_M file 44.5% and bf16 19.6% (0.44x: within). So auto is bf16 for a GGUF whose indexer query and
key projections (wq_b, wk) are stored in block types of 6 bits or fewer (loading/probes.py indexer_bits; float
ones passed over, the file's type class read from the rest), with the native kernels
on a CPU whose bf16 dot products are fast (config/cpu.py fast_bf16); fp32 elsewhere, float checkpoints and every
test that compares with transformers included. `mlaserve verify --index-scores bf16` reports the kept positions'
overlap between the two (verify judges its identities with auto's lossy switches exact). The route records the
choice per selecting segment (Segment.index_scoring).
Applies to the per-token indexer of DeepSeek-V3.2 / GLM-5 (attention kind mla_dsa); GLM-5.3-Flash's pooled
indexer and DeepSeek-V4's (v4_indexer) keep their own scoring.
"""

from __future__ import annotations

from collections.abc import Callable

from mlaserve.config.cpu import fast_bf16
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import ProvenanceLog

INDEX_SCORES = ("auto", "fp32", "bf16")
BF16_BACKENDS = ("native", "torch", "reference")  # the backends whose index_topk rounds for "bf16" (not triton's)
BF16_WEIGHT_BITS = 6  # auto: the widest indexer projection (bits per stored value) whose file takes bf16 scores


def choose_index_scores(
    requested: str,
    model: ModelConfig,
    sparse: bool,
    kernels: str,
    backend: str,
    log: ProvenanceLog,
    indexer_bits: Callable[[], tuple[int, str] | None] | None = None,
) -> str:
    """fp32 | bf16 (module docstring). indexer_bits: the loader's probe of a GGUF's indexer projections (the widest
    block type's bits and name; None: not a GGUF, or float projections). A bf16 request the engine cannot honour is
    refused, naming why."""
    if requested not in INDEX_SCORES:
        raise ConfigError(f"index_scores must be one of {INDEX_SCORES}, got {requested!r}")
    unfit = _unfit(model, sparse, backend)
    if requested == "bf16" and unfit:
        raise ConfigError(f"index_scores='bf16' cannot apply: {unfit}")
    if requested != "auto":
        return log.record("index_scores", requested, "user option")
    if unfit:
        return log.record("index_scores", "fp32", f"auto: {unfit}")
    why = _auto_fp32(kernels, indexer_bits)
    if why:
        return log.record("index_scores", "fp32", f"auto: fp32 scores ({why})")
    bits, name = indexer_bits()
    return log.record(
        "index_scores",
        "bf16",
        f"auto: the indexer's projections are stored in {bits} bits or fewer ({name}), the native kernels, "
        f"{fast_bf16()[1]}: q and keys rounded to bf16, fp32 sums (vdpbf16ps; measured within half the file's own "
        "change of the kept positions; index_scores='fp32' keeps the reference's scores)",
    )


def _auto_fp32(kernels: str, indexer_bits: Callable | None) -> str | None:
    """Why auto keeps fp32 on a model bf16 scores could apply to (None: it takes bf16)."""
    if kernels != "native":
        return f"kernels {kernels}"
    fast, cpu = fast_bf16()
    if not fast:
        return cpu
    found = indexer_bits() if indexer_bits is not None else None
    if found is None:
        return "not a GGUF file, or its indexer projections are float"
    bits, name = found
    if bits > BF16_WEIGHT_BITS:
        return (
            f"the indexer's projections are stored as {name}, over {BF16_WEIGHT_BITS} bits: there bf16 scores move "
            "the kept positions more than half as much as the file's own rounding"
        )
    return None


def _unfit(model: ModelConfig, sparse: bool, backend: str) -> str | None:
    """Why bf16 scores cannot apply here (None: they can)."""
    if model.indexer is None:
        return "the model has no DSA indexer (DeepSeek-V4's is v4_indexer)"
    if model.indexer.kpool:
        return "GLM-5.3-Flash's pooled indexer scores in fp32 only"
    if not sparse:
        return "attention runs dense (no indexer)"
    if backend not in BF16_BACKENDS:
        return f"the {backend} attention backend scores in fp32 only ({', '.join(BF16_BACKENDS)} round to bf16)"
    return None

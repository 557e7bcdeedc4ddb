"""A load's two stages as plain data: Checkpoint (opened: the config resolved, no tensor read yet) and LoadedModel
(filled: the model, its engine config, tokenizer and load report). loading/model_loader.py makes both; the
tensor-parallel workers (distributed/group.py) read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlaserve.config.engine import EngineConfig
from mlaserve.config.model import ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.engine.tokenizer import Tokenizer
from mlaserve.kernels.registry import KernelPlan
from mlaserve.loading.prefetch import Prefetch
from mlaserve.loading.weights import LoadReport
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.quant.ggml_plan import GGUFPlan
from mlaserve.quant.plan import QuantPlan


@dataclass
class Checkpoint:
    """An opened checkpoint: config resolved, tensors not read yet."""

    path: Path
    model_cfg: ModelConfig
    engine_cfg: EngineConfig
    source: object  # SafetensorsSource | GGUFTensors
    tokenizer: Tokenizer | None
    skipped: list[str]
    scheme: object = None  # the checkpoint's quantization (quant.config), None when unquantized
    check_tensors: bool = False  # scan the filled weights for NaN/Inf (a GGUF was scanned at open)
    skipped_note: str = ""  # what `skipped` is (default: a GGUF's nextn/MTP tensors)


@dataclass
class LoadedModel:
    model: MLAForCausalLM
    config: EngineConfig
    tokenizer: Tokenizer | None
    report: LoadReport
    path: Path
    generation_config: dict  # the folder's generation_config.json ({} when absent): sampling defaults
    quant: QuantPlan | None = None  # which modules hold quantized weights (None: an unquantized checkpoint)
    gguf: GGUFPlan | None = None  # a GGUF's modules kept in their ggml blocks (None: not kept / not GGUF)
    quantized_at_load: tuple[Setting, ...] = ()  # quantization=int8|int4: what became which blocks, what stayed
    kernel_plan: KernelPlan | None = None  # per layer and op, the implementation and why (kernels/registry.py)
    prefetch: Prefetch | None = None  # the mapped GGUF's background read into the page cache (gguf_prefetch)

"""mlaserve: an inference and serving engine for Multi-head Latent Attention models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.config.engine import EngineConfig, EngineOptions
    from mlaserve.config.model import ModelConfig
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.sampling.params import SamplingParams
    from mlaserve.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "ModelConfig", "EngineConfig", "EngineOptions", "StructuredOutputs"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): `mlaserve --help` answers without loading torch.
_LAZY = {
    "LLM": "mlaserve.entrypoints.llm",
    "SamplingParams": "mlaserve.sampling.params",
    "ModelConfig": "mlaserve.config.model",
    "EngineConfig": "mlaserve.config.engine",
    "EngineOptions": "mlaserve.config.engine",
    "StructuredOutputs": "mlaserve.structured",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlaserve' has no attribute {name!r}")

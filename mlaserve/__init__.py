"""mlaserve: an inference and serving engine for Multi-head Latent Attention models."""

from mlaserve.config.engine import EngineConfig, EngineOptions
from mlaserve.config.model import ModelConfig
from mlaserve.entrypoints.llm import LLM
from mlaserve.sampling.params import SamplingParams
from mlaserve.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "ModelConfig", "EngineConfig", "EngineOptions", "StructuredOutputs"]
__version__ = "0.1.0"

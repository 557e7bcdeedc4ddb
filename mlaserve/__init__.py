"""mlaserve: an inference and serving engine for Multi-head Latent Attention models."""

from .config import ModelConfig
from .engine_config import EngineConfig, EngineOptions
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "ModelConfig", "EngineConfig", "EngineOptions"]
__version__ = "0.1.0"

"""mlaserve: an inference and serving engine for Multi-head Latent Attention models."""

from .config import ModelConfig
from .engine_config import EngineConfig, EngineOptions
from .llm import LLM

__all__ = ["LLM", "ModelConfig", "EngineConfig", "EngineOptions"]
__version__ = "0.1.0"

"""A multimodal wrapper's config.json (kimi_k25, glm5_next: `Family.text_config`): its text_config is the
model served, read by the MLA reader as its own model_type; the wrapper and its tie flag are recorded."""

from __future__ import annotations

from typing import Any

from mlaserve.config import families
from mlaserve.config.model_parts import ConfigError
from mlaserve.config.provenance import Setting


def text_part(raw: Any, source: str) -> tuple[dict[str, Any], str, tuple[Setting, ...]] | None:
    """A wrapper family's text_config with its source, the settings recording the wrapper, and last the
    wrapper's tie setting; None for a config that is not a wrapper's."""
    family = families.by_model_type(raw.get("model_type")) if isinstance(raw, dict) else None
    if family is None or not family.text_config:
        return None
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: {family.name} needs a text_config object (its text model), got {text!r}")
    inner_type = text.get("model_type", "deepseek_v3")  # Kimi_K25Config's SubConfigSpec default
    inner = families.by_model_type(inner_type)
    if inner is None or inner.text_config or inner.reader != "mla":
        raise ConfigError(f"{source}: text_config.model_type {inner_type!r} is not an MLA text model this engine reads")
    tie = raw.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r} ({type(tie).__name__})")
    given = tie is not None
    tie = family.tie_default if tie is None else tie
    settings = (
        Setting(
            "wrapper",
            family.name,
            f"{source}:model_type: a multimodal wrapper; its text_config ({inner_type}) is the model served, "
            f"tensors under {family.text_prefix!r}; {', '.join(family.skipped_prefixes)} skipped",
        ),
        Setting(
            "tie_word_embeddings",
            tie,
            f"{source}:tie_word_embeddings (the wrapper's)"
            if given
            else f"class default ({family.name} wrapper: {family.tie_default}; 'tie_word_embeddings' absent); "
            "the loader decides from the weights present",
        ),
    )
    return {**text, "model_type": inner_type, "tie_word_embeddings": tie}, f"{source}:text_config", settings

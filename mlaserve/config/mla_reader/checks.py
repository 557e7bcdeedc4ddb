"""The checks of the MLA reader: the raw fields' types and least values before anything is read
(`check_sizes`), and the built config's values that cannot define a model (`check_model_config`), each error
naming the key and where its value came from."""

from __future__ import annotations

import math
from typing import Any, Protocol

from mlaserve.config.model_parts import ConfigError, MoEConfig, RopeConfig
from mlaserve.config.provenance import Setting


class BuiltConfig(Protocol):
    """The fields of a built ModelConfig these checks read (a Protocol, not config/model.py's class: model.py
    builds the config with these checks, so naming its class here would make an import circle)."""

    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def rope(self) -> RopeConfig: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def moe(self) -> MoEConfig | None: ...
    @property
    def mlp_layer_types(self) -> tuple[str, ...]: ...
    @property
    def provenance(self) -> tuple[Setting, ...]: ...


# Integer fields and their least sensible value; a float, a string or a bool is an error naming the key.
_INT_FIELDS = {
    "hidden_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "kv_lora_rank": 1,
    "qk_nope_head_dim": 1,
    "qk_rope_head_dim": 0,  # 0: no rope slice (NoPE MLA, GLM-5.3-Flash's): the cache row is the latent only
    "v_head_dim": 1,
    "vocab_size": 1,
    "intermediate_size": 1,
    "q_lora_rank": 1,
    "moe_intermediate_size": 1,
    "n_routed_experts": 0,
    "num_experts_per_tok": 1,
    "n_shared_experts": 0,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 2,  # a prompt of one token and one more
    "num_nextn_predict_layers": 0,
    "index_topk": 1,
    "index_head_dim": 1,
    "index_n_heads": 1,
    "num_layers": 1,  # LongCat-Flash: decoder layers (two attention sublayers each)
    "zero_expert_num": 0,
    "head_dim": 1,
    "qk_head_dim": 1,
}
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
# JSON booleans: a string ("false") or a number is an error naming the key, never read as truthy.
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob", "rope_interleave", "router_bias")
# Fields with a vocabulary: a value outside it is an error naming the key (None: absent, the default).
_CHOICE_FIELDS = {
    "topk_method": ("greedy", "group_limited_greedy", "noaux_tc"),
    "scoring_func": ("softmax", "sigmoid"),
    # every supported family runs SwiGLU with SiLU ("swish" is transformers' other name for it); the
    # native kernels and the grouped experts apply SiLU, so another activation is refused, not run as SiLU
    "hidden_act": ("silu", "swish"),
}


def check_sizes(raw: dict[str, Any], source: str, renamed: dict[str, str] | None = None) -> None:
    """Integer fields are ints >= their minimum, float fields numbers, booleans JSON booleans, fields with a
    vocabulary one of its values: an error names the key (and the legacy key it was read from, `renamed`)."""
    renamed = renamed or {}
    label = lambda key: f"{key} ({renamed[key]})" if key in renamed else key  # noqa: E731
    for key in _BOOL_FIELDS:  # bool() of any other value ([] or "false" too) would pick a different model
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{source}: {label(key)} must be true or false, got {value!r} ({type(value).__name__})")
    for key, allowed in _CHOICE_FIELDS.items():
        value = raw.get(key)
        if value is not None and value not in allowed:
            raise ConfigError(f"{source}: {label(key)} {value!r} is not supported; one of {allowed}")
    for key, least in _INT_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {label(key)} must be an integer, got {value!r} ({type(value).__name__})")
        if value < least:
            raise ConfigError(f"{source}: {label(key)} must be >= {least}, got {value}")
    for key in _FLOAT_FIELDS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{source}: {label(key)} must be a number, got {value!r} ({type(value).__name__})")


def check_model_config(cfg: BuiltConfig, source: str, field_sources: dict[str, str] | None = None) -> None:
    """Values that cannot define a model, rejected at load naming the key (they would otherwise
    give NaN logits or a different model at the first forward pass)."""
    origin = {st.name: st.source for st in cfg.provenance} | (field_sources or {})
    for key, alias in (("rope_theta", "rope_parameters.rope_theta"), ("rope_scaling.factor", "rope_parameters.factor")):
        if alias in origin:
            origin[key] = origin[alias]
    _positive_finite(source, "rms_norm_eps", cfg.rms_norm_eps, origin)
    _positive_finite(source, "rope_theta", cfg.rope.theta, origin)
    _positive_finite(source, "rope_scaling.factor", cfg.rope.factor, origin)
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if not math.isfinite(getattr(cfg.rope, name)):
            raise ConfigError(f"{source}: rope_scaling.{name} must be finite, got {getattr(cfg.rope, name)}")
    for key, value in (("bos_token_id", cfg.bos_token_id),) + tuple(("eos_token_id", e) for e in cfg.eos_token_ids):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.vocab_size
        ):
            raise ConfigError(f"{source}: {key} {value!r} is outside the vocabulary [0, {cfg.vocab_size})")
    if cfg.moe is not None:
        _check_moe(cfg.moe, source, origin)
    elif "moe" in cfg.mlp_layer_types:
        layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
        raise ConfigError(
            f"{source}: layers {layers} are MoE layers (mlp_layer_types / first_k_dense_replace) but "
            "n_routed_experts is 0 or absent: set the experts or make the layers dense"
        )


def _check_moe(moe: MoEConfig, source: str, origin: dict[str, str]) -> None:
    e = moe.n_routed_experts
    if moe.zero_experts:  # LongCat-Flash: the top-k is over the real and the identity experts
        if not 1 <= moe.num_experts_per_tok <= moe.scored_experts:
            raise ConfigError(
                f"{source}: num_experts_per_tok must be in [1, n_routed_experts + zero_expert_num = "
                f"{moe.scored_experts}], got {moe.num_experts_per_tok}"
            )
    elif not 1 <= moe.num_experts_per_tok <= e:
        raise ConfigError(
            f"{source}: num_experts_per_tok must be in [1, n_routed_experts={e}], got {moe.num_experts_per_tok}"
        )
    _positive_finite(source, "routed_scaling_factor", moe.routed_scaling_factor, origin)
    if moe.topk_method in ("group_limited_greedy", "noaux_tc"):
        if e % moe.n_group:
            raise ConfigError(f"{source}: n_group={moe.n_group} must divide n_routed_experts={e}")
        if not 1 <= moe.topk_group <= moe.n_group:
            raise ConfigError(f"{source}: topk_group must be in [1, n_group={moe.n_group}], got {moe.topk_group}")
        if moe.topk_group * (e // moe.n_group) < moe.num_experts_per_tok:
            raise ConfigError(
                f"{source}: num_experts_per_tok={moe.num_experts_per_tok} exceeds the experts of the top "
                f"{moe.topk_group} group(s) ({moe.topk_group} x {e // moe.n_group})"
            )


def _positive_finite(source: str, key: str, value: float, origin: dict[str, str]) -> None:
    if not (math.isfinite(value) and value > 0):
        came = f" (from {origin[key]})" if key in origin else ""
        raise ConfigError(f"{source}: {key} must be a finite number > 0, got {value}{came}")

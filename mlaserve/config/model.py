"""Frozen, composed configuration: the model's shape (from config.json or GGUF metadata) and
the engine's switches, each with the provenance of its value.

The families (config.json `model_type`: defaults and field rules) are in config/families/, one
file each; the adapter below reads any of them by asking its `Family`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from mlaserve.config import families
from mlaserve.config.families import Family
from mlaserve.config.glm5_next import read_glm5_next
from mlaserve.config.model_parts import (  # noqa: F401  (re-exported: the rest of the package imports them from here)
    ConfigError,
    IndexerConfig,
    KDAConfig,
    LatentScale,
    MoEConfig,
    RopeConfig,
    power_of_two,
    yarn_mscale,
)
from mlaserve.config.provenance import ProvenanceLog, Setting

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
    "intermediate_size",
)
# Why the MLA reader refuses a DeepSeek-V4 config, and where it goes instead.
V4_NOT_SERVED = (
    "model_type deepseek_v4 is not MLA (one shared K=V head, sliding window, compressed rows): its config is read "
    "by mlaserve.config.deepseek_v4 and its model is mlaserve.models.deepseek_v4; the loader opens a V4 folder "
    "through them (loading/model_loader.py)"
)
# transformers builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps in every family.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope: RopeConfig
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" | "moe"
    moe: MoEConfig | None
    indexer: IndexerConfig | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    latent_norm_eps: float = LATENT_NORM_EPS
    num_nextn_predict_layers: int = 0
    # attention sublayers per decoder layer (LongCat-Flash: 2, each with its own latent row per token)
    sublayers: int = 1
    latent_scale: LatentScale | None = None  # LongCat-Flash's sqrt(hidden / rank) on q and c_kv
    kda: KDAConfig | None = None  # Kimi-Linear: its KDA (linear-attention) layers; None: every layer MLA
    # GLM-5.3-Flash: the mHC residual (config/deepseek_v4.py V4HyperConnections: streams, Sinkhorn iterations, eps,
    # the final collapse a mean) and the SwiGLU clamp of every MLP and expert; None elsewhere
    hyper: Any = None
    swiglu_limit: float | None = None
    provenance: tuple[Setting, ...] = field(default=(), compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached row: c_kv (kv_lora_rank) then k_pe (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def estimated_params(self) -> int:
        """Weights of the model from its config (embeddings, attention, MLP/MoE, lm_head); an estimate
        good to a few percent, enough to choose a thread count."""
        d, h = self.hidden_size, self.num_heads
        q = (
            (d * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim)
            if self.q_lora_rank
            else d * h * self.qk_head_dim
        )
        attn = q + d * self.latent_dim + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        attn += h * self.v_head_dim * d
        # LongCat-Flash: two attention sublayers and two dense MLPs next to its MoE
        attn, dense = attn * self.sublayers, 3 * d * self.intermediate_size * (self.sublayers - 1)
        total = 0
        for i, kind in enumerate(self.mlp_layer_types):
            total += self._kda_params() if self.kda is not None and i in self.kda.layers else attn
            if kind == "moe":
                m = self.moe
                total += dense + 3 * d * m.moe_intermediate_size * (m.n_routed_experts + m.n_shared_experts)
            else:
                total += dense + 3 * d * self.intermediate_size
        if self.indexer is not None:  # wq_b, wk, weights_proj on the layers that own an indexer
            ix = self.indexer
            per = (self.q_lora_rank or 0) * ix.n_heads * ix.head_dim + d * ix.head_dim + d * ix.n_heads
            total += per * sum(t == "full" for t in ix.layer_types)
        return total + d * self.vocab_size * (1 if self.tie_word_embeddings else 2)

    def _kda_params(self) -> int:
        """A KDA layer's weights: q/k/v/o projections, f_a/f_b and g_a/g_b (low rank d), b_proj, the convs."""
        k, d = self.kda, self.hidden_size
        return (
            4 * d * k.width
            + 2 * (d * k.head_dim + k.head_dim * k.width)
            + d * k.num_heads
            + 3 * k.width * k.conv_kernel
        )

    @property
    def is_dsa_architecture(self) -> bool:
        return self.indexer is not None

    @property
    def family(self) -> Family:
        return families.by_model_type(self.model_type)

    @classmethod
    def from_hf(
        cls, raw: dict[str, Any], source: str = "config.json", field_sources: dict[str, str] | None = None
    ) -> ModelConfig:
        """field_sources: where each key of `raw` came from when it is not a config.json (GGUF metadata).
        A multimodal wrapper (kimi_k25) is read as its text_config, the wrapper recorded."""
        wrapper = _text_part(raw, source)
        if wrapper is None:
            return _HFAdapter(raw, source, field_sources or {}).build()
        text, text_source, settings = wrapper
        cfg = _HFAdapter(text, text_source, {}, wrapper_tie=settings[-1]).build()
        return replace(cfg, provenance=settings[:-1] + cfg.provenance)


def _text_part(raw: Any, source: str) -> tuple[dict[str, Any], str, tuple[Setting, ...]] | None:
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


class _HFAdapter:
    """Reads one config.json dict into a ModelConfig, recording where each value came from."""

    def __init__(
        self, raw: dict[str, Any], source: str, field_sources: dict[str, str], wrapper_tie: Setting | None = None
    ) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the config must be a JSON object (a dict), got {type(raw).__name__}")
        self.raw, self.source, self.log = raw, source, ProvenanceLog()
        self.field_sources = field_sources
        mt = raw.get("model_type")
        if mt is None:
            raise ConfigError(f"{source}: missing required field 'model_type'")
        family = families.by_model_type(mt)
        if family is None:
            raise ConfigError(f"{source}: unknown model_type {mt!r}; supported: {', '.join(families.model_types())}")
        if family.reader != "mla":
            raise ConfigError(
                f"{source}: {V4_NOT_SERVED}" if family.reader == "deepseek_v4" else f"{source}: {mt} is not MLA"
            )
        self.family, name = family, family.name
        self.log.record("model_type", name, f"{source}:model_type" + (f" ({mt} alias)" if mt != name else ""))
        self.raw = self._translate_legacy(raw)
        if wrapper_tie is not None:  # the text config's own tie flag is not the one the wrapper class uses
            self.log.record(wrapper_tie.name, wrapper_tie.value, wrapper_tie.source)

    def _translate_legacy(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The family's legacy keys read under their current names, each recorded ("from legacy key X");
        keys the reference drops recorded as dropped. The caller's dict is not changed."""
        family, out = self.family, dict(raw)
        self.renamed: dict[str, str] = {}  # current name -> the legacy key it was read from (error messages)
        for old, new in family.legacy_keys.items():
            if old not in raw:
                continue
            if new in raw and raw[new] != raw[old]:
                raise ConfigError(
                    f"{self.source}: {old} (legacy key for {new}) = {raw[old]!r} but {new} = {raw[new]!r}; give one"
                )
            out[new] = out.pop(old)
            self.renamed[new] = f"legacy key {old}"
            where = self.field_sources.get(old, f"{self.source}:{old}")
            self.field_sources = {**self.field_sources, new: f"{where} (from legacy key {old})"}
            self.log.record(f"{new} <- {old}", out[new], f"{where}: legacy key of {family.name}, read as {new}")
        for own, new in family.own_keys.items():
            if own not in raw:
                continue
            if new in raw and raw[new] != raw[own]:
                raise ConfigError(
                    f"{self.source}: {own} ({family.name}'s name for {new}) = {raw[own]!r} but {new} = {raw[new]!r}; give one"
                )
            out[new] = out.pop(own)
            self.renamed[new] = f"{family.name} key {own}"
            where = self.field_sources.get(own, f"{self.source}:{own}")
            self.field_sources = {**self.field_sources, new: f"{where} ({family.name}'s name for {new})"}
        for key, why in family.dropped_keys.items():
            if key in out:
                self.log.record(f"{key} (dropped)", out.pop(key), f"{self.source}:{key}: {why}")
        return out

    def get(self, key: str, required: bool = False) -> Any:
        if key in self.raw and self.raw[key] is not None or (key in self.raw and key == "q_lora_rank"):
            return self.log.record(key, self.raw[key], self.field_sources.get(key, f"{self.source}:{key}"))
        name, defaults = self.family.name, self.family.defaults
        if required or key not in defaults:
            raise ConfigError(f"{self.source}: missing required field {key!r} for model_type {name}")
        return self.log.record(key, defaults[key], f"class default ({name}; '{key}' absent)")

    def build(self) -> ModelConfig:
        g = self.get
        _check_sizes(self.raw, self.source, self.renamed)
        num_layers = self._decoder_layers()
        for key in _REQUIRED:
            if key != "num_hidden_layers":  # read by _decoder_layers
                g(key, required=True)
        heads = self.raw["num_attention_heads"]
        kv_heads = self.raw.get("num_key_value_heads", heads)
        if kv_heads not in (None, heads):
            # MLA has one latent KV shared by all heads; transformers repeats K/V per kv-head group,
            # which only equals MLA when num_key_value_heads == num_attention_heads.
            raise ConfigError(
                f"{self.source}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA"
            )
        q_lora = g("q_lora_rank")
        if q_lora is None and self.family.has_indexer:
            raise ConfigError(
                f"{self.source}: q_lora_rank must be set for {self.family.name} (its indexer reads the query latent)"
            )
        act = self.raw.get("hidden_act")
        self.log.record(
            "hidden_act",
            act or "silu",
            self.field_sources.get("hidden_act", f"{self.source}:hidden_act")
            if act
            else "class default (silu; 'hidden_act' absent)",
        )
        if not self.family.glm5_next:  # GLM-5.3-Flash's attention uses rms_norm_eps there (_glm5_next records it)
            self.log.record(
                "latent_norm_eps",
                LATENT_NORM_EPS,
                "reference: transformers builds q_a_layernorm/kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says",
            )
        cfg = ModelConfig(
            model_type=self.family.name,
            vocab_size=self.raw["vocab_size"],
            hidden_size=self.raw["hidden_size"],
            num_layers=num_layers,
            num_heads=heads,
            q_lora_rank=q_lora,
            kv_lora_rank=self.raw["kv_lora_rank"],
            qk_nope_head_dim=self.raw["qk_nope_head_dim"],
            qk_rope_head_dim=self.raw["qk_rope_head_dim"],
            v_head_dim=self.raw["v_head_dim"],
            intermediate_size=self.raw["intermediate_size"],
            rms_norm_eps=float(g("rms_norm_eps")),
            tie_word_embeddings=bool(self.raw.get("tie_word_embeddings", False)),
            attention_bias=bool(self.raw.get("attention_bias", False)),
            rope=self._rope(),
            mlp_layer_types=self._mlp_layer_types(num_layers),
            moe=self._moe(),
            indexer=self._indexer(num_layers),
            bos_token_id=self.raw.get("bos_token_id"),
            eos_token_ids=_as_tuple(self.raw.get("eos_token_id")),
            max_position_embeddings=int(self.raw.get("max_position_embeddings", 4096)),
            num_nextn_predict_layers=int(self.raw.get("num_nextn_predict_layers", 0) or 0),
            sublayers=self.family.sublayers,
            latent_scale=self._latent_scale(q_lora),
            kda=self._kda(num_layers),
            provenance=self.log.freeze(),
        )
        if self.family.glm5_next:
            cfg = self._glm5_next(cfg)
        check_model_config(cfg, self.source, self.field_sources)
        return cfg

    def _glm5_next(self, cfg: ModelConfig) -> ModelConfig:
        """GLM-5.3-Flash's schedules and the fields the MLA reader does not know, from config/glm5_next.py's reader
        (checked there against transformers' own parse), each recorded with its source."""
        layout = read_glm5_next(self.raw, self.source)
        mlp = tuple("dense" if t == "dense" else "moe" for t in layout.mlp_layer_types)
        if any(t == "moe" for t in mlp) and cfg.moe is None:
            raise ConfigError(f"{self.source}: mlp_layer_types names sparse layers but n_routed_experts is not set")
        # KDA layers have no indexer; an indexed layer's role is its indexer_types entry
        roles = tuple(
            "none" if t != "indexed_attention" else r for t, r in zip(layout.layer_types, layout.indexer_types)
        )
        indexer = replace(cfg.indexer, layer_types=roles, kpool=layout.index_kpool, topk=layout.index_topk)
        return replace(
            cfg,
            mlp_layer_types=mlp,
            indexer=indexer,
            kda=layout.kda,
            hyper=layout.hc,
            swiglu_limit=layout.swiglu_limit,
            latent_norm_eps=cfg.rms_norm_eps,
            provenance=cfg.provenance
            + tuple(s for s in layout.provenance if s not in cfg.provenance)  # a key both readers record: once
            + (
                Setting(
                    "latent_norm_eps",
                    cfg.rms_norm_eps,
                    "reference: Glm5NextTextAttention builds q_a_layernorm / kv_a_layernorm with rms_norm_eps",
                ),
            ),
        )

    def _decoder_layers(self) -> int:
        """Decoder layers. A family of two attention sublayers per layer (LongCat-Flash) gives `num_layers`;
        transformers derives num_hidden_layers = 2 x num_layers (LongcatFlashConfig's property, whose setter
        reads a given num_hidden_layers back as num_layers = value // 2), recorded as derived."""
        n_sub, name = self.family.sublayers, self.family.name
        if n_sub == 1:
            return self.get("num_hidden_layers", required=True)
        given = self.raw.get("num_hidden_layers")
        if "num_layers" in self.raw:
            n = self.get("num_layers")
            if given is not None and given != n_sub * n:
                raise ConfigError(
                    f"{self.source}: num_hidden_layers={given} but num_layers={n}: {name} has {n_sub} attention "
                    f"sublayers per decoder layer, so num_hidden_layers must be {n_sub} x num_layers = {n_sub * n}"
                )
        elif given is not None:
            if given % n_sub:
                raise ConfigError(
                    f"{self.source}: num_hidden_layers={given} is not a multiple of {n_sub} ({name}: {n_sub} "
                    "attention sublayers per decoder layer) and num_layers is absent"
                )
            n = self.log.record(
                "num_layers", given // n_sub, f"derived: {self.source}:num_hidden_layers / {n_sub} (num_layers absent)"
            )
        else:
            raise ConfigError(f"{self.source}: missing required field 'num_layers' for model_type {name}")
        self.log.record(
            "num_hidden_layers",
            n_sub * n,
            f"derived: {n_sub} x num_layers ({name}: {n_sub} attention sublayers per decoder layer, "
            "each with its own latent cache row)",
        )
        return n

    def _latent_scale(self, q_lora: int | None) -> LatentScale | None:
        """LongCat-Flash's sqrt(hidden / rank) on q and c_kv, and where each is applied (LatentScale)."""
        if self.family.sublayers == 1:
            return None
        name, d = self.family.name, self.raw["hidden_size"]
        if not q_lora:
            raise ConfigError(f"{self.source}: q_lora_rank must be set for {name} (its query always has a latent)")
        head_dim = self.raw.get("head_dim")
        if head_dim is not None and head_dim != self.raw["qk_rope_head_dim"]:
            # transformers builds the rope tables over head_dim and rotates the qk_rope_head_dim slice with them
            raise ConfigError(
                f"{self.source}: head_dim={head_dim} must equal qk_rope_head_dim={self.raw['qk_rope_head_dim']} "
                f"({name}'s rope is built over head_dim and applied to the rope slice)"
            )
        qk = self.raw.get("qk_head_dim")
        if qk is not None and qk != self.raw["qk_nope_head_dim"] + self.raw["qk_rope_head_dim"]:
            raise ConfigError(
                f"{self.source}: qk_head_dim={qk} must equal qk_nope_head_dim + qk_rope_head_dim = "
                f"{self.raw['qk_nope_head_dim'] + self.raw['qk_rope_head_dim']}"
            )
        for key in (
            "mla_scale_q_lora",
            "mla_scale_kv_lora",
        ):  # the original release's flags; transformers always scales
            flag = self.raw.get(key)
            if flag is not None and flag is not True:
                raise ConfigError(
                    f"{self.source}: {key}={flag!r}: {name} is run with the scale (transformers always applies it); "
                    "a model trained without it is not this family"
                )
        method = self.raw.get("attention_method")
        if method is not None and method != "MLA":
            raise ConfigError(f"{self.source}: attention_method {method!r} is not supported ({name}: 'MLA')")
        scales = {}
        for part, rank, weight in (("q", q_lora, "q_b_proj"), ("kv", self.raw["kv_lora_rank"], "kv_a_layernorm")):
            s = (d / rank) ** 0.5  # transformers' (hidden_size / rank) ** 0.5
            folded = power_of_two(s)
            where = (
                f"folded into {weight}'s weight (a power of two: the same products bit for bit)"
                if folded
                else f"applied at run time after {weight} (not a power of two: folding would round)"
            )
            self.log.record(
                f"{part}_latent_scale", s, f"derived: sqrt(hidden_size / {part}_lora_rank) = sqrt({d}/{rank}); {where}"
            )
            scales[part] = (s, folded)
        return LatentScale(scales["q"][0], scales["kv"][0], scales["q"][1], scales["kv"][1])

    def _rope(self) -> RopeConfig:
        if self.family.nope is not None:  # NoPE: the rope slice is kept, never rotated
            self.log.record(
                "rope", "none (identity: cos 1, sin 0)", f"family rule ({self.family.name}: {self.family.nope})"
            )
            return RopeConfig(dim=self.raw["qk_rope_head_dim"], theta=10000.0, interleaved=False, rope_type="none")
        params = self.raw.get("rope_parameters")
        where = "rope_parameters"
        if params is None:  # pre-v5 configs: rope_theta + rope_scaling
            params = dict(self.raw.get("rope_scaling") or {})
            params.setdefault("rope_theta", self.raw.get("rope_theta", self._default_theta()))
            where = "rope_scaling/rope_theta"
        if not isinstance(params, dict):
            raise ConfigError(f"{self.source}: {where} must be a JSON object, got {params!r}")
        num = lambda key, default, zero_absent=True: _number(  # noqa: E731
            params.get(key), default, f"{self.source}: {where}.{key}", zero_absent
        )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in self.family.rope_type_aliases:
            legacy, rope_type = rope_type, self.family.rope_type_aliases[rope_type]
            self.log.record(
                "rope_type <- legacy",
                rope_type,
                f"{self.source}:{where}: {legacy!r} read as {rope_type!r} ({self.family.name})",
            )
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"{self.source}: {where}.rope_type {rope_type!r} is not supported (default, yarn)")
        interleaved = self._rope_interleaved()
        rope = RopeConfig(
            dim=self.raw["qk_rope_head_dim"],
            theta=num("rope_theta", self._default_theta(), zero_absent=False),
            interleaved=interleaved,
            rope_type=rope_type,
            factor=num("factor", 1.0, zero_absent=rope_type != "yarn"),  # yarn: 0 is an error, not 1
            original_max_position_embeddings=int(num("original_max_position_embeddings", 0)),
            beta_fast=num("beta_fast", 32.0),
            beta_slow=num("beta_slow", 1.0),
            mscale=num("mscale", 0.0),
            mscale_all_dim=num("mscale_all_dim", 0.0),
            truncate=_flag(params.get("truncate"), True, f"{self.source}: {where}.truncate"),
        )
        if rope_type == "yarn" and not rope.original_max_position_embeddings:
            raise ConfigError(f"{self.source}: {where}.original_max_position_embeddings is required for yarn")
        self.log.record("rope", f"{rope_type}, theta={rope.theta}, factor={rope.factor}", f"{self.source}:{where}")
        return rope

    def _default_theta(self) -> float:
        """rope_theta when the config gives none: the family's (transformers' default_theta), else 10000."""
        return self.family.default_theta

    def _rope_interleaved(self) -> bool:
        rule = self.family.rope_rule
        if rule is not None:
            return self.log.record("rope_interleave", True, f"family rule ({self.family.name}: {rule})")
        return bool(self.get("rope_interleave"))

    def _mlp_layer_types(self, num_layers: int) -> tuple[str, ...]:
        types = self.raw.get("mlp_layer_types")
        if types is not None and self.family.reads_mlp_layer_types:
            if not isinstance(types, list) or len(types) != num_layers:
                raise ConfigError(
                    f"{self.source}: mlp_layer_types must be a list of {num_layers} entries "
                    f"(num_hidden_layers), got {types!r}"
                )
            out = tuple("dense" if t == "dense" else "moe" for t in types)
            self.log.record("mlp_layer_types", out, f"{self.source}:mlp_layer_types")
            return out
        first = self.family.first_dense_layers
        if first is not None:
            out = ("dense",) * first + ("moe",) * (num_layers - first)
            dense = "first layer dense" if first == 1 else f"first {first} layers dense" if first else "every layer MoE"
            return self.log.record("mlp_layer_types", out, f"class default ({self.family.name}: {dense})")
        n_dense = int(self.get("first_k_dense_replace"))
        if n_dense > num_layers:
            raise ConfigError(f"{self.source}: first_k_dense_replace={n_dense} exceeds num_hidden_layers={num_layers}")
        out = ("dense",) * n_dense + ("moe",) * (num_layers - n_dense)
        return self.log.record("mlp_layer_types", out, "derived from first_k_dense_replace")

    def _moe(self) -> MoEConfig | None:
        if not self.raw.get("n_routed_experts"):
            return None
        g, name = self.get, self.family.name
        if self.family.zero_experts:
            return self._zero_expert_moe()
        if self.family.scoring_func == "softmax":
            scoring, method = "softmax", g("topk_method")
            if method not in ("greedy", "group_limited_greedy"):
                raise ConfigError(f"{self.source}: topk_method {method!r} not supported for {name}")
            norm = self.log.record(
                "norm_topk_prob", False, f"reference rule: transformers' {name} router ignores norm_topk_prob"
            )
        else:
            scoring = self.log.record("scoring_func", "sigmoid", f"family rule ({name}: sigmoid + correction bias)")
            method = self.log.record("topk_method", "noaux_tc", f"family rule ({name})")
            norm = bool(g("norm_topk_prob"))
        n_group, topk_group = g("n_group"), g("topk_group")
        if method in ("group_limited_greedy", "noaux_tc") and (n_group is None or topk_group is None):
            raise ConfigError(f"{self.source}: topk_method {method} needs n_group and topk_group")
        return MoEConfig(
            n_routed_experts=g("n_routed_experts"),
            num_experts_per_tok=g("num_experts_per_tok"),
            n_shared_experts=int(g("n_shared_experts") or 0),
            moe_intermediate_size=g("moe_intermediate_size", required=True),
            scoring_func=scoring,
            topk_method=method,
            n_group=int(n_group or 1),
            topk_group=int(topk_group or 1),
            norm_topk_prob=norm,
            routed_scaling_factor=float(g("routed_scaling_factor")),
        )

    def _zero_expert_moe(self) -> MoEConfig:
        """LongCat-Flash's router (LongcatFlashTopkRouter): softmax over the real and the identity experts, top-k
        on the scores plus e_score_correction_bias, no renormalisation, x routed_scaling_factor; no shared expert."""
        g, name = self.get, self.family.name
        # transformers reads it with getattr(config, "router_bias", False): no class field, absent is False
        given = self.raw.get("router_bias")
        bias = self.log.record(
            "router_bias",
            bool(given),
            f"{self.source}:router_bias" if given is not None else "absent: False (transformers' getattr default)",
        )
        if bias:
            raise ConfigError(
                f"{self.source}: router_bias true is not supported for {name}: transformers then allocates "
                "router.classifier.bias but its router never adds it"
            )
        kind = self.raw.get("zero_expert_type")
        if kind is not None and kind != "identity":  # the original release's key: transformers runs identity only
            raise ConfigError(f"{self.source}: zero_expert_type {kind!r} is not supported ({name}: 'identity')")
        rule = f"family rule ({name}: LongcatFlashTopkRouter)"
        self.log.record("scoring_func", "softmax", rule)
        self.log.record("topk_method", "greedy", f"{rule}: top-k of softmax + e_score_correction_bias")
        self.log.record("norm_topk_prob", False, f"{rule}: the top-k weights are not renormalised")
        return MoEConfig(
            n_routed_experts=g("n_routed_experts"),
            num_experts_per_tok=g("num_experts_per_tok"),
            n_shared_experts=0,
            moe_intermediate_size=g("moe_intermediate_size", required=True),
            scoring_func="softmax",
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=float(g("routed_scaling_factor")),
            zero_experts=int(g("zero_expert_num") or 0),
        )

    def _kda(self, num_layers: int) -> KDAConfig | None:
        """Kimi-Linear: which layers are KDA (from layer_types, else linear_attn_config's 1-indexed lists; neither
        is an error naming the keys) and the KDA widths (linear_attn_config or the flat linear_* keys)."""
        if not self.family.kda:
            return None
        sub = self.raw.get("linear_attn_config")
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{self.source}: linear_attn_config must be a JSON object, got {sub!r}")
        sub = sub or {}
        kda = self._kda_layers(num_layers, sub)
        widths = {}
        for flat, nested in (
            ("linear_num_heads", "num_heads"),
            ("linear_head_dim", "head_dim"),
            ("linear_conv_kernel_dim", "short_conv_kernel_size"),
        ):
            least = 2 if flat == "linear_conv_kernel_dim" else 1  # a conv of width 1 keeps no state
            here = {k: v for k, v in ((flat, self.raw.get(flat)), (f"linear_attn_config.{nested}", sub.get(nested)))}
            for key, value in here.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                    raise ConfigError(f"{self.source}: {key} must be an integer >= {least}, got {value!r}")
            given = {k: v for k, v in here.items() if v is not None}
            if len(set(given.values())) > 1:
                raise ConfigError(
                    f"{self.source}: {' and '.join(f'{k}={v}' for k, v in given.items())} differ; give one"
                )
            if given:
                key, value = next(reversed(given.items()))  # linear_attn_config's name when both agree
                widths[flat] = self.log.record(flat, value, self.field_sources.get(key, f"{self.source}:{key}"))
            else:
                widths[flat] = self.get(flat)
        return KDAConfig(
            layers=kda,
            num_heads=widths["linear_num_heads"],
            head_dim=widths["linear_head_dim"],
            conv_kernel=widths["linear_conv_kernel_dim"],
            lower_bound=self._kda_lower_bound() if self.family.kda_lower_bound else None,
        )

    def _kda_lower_bound(self) -> float | None:
        """linear_lower_bound: a negative number (the log-space gate's floor), or null (no bound: the softplus gate)."""
        if "linear_lower_bound" not in self.raw:
            return self.get("linear_lower_bound")  # the family's class default, recorded as such
        value = self.raw["linear_lower_bound"]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value < 0):
            raise ConfigError(f"{self.source}: linear_lower_bound must be a negative number or null, got {value!r}")
        bound = None if value is None else float(value)
        return self.log.record("linear_lower_bound", bound, f"{self.source}:linear_lower_bound")

    def _kda_layers(self, num_layers: int, sub: dict) -> tuple[int, ...]:
        types = self.raw.get("layer_types")
        from_types = None
        if types is not None:
            kinds = ("linear_attention", "full_attention")
            if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(kinds):
                raise ConfigError(
                    f"{self.source}: layer_types must be a list of {num_layers} entries (num_hidden_layers), each "
                    f"one of {kinds}, got {types!r}"
                )
            from_types = tuple(i for i, t in enumerate(types) if t == "linear_attention")
        from_sub = None
        if "kda_layers" in sub or "full_attn_layers" in sub:
            lists = {}
            for key in ("kda_layers", "full_attn_layers"):
                got = sub.get(key)
                if not isinstance(got, list) or any(
                    isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers for n in got
                ):
                    raise ConfigError(
                        f"{self.source}: linear_attn_config.{key} must be a list of 1-indexed layer numbers in "
                        f"[1, {num_layers}], got {got!r}"
                    )
                lists[key] = got
            named = lists["kda_layers"] + lists["full_attn_layers"]
            if sorted(named) != list(range(1, num_layers + 1)):
                raise ConfigError(
                    f"{self.source}: linear_attn_config.kda_layers and full_attn_layers must name every layer 1.."
                    f"{num_layers} exactly once, got kda {lists['kda_layers']} and full {lists['full_attn_layers']}"
                )
            from_sub = tuple(sorted(n - 1 for n in lists["kda_layers"]))
        if from_types is None and from_sub is None:
            raise ConfigError(
                f"{self.source}: kimi_linear needs its layer pattern: layer_types (per layer 'linear_attention' | "
                "'full_attention') or linear_attn_config.kda_layers + full_attn_layers; neither is given"
            )
        if from_types is not None and from_sub is not None and from_types != from_sub:
            raise ConfigError(
                f"{self.source}: layer_types makes layers {list(from_types)} KDA but linear_attn_config.kda_layers "
                f"makes {list(from_sub)} (0-indexed); give one"
            )
        if from_types is not None:
            where = self.field_sources.get("layer_types", f"{self.source}:layer_types")  # a GGUF: its key
            return self.log.record("kda_layers", from_types, f"{where} ('linear_attention')")
        return self.log.record(
            "kda_layers", from_sub, f"{self.source}:linear_attn_config.kda_layers (1-indexed, read 0-indexed)"
        )

    def _indexer(self, num_layers: int) -> IndexerConfig | None:
        if not self.family.has_indexer:
            return None
        g = self.get
        types = self.raw.get("indexer_types")
        if self.family.glm5_next:  # per layer, KDA layers included: read and recorded by config/glm5_next.py
            types = ["full"] * num_layers  # (_glm5_next replaces these roles; recording them here listed it twice)
        elif types is None:
            types = ["full"] * num_layers
            self.log.record("indexer_types", "all full", "class default (no indexer_types)")
        else:
            self.log.record("indexer_types", tuple(types), f"{self.source}:indexer_types")
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
            raise ConfigError(
                f"{self.source}: indexer_types must be a list of {num_layers} 'full'/'shared' entries, got {types!r}"
            )
        if types[0] != "full":
            raise ConfigError(f"{self.source}: indexer_types[0] must be 'full' (a shared layer reuses a previous one)")
        interleaved = self.family.indexer_rope_interleaved
        self.log.record(
            "indexer_rope",
            "interleaved" if interleaved else "half-split",
            f"family rule ({self.family.name}, as transformers)",
        )
        return IndexerConfig(
            n_heads=g("index_n_heads"),
            head_dim=g("index_head_dim"),
            topk=g("index_topk"),
            rope_interleaved=interleaved,
            layer_types=tuple(types),
        )


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


def _check_sizes(raw: dict[str, Any], source: str, renamed: dict[str, str] | None = None) -> None:
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


def check_model_config(cfg: ModelConfig, source: str, field_sources: dict[str, str] | None = None) -> None:
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


def _flag(value: Any, default: bool, where: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _number(value: Any, default: float, where: str, zero_absent: bool = True) -> float:
    """A float field that may be absent or null (then its default; 0 too where zero_absent)."""
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return float(value or default) if zero_absent else float(value)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return values

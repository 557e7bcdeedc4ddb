"""Frozen, composed configuration: the model's shape (from config.json or GGUF metadata) and
the engine's switches, each with the provenance of its value.

The families (config.json `model_type`: defaults and field rules) are in config/families/, one
file each; `ModelConfig.from_hf` reads any of them by asking its `Family`: config/mla_reader/ holds the
readers of the fields (one file per concern or family) and `_read` below composes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mlaserve.config import families
from mlaserve.config.families import Family
from mlaserve.config.mla_reader.checks import check_model_config, check_sizes
from mlaserve.config.mla_reader.dsa import read_indexer
from mlaserve.config.mla_reader.glm5_next import apply_glm5_next
from mlaserve.config.mla_reader.kimi_linear import read_kda
from mlaserve.config.mla_reader.longcat_flash import decoder_layers, latent_scale
from mlaserve.config.mla_reader.moe import mlp_layer_types, read_moe
from mlaserve.config.mla_reader.raw import V4_NOT_SERVED, RawConfig, as_tuple
from mlaserve.config.mla_reader.rope import read_rope
from mlaserve.config.mla_reader.wrapper import text_part
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
from mlaserve.config.provenance import Setting

__all__ = [
    "LATENT_NORM_EPS",
    "V4_NOT_SERVED",
    "ConfigError",
    "IndexerConfig",
    "KDAConfig",
    "LatentScale",
    "ModelConfig",
    "MoEConfig",
    "RopeConfig",
    "check_model_config",
    "power_of_two",
    "yarn_mscale",
]

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
    # GLM-5.3-Flash: the mHC residual (config/deepseek_v4_parts.py V4HyperConnections: streams, Sinkhorn iterations,
    # eps, the final collapse a mean) and the SwiGLU clamp of every MLP and expert; None elsewhere
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
        wrapper = text_part(raw, source)
        if wrapper is None:
            return _read(RawConfig(raw, source, field_sources or {}))
        text, text_source, settings = wrapper
        cfg = _read(RawConfig(text, text_source, {}, wrapper_tie=settings[-1]))
        return replace(cfg, provenance=settings[:-1] + cfg.provenance)


def _read(r: RawConfig) -> ModelConfig:
    """The ModelConfig of one MLA config.json, its fields read in the order their provenance lists them."""
    g = r.get
    check_sizes(r.raw, r.source, r.renamed)
    num_layers = decoder_layers(r)
    for key in _REQUIRED:
        if key != "num_hidden_layers":  # read by decoder_layers
            g(key, required=True)
    heads = r.raw["num_attention_heads"]
    kv_heads = r.raw.get("num_key_value_heads", heads)
    if kv_heads not in (None, heads):
        # MLA has one latent KV shared by all heads; transformers repeats K/V per kv-head group,
        # which only equals MLA when num_key_value_heads == num_attention_heads.
        raise ConfigError(f"{r.source}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} for MLA")
    q_lora = g("q_lora_rank")
    if q_lora is None and r.family.has_indexer:
        raise ConfigError(
            f"{r.source}: q_lora_rank must be set for {r.family.name} (its indexer reads the query latent)"
        )
    act = r.raw.get("hidden_act")
    r.log.record(
        "hidden_act",
        act or "silu",
        r.field_sources.get("hidden_act", f"{r.source}:hidden_act")
        if act
        else "class default (silu; 'hidden_act' absent)",
    )
    if not r.family.glm5_next:  # GLM-5.3-Flash's attention uses rms_norm_eps (mla_reader/glm5_next.py records it)
        r.log.record(
            "latent_norm_eps",
            LATENT_NORM_EPS,
            "reference: transformers builds q_a_layernorm/kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says",
        )
    cfg = ModelConfig(
        model_type=r.family.name,
        vocab_size=r.raw["vocab_size"],
        hidden_size=r.raw["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=r.raw["kv_lora_rank"],
        qk_nope_head_dim=r.raw["qk_nope_head_dim"],
        qk_rope_head_dim=r.raw["qk_rope_head_dim"],
        v_head_dim=r.raw["v_head_dim"],
        intermediate_size=r.raw["intermediate_size"],
        rms_norm_eps=float(g("rms_norm_eps")),
        tie_word_embeddings=bool(r.raw.get("tie_word_embeddings", False)),
        attention_bias=bool(r.raw.get("attention_bias", False)),
        rope=read_rope(r),
        mlp_layer_types=mlp_layer_types(r, num_layers),
        moe=read_moe(r),
        indexer=read_indexer(r, num_layers),
        bos_token_id=r.raw.get("bos_token_id"),
        eos_token_ids=as_tuple(r.raw.get("eos_token_id")),
        max_position_embeddings=int(r.raw.get("max_position_embeddings", 4096)),
        num_nextn_predict_layers=int(r.raw.get("num_nextn_predict_layers", 0) or 0),
        sublayers=r.family.sublayers,
        latent_scale=latent_scale(r, q_lora),
        kda=read_kda(r, num_layers),
        provenance=r.log.freeze(),
    )
    if r.family.glm5_next:
        cfg = apply_glm5_next(r, cfg)
    check_model_config(cfg, r.source, r.field_sources)
    return cfg

"""The small frozen pieces a model configuration is composed of (rope, MoE, indexer, KDA, LongCat's latent scale)
and ConfigError. They depend on nothing else in config/, so the family readers (config/deepseek_v4.py,
config/glm5_next.py) build on them without importing config/model.py, which reads config.json with them."""

from __future__ import annotations

import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """A config that cannot define a model; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    dim: int
    theta: float
    interleaved: bool
    rope_type: str = "default"  # "default" | "yarn" | "none" (NoPE: the identity, cos 1 and sin 0)
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """Scale on cos/sin (YaRN); 1 for DeepSeek-V3 where mscale == mscale_all_dim."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class LatentScale:
    """LongCat-Flash's LoRA-rank scaling: q (nope and rope parts) x `q` = sqrt(hidden / q_lora_rank) and
    c_kv x `kv` = sqrt(hidden / kv_lora_rank) after kv_a_layernorm, before caching (transformers'
    LongcatFlashMLA). A scale that is a power of two is folded into the weight (q_b_proj, kv_a_layernorm):
    every product and partial sum is then scaled exactly, so the result is bit for bit the same; another
    is applied at run time in the reference's order (norm, then x scale), since folding would round."""

    q: float
    kv: float
    q_folded: bool
    kv_folded: bool


def power_of_two(x: float) -> bool:
    """Whether multiplying by x is exact in binary floating point (no rounding: only the exponent moves)."""
    m, _ = math.frexp(x)
    return m == 0.5


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str  # "softmax" | "sigmoid"
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # LongCat-Flash: zero-computation identity experts scored after the real ones (router indices
    # n_routed_experts .. n_routed_experts + zero_experts - 1); their output is weight x input
    zero_experts: int = 0

    @property
    def scored_experts(self) -> int:
        """The router's outputs: the real experts, then the identity experts."""
        return self.n_routed_experts + self.zero_experts


@dataclass(frozen=True)
class IndexerConfig:
    n_heads: int
    head_dim: int
    topk: int
    rope_interleaved: bool
    layer_types: tuple[str, ...]  # per layer: "full" (own indexer) | "shared" (reuse previous full layer)
    # GLM-5.3-Flash's pooled indexer (models/pooled_indexer.py): keys pooled over kpool tokens (config.json's
    # index_kpool); 0: the per-token indexer of DeepSeek-V3.2 / GLM-5
    kpool: int = 0


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (linear attention) layers: which layers, and their widths (config/families/kimi_linear.py)."""

    layers: tuple[int, ...]  # the KDA layers' indices; every other layer is MLA
    num_heads: int  # H
    head_dim: int  # d = dk = dv
    conv_kernel: int  # the causal depthwise short conv's width K (its state: the last K - 1 inputs)
    # the forget gate's lower bound b < 0 (GLM-5.3-Flash: g = b sigmoid(exp(A_log) (f + dt_bias))), or None
    # (Kimi-Linear: g = -exp(A_log) softplus(f + dt_bias), unbounded below)
    lower_bound: float | None = None

    @property
    def width(self) -> int:
        """H * d: the width of q, k and v each."""
        return self.num_heads * self.head_dim

"""The frozen pieces DeepSeek-V4's config is composed of (config/deepseek_v4.py DeepseekV4Config): the attention
shape, the compression, the two rope tables, the MoE and the hyper-connections (mHC, shared with GLM-5.3-Flash:
config/glm5_next.py). They build on nothing in config/ but model_parts.py's RopeConfig, so the V4 model's modules
and the GLM-5.3-Flash config take them without importing V4's config.json reader."""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config.model_parts import RopeConfig


@dataclass(frozen=True)
class V4AttentionShape:
    num_heads: int
    head_dim: int  # the one shared K=V head (512 in the released models)
    rope_dim: int  # trailing interleaved-rope dims of each head (64)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim


@dataclass(frozen=True)
class V4Compression:
    csa_ratio: int  # m: one CSA row per m tokens, pooled over 2m (overlapping windows)
    hca_ratio: int  # m': one HCA row per m' tokens (non-overlapping)
    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def ratio(self, kind: str) -> int:
        return {"csa": self.csa_ratio, "hca": self.hca_ratio}[kind]


@dataclass(frozen=True)
class V4Rope:
    """Two tables: `main` for sliding-only layers, `compress` (compress_rope_theta, YaRN) for CSA/HCA layers,
    their compressors and the indexer. Both interleaved on the trailing rope_dim dims."""

    main: RopeConfig
    compress: RopeConfig
    compress_attention_factor: float  # 1.0 unless a nested config sets or omits it (then transformers' rule)

    def of(self, kind: str) -> RopeConfig:
        return self.main if kind == "sliding" else self.compress


@dataclass(frozen=True)
class V4MoE:
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float  # gate <= limit, |up| <= limit, in routed and shared experts (as transformers)


@dataclass(frozen=True)
class V4HyperConnections:
    """mHC's settings (models/deepseek_v4/hyper.py), shared by DeepSeek-V4 and GLM-5.3-Flash."""

    hc_mult: int
    sinkhorn_iters: int
    eps: float
    # the final collapse of the N streams before the last norm: learned sigmoid weights (DeepSeek-V4's hc_head_*
    # tensors) or, False, their unweighted mean (GLM-5.3-Flash ships no head weights)
    learned_head: bool = True

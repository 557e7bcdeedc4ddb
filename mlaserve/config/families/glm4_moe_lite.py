"""GLM-4.7-Flash (glm4_moe_lite): V3 gating, dense/MoE layout from mlp_layer_types (else the first
layer dense). llama.cpp files it as deepseek2 (it reads back as deepseek_v3) but keeps its MTP layers."""

from __future__ import annotations

from mlaserve.config.families.family import Family, frozen_map
from mlaserve.config.families.tokenizers import GLM_PRE, GLM_SPECIALS

GLM4_MOE_LITE = Family(
    name="glm4_moe_lite",
    hf_architecture="Glm4MoeLiteForCausalLM",
    gguf_arch="deepseek2",
    defaults=frozen_map(
        dict(
            rms_norm_eps=1e-5,
            routed_scaling_factor=1.8,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            n_shared_experts=1,
            num_experts_per_tok=4,
            rope_interleave=True,
            q_lora_rank=768,
        )
    ),
    reads_mlp_layer_types=True,
    first_dense_layers=1,
    gguf_reads_back=False,
    gguf_keeps_mtp=True,
    gguf_nextn_key="if_kept",
    tokenizer_pre=GLM_PRE,
    tokenizer_specials=GLM_SPECIALS,
)

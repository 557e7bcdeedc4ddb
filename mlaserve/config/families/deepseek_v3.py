"""DeepSeek-V3 (also Kimi-K2, model_type kimi_k2): sigmoid router + e_score_correction_bias, group
score = sum of the top-2; rope_interleave from the config. llama.cpp arch deepseek2, MTP dropped."""

from __future__ import annotations

from mlaserve.config.families.family import Family, frozen_map
from mlaserve.config.families.tokenizers import DEEPSEEK_V3_PRE

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    gguf_arch="deepseek2",
    aliases=("kimi_k2",),  # transformers rewrites Kimi-K2's model_type to deepseek_v3
    defaults=frozen_map(
        dict(
            rms_norm_eps=1e-6,
            routed_scaling_factor=2.5,
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            n_shared_experts=1,
            first_k_dense_replace=3,
            rope_interleave=True,
            num_experts_per_tok=8,
            q_lora_rank=1536,
        )
    ),
    tokenizer_pre=DEEPSEEK_V3_PRE,
)

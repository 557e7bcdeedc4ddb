"""DeepSeek-V2 (and V2-Lite, Coder-V2): softmax router, greedy | group_limited_greedy (group score =
max), q_lora optional; llama.cpp arch deepseek2 (told apart from V3 by its softmax gating)."""

from __future__ import annotations

from mlaserve.config.families.family import Family, frozen_map
from mlaserve.config.families.tokenizers import DEEPSEEK_LLM_PRE

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    hf_architecture="DeepseekV2ForCausalLM",
    gguf_arch="deepseek2",
    defaults=frozen_map(
        dict(
            rms_norm_eps=1e-6,
            routed_scaling_factor=1.0,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
            norm_topk_prob=False,
            n_shared_experts=2,
            first_k_dense_replace=0,
            q_lora_rank=1536,
        )
    ),
    scoring_func="softmax",
    rope_rule="complex-pair rope",  # transformers' V2 has no rope_interleave: it always rotates complex pairs
    tokenizer_pre=DEEPSEEK_LLM_PRE,
)

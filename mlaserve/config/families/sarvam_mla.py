"""Sarvam-MLA (sarvam_mla, sarvam-105b): DeepSeek-V3 without a query latent (q_lora_rank None), one
expert group, one leading dense layer, under the legacy keys its original config was written with.
transformers has no model of its own for it (DeepseekV3ForCausalLM runs it; its config class,
configuration_sarvam_mla.py, translates the legacy keys below the same way). No llama.cpp arch of
its own: a deepseek2 GGUF reads back as deepseek_v3."""

from __future__ import annotations

from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3
from mlaserve.config.families.family import frozen_map

SARVAM_MLA = DEEPSEEK_V3.derive(
    "sarvam_mla",
    defaults=dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    legacy_keys=frozen_map(
        dict(
            num_experts="n_routed_experts",
            num_shared_experts="n_shared_experts",
            num_mtp_layers="num_nextn_predict_layers",
        )
    ),
    dropped_keys=frozen_map(
        dict(
            # the original config stores kv_lora_rank + qk_rope_head_dim there (vLLM's MLA row width)
            head_dim="legacy key, dropped as transformers does: the head dims come from qk_nope/qk_rope/v_head_dim",
            q_head_dim="legacy key, dropped as transformers does: it is qk_nope_head_dim + qk_rope_head_dim",
        )
    ),
    rope_type_aliases=frozen_map(dict(deepseek_yarn="yarn")),  # "the same as standard YaRN" (transformers)
    gguf_reads_back=False,
    tokenizer_pre=frozen_map(),
)

"""GLM-5 (glm_moe_dsa): a delta on DeepSeek-V3.2 -- other defaults (one expert group, eps 1e-5,
q_lora 2048, 32 indexer heads), an interleaved indexer rope, per-layer full/shared indexers stored in
GGUF, GLM's tokenizer conventions. llama.cpp arch glm-dsa."""

from __future__ import annotations

from mlaserve.config.families.deepseek_v32 import DEEPSEEK_V32
from mlaserve.config.families.tokenizers import GLM_PRE, GLM_SPECIALS

GLM_MOE_DSA = DEEPSEEK_V32.derive(
    "glm_moe_dsa",
    hf_architecture="GlmMoeDsaForCausalLM",
    gguf_arch="glm-dsa",
    defaults=dict(rms_norm_eps=1e-5, n_group=1, topk_group=1, q_lora_rank=2048, index_n_heads=32),
    indexer_rope_interleaved=True,
    gguf_indexer_types=True,  # transformers always has indexer_types for GLM-DSA, so llama.cpp writes them
    gguf_rope_dim_partial=True,  # GLM's converter scales by partial_rotary_factor (1.0 for GLM-5)
    tokenizer_pre=GLM_PRE,
    tokenizer_specials=GLM_SPECIALS,
)

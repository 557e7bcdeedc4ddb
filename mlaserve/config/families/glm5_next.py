"""GLM-5.3-Flash (glm5_next): a multimodal wrapper (transformers' Glm5NextForConditionalGeneration) whose
`text_config` is a glm5_next_text model (Glm5NextTextConfig; also read bare): KDA linear-attention layers with the
bounded ("safe") forget gate and NoPE MLA layers carrying GLM-5.3-Flash's pooled DSA indexer, a residual of mHC
streams, a dense-then-MoE schedule from `mlp_layer_types`, SwiGLU clamps (`swiglu_limit`).

Where the fields that are not DeepSeek-V3's are read: config/glm5_next.py (`read_glm5_next`: layer / MLP / indexer
schedules, KDA widths and bound, index_kpool, mHC, swiglu_limit, each with its source), applied by config/mla_reader/glm5_next.py.
Tensors: the text model's under `model.language_model.` (the loader's text part); the vision tower
(`model.visual.`) is skipped and reported by name and size. llama.cpp has no arch for it.
"""

from __future__ import annotations

from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3
from mlaserve.config.families.family import frozen_map

# transformers 5.24 Glm5NextTextConfig class defaults of the optional fields the reader falls back on
GLM5_NEXT_TEXT = DEEPSEEK_V3.derive(
    "glm5_next_text",
    hf_architecture="Glm5NextForConditionalGeneration",
    gguf_arch="",  # no llama.cpp arch
    gguf_reads_back=False,
    layer_kinds="mla_dsa",
    has_indexer=True,
    glm5_next=True,
    # the generic reader's schedule is replaced by read_glm5_next's (its class default: the first min(3, n) dense)
    reads_mlp_layer_types=True,
    first_dense_layers=0,
    nope="GLM-5.3-Flash's MLA is NoPE (qk_rope_head_dim 0: the cached row is the latent only)",
    # Glm5NextTextAttention sizes its heads by qk_nope_head_dim / v_head_dim and never reads head_dim (class default 0)
    dropped_keys={"head_dim": "unused by Glm5NextTextAttention (its widths are qk_nope_head_dim and v_head_dim)"},
    own_keys={"num_local_experts": "n_routed_experts"},  # Glm5NextTextConfig.attribute_map
    defaults=dict(
        rms_norm_eps=1e-5,
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        n_shared_experts=1,
        num_experts_per_tok=8,
        q_lora_rank=1536,
        index_topk=2048,
        index_head_dim=128,
        index_n_heads=32,
    ),
    # the checkpoint's mHC tensors (transformers' conversion mapping, as its save_pretrained writes them):
    # layers.N.hc_attn_fn -> layers.N.attn_hc.fn, and so for base, scale and the ffn side
    checkpoint_renames=((r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),),
    tokenizer_pre=frozen_map(),
    without=("rope_interleave", "first_k_dense_replace"),
)

GLM5_NEXT = GLM5_NEXT_TEXT.derive(
    "glm5_next",
    text_config=True,
    text_prefix="model.language_model.",
    text_served_prefix="model.",
    text_top_level=("lm_head.weight",),
    skipped_prefixes=("model.visual.",),
    tie_default=False,  # Glm5NextConfig.tie_word_embeddings
)

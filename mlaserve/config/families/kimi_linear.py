"""Kimi-Linear (kimi_linear, Kimi-Linear-48B-A3B): a stack of KDA linear-attention layers (Kimi Delta Attention,
a recurrent state per request) and NoPE MLA layers, with DeepSeek-V3's sigmoid + bias router.

What differs from deepseek_v3, and where it is read:
- which layers are KDA and which MLA: `layer_types` ("linear_attention" | "full_attention") or the checkpoint's
  `linear_attn_config.{kda_layers, full_attn_layers}` (1-indexed); a config with neither is refused (transformers
  falls back to a guess, every 4th layer MLA, which need not be the released layout). config/mla_reader/kimi_linear.py `read_kda`.
- the KDA widths: `linear_attn_config.{num_heads, head_dim, short_conv_kernel_size}` or the flat
  `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`.
- the MLA layers are NoPE: the "rope" slice of q and of the cached row is kept but never rotated (transformers'
  KimiLinearAttention applies no rotary embedding); the rope table is the identity (`nope` below).
- the dense/MoE layers: mlp_layer_types, else first_k_dense_replace (no class default is assumed for it).
- the checkpoint's config names (transformers' attribute_map) are read under the MLA reader's names, each recorded.
- the checkpoint's tensor names (`block_sparse_moe`, experts `w1`/`w3`/`w2`) are read as the MoE module's
  (`checkpoint_renames`, applied by loading/weights.py; errors name the checkpoint's tensor).
A llama.cpp `kimi-linear` GGUF is read back (gguf/read/config.py `_kda_fields`, gguf/read/mapping.py `_KDA`).
"""

from __future__ import annotations

from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3
from mlaserve.config.families.family import frozen_map

# transformers 5.24 KimiLinearConfig class defaults of the optional fields the reader falls back on
KIMI_LINEAR = DEEPSEEK_V3.derive(
    "kimi_linear",
    hf_architecture="KimiLinearForCausalLM",
    gguf_arch="kimi-linear",
    gguf_reads_back=True,
    reads_mlp_layer_types=True,
    kda=True,
    nope="transformers' KimiLinearAttention never rotates the k_rot slice (every released checkpoint is NoPE)",
    legacy_keys={
        "num_experts": "n_routed_experts",
        "num_local_experts": "n_routed_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "model_max_length": "max_position_embeddings",
    },
    checkpoint_renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.mlp\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ),
    defaults=dict(
        rms_norm_eps=1e-5,
        routed_scaling_factor=2.446,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        n_shared_experts=1,
        num_experts_per_tok=8,
        q_lora_rank=None,
        linear_num_heads=32,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
    ),
    tokenizer_pre=frozen_map(),
    # not attributes of transformers' class: first_k_dense_replace is a constructor keyword there (default 1),
    # so a config with neither mlp_layer_types nor first_k_dense_replace is refused, naming the key; no rope
    without=("rope_interleave", "first_k_dense_replace"),
)

"""DeepSeek-V3.2: DeepSeek-V3 plus the DSA lightning indexer (half-split indexer rope; the main MLA rope
is always interleaved). llama.cpp arch deepseek32, MTP layers kept."""

from __future__ import annotations

from mlaserve.config.families.deepseek_v3 import DEEPSEEK_V3

DEEPSEEK_V32 = DEEPSEEK_V3.derive(
    "deepseek_v32",
    hf_architecture="DeepseekV32ForCausalLM",
    gguf_arch="deepseek32",
    layer_kinds="mla_dsa",
    defaults=dict(index_topk=2048, index_head_dim=128, index_n_heads=64),
    without=("rope_interleave",),  # transformers' DeepseekV32Config has none: see rope_rule
    rope_rule="main MLA rope is always interleaved",
    reads_mlp_layer_types=True,
    has_indexer=True,
    gguf_keeps_mtp=True,
    gguf_nextn_key="if_set",
)

"""DeepSeek-V4 (Flash, Pro): not MLA. A shared K=V 512-d MQA head with a sliding window on every layer,
compressed KV pools (CSA with a lightning indexer, HCA), mHC residual streams, sqrt-softplus routing with
hash-routed first layers. Its config.json is read by config/deepseek_v4.py (reader "deepseek_v4"), not by
the MLA adapter; its layer kinds are declared there. llama.cpp arch deepseek4: read by gguf/read/deepseek_v4.py (not the MLA GGUF reader, hence gguf_reads_back=False)."""

from __future__ import annotations

from mlaserve.config.families.family import Family, frozen_map

# transformers 5.24 DeepseekV4Config class defaults of the optional fields the reader falls back on
# (tests/unit/test_families.py checks each against the class).
DEEPSEEK_V4 = Family(
    name="deepseek_v4",
    hf_architecture="DeepseekV4ForCausalLM",
    gguf_arch="deepseek4",
    reader="deepseek_v4",
    scoring_func="sqrtsoftplus",
    layer_kinds="deepseek_v4",  # attention_kind (config/layer_kinds.py) refuses it until the engine runs it
    gguf_reads_back=False,
    defaults=frozen_map(
        dict(
            rms_norm_eps=1e-6,
            routed_scaling_factor=1.5,
            num_experts_per_tok=6,
            n_shared_experts=1,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            swiglu_limit=10.0,
            sliding_window=128,
            o_groups=8,
            o_lora_rank=1024,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=512,
            num_nextn_predict_layers=1,
            head_dim=512,
            q_lora_rank=1024,
            max_position_embeddings=1048576,
        )
    ),
)

"""LongCat-Flash (longcat_flash): MLA decoder layers of two attention sublayers each (two latent rows per
layer per token), two dense MLPs and one shortcut MoE whose router is a softmax over the real experts plus
`zero_expert_num` zero-computation identity experts (output = weight x input), top-k on the scores plus
the correction bias, no renormalisation, x routed_scaling_factor. q and c_kv are scaled by
sqrt(hidden / rank) before caching (transformers' LongcatFlashMLA mla_scale_q_lora / mla_scale_kv_lora).
config.json names: num_layers (decoder layers; transformers derives num_hidden_layers = 2 x num_layers),
ffn_hidden_size, expert_ffn_hidden_size, moe_topk (transformers' attribute_map reads them as
intermediate_size, moe_intermediate_size, num_experts_per_tok). The rope always interleaves pairs
(apply_rotary_pos_emb_interleave) over head_dim, which must equal qk_rope_head_dim.
llama.cpp has no architecture for it (gguf-py's MODEL_ARCH_NAMES lists none): no GGUF is read or written.
The checkpoint's MTP layer (model.mtp.*) is skipped and reported, as transformers ignores it."""

from __future__ import annotations

from mlaserve.config.families.family import Family, frozen_map

LONGCAT_FLASH = Family(
    name="longcat_flash",
    hf_architecture="LongcatFlashForCausalLM",
    gguf_arch="",  # none in llama.cpp
    defaults=frozen_map(
        dict(
            rms_norm_eps=1e-5,
            routed_scaling_factor=6.0,
            zero_expert_num=256,
            num_experts_per_tok=12,
            q_lora_rank=1536,
        )
    ),
    scoring_func="softmax",
    default_theta=1e7,  # LongcatFlashConfig.default_theta
    rope_rule="apply_rotary_pos_emb_interleave in every attention sublayer",
    own_keys=frozen_map(
        dict(
            ffn_hidden_size="intermediate_size",
            expert_ffn_hidden_size="moe_intermediate_size",
            moe_topk="num_experts_per_tok",
        )
    ),
    first_dense_layers=0,  # every decoder layer has its shortcut MoE
    sublayers=2,
    zero_experts=True,
    skipped_tensor_prefixes=frozen_map({"model.mtp.": "the MTP layer (transformers ignores it too; not built)"}),
    gguf_reads_back=False,
    unsupported=frozen_map(
        dict(
            tensor_parallel_size="its sublayers, dense MLPs and identity experts are not split across ranks yet",
            quantization="the block holders (int8 / int4) know no identity experts",
            speculative="its MTP layer (model.mtp.*) is not built",
        )
    ),
)

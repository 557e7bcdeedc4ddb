"""Tiny random GLM-5.3-Flash models built with transformers' Glm5NextForConditionalGeneration (the independent
reference), seeded, saved by its save_pretrained (keys model.language_model.*, a small vision tower under
model.visual.* that the engine skips and reports).

Initialisation as tests/kimi_linear_models.py (every parameter at O(1) scale, A_log log U(0.05, 1) per head so a
KDA state carries across 64-token chunks; the reasons are written there). rms_norm_eps 1e-2, for the same reason
as its 1e-3 (the KDA output's gated RMSNorm amplifies fp32 rounding by up to eps^-1/2 where a head's o is nearly 0):
with 1e-3, transformers' own fp32 run of the 5-head pattern was 9.7e-6 from its float64 run at a 197-token prompt
(1.3e-5 with swiglu_limit 10), at the bound before the engine is measured; with 1e-2 it is 4.4e-6. Head counts are not powers of two (MLA 3 heads, KDA 3 or 5, index heads 3). index_topk 256: every
prompt here (<= 197 tokens) is inside it, where the engine runs the MLA layers dense (config/model.py _glm5_next).

The reference logits are the text model's run in float64 on the same weights (float64_copy): transformers' own fp32
run and ours are both held to it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_models import reinit_

TEXT = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=0,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=1,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
    index_n_heads=3,
    index_head_dim=8,
    index_topk=256,
    hc_mult=3,
    hc_sinkhorn_iters=5,
    swiglu_limit=1.5,  # small enough that the clamps bite on O(1) random activations
    pad_token_id=2,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    rms_norm_eps=1e-2,
)
K, M = "linear_attention", "indexed_attention"
SPECS = {
    # the released pattern's shape: three KDA layers, then MLA+DSA; dense then MoE; kpool 4 (the released value)
    "kda3_mla_kpool4": dict(
        num_hidden_layers=4,
        layer_types=[K, K, K, M],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=5,
        index_kpool=4,
    ),
    # MLA first, two MLA layers, kpool 2; MoE first then dense (the schedule read per layer, not as a prefix)
    "mla_first_kpool2": dict(
        num_hidden_layers=3,
        layer_types=[M, K, M],
        mlp_layer_types=["sparse", "dense", "sparse"],
        linear_num_heads=3,
        index_kpool=2,
    ),
}
# not in SPECS (run by one test only): a "shared" indexer layer right after a full one (the pattern transformers runs;
# after a KDA layer it raises, docs/GLM5_NEXT.md), and KDA layers whose indexer_types entry is "shared" (unread)
EXTRA = {
    "shared_after_full": dict(
        num_hidden_layers=4,
        layer_types=[K, M, M, K],
        indexer_types=["shared", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        linear_num_heads=3,
        index_kpool=4,
    ),
    # a "shared" MLA layer after KDA layers: transformers raises there, the engine reuses layer 0's selection
    # (docs/GLM5_NEXT.md; tests/models/test_glm5_next_shared_reuse.py reads the decision, no transformers run)
    "shared_after_kda": dict(
        num_hidden_layers=4,
        layer_types=[M, K, K, M],
        indexer_types=["full", "full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        linear_num_heads=3,
        index_kpool=4,
        index_topk=8,
    ),
}
# past index_topk (the pooled route selecting: prompts of ~100 tokens keep 4 of up to 25 pools), 8 index heads so
# that exact-zero score ties (every head's ReLU 0 for two pools at the cut) are rare; tests/models/test_glm5_next_sparse.py
SPARSE = {
    "sparse_kda3_kpool4": dict(SPECS["kda3_mla_kpool4"], index_topk=16, index_n_heads=8),
    "sparse_mla_first_kpool2": dict(SPECS["mla_first_kpool2"], index_topk=8, index_n_heads=8),
    "sparse_shared_after_full": dict(EXTRA["shared_after_full"], index_topk=12, index_n_heads=8),
}
VISION = dict(
    depth=1,
    hidden_size=16,
    num_heads=2,
    intermediate_size=16,
    out_hidden_size=48,
    projection_intermediate_size=16,
    patch_size=2,
    image_size=4,
    temporal_patch_size=1,
    spatial_merge_size=1,
)


def build_hf_glm5_next(spec: str, seed: int = 0):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    cfg = Glm5NextConfig(text_config=dict(TEXT) | (SPECS | EXTRA | SPARSE)[spec], vision_config=VISION)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    reinit_(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
    return model


def save_hf_glm5_next(spec: str, folder: Path, seed: int = 0):
    """-> the transformers model; its save_pretrained folder at `folder`."""
    model = build_hf_glm5_next(spec, seed)
    model.save_pretrained(folder)
    return model


def float64_copy(model):
    """The text model and lm_head in float64, experts by transformers' eager loop (grouped_mm has no float64)."""
    from transformers import Glm5NextForConditionalGeneration

    twin = Glm5NextForConditionalGeneration(model.config).eval()
    twin.load_state_dict(model.state_dict())
    if hasattr(twin, "set_experts_implementation"):
        twin.set_experts_implementation("eager")
    return twin.double()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one text-only pass (no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()

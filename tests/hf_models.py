"""Tiny random MLA models built with transformers (the independent reference), seeded.

Built the way ../shared/fixtures/MAKE.md (step 2) builds its fixtures: num_key_value_heads ==
num_attention_heads, then every parameter re-initialised at O(1) scale -- matrices N(0,1)/sqrt(fan_in),
norm weights 1 + 0.1 N(0,1), other vectors (correction bias, k_norm bias) 0.1 N(0,1) -- because
transformers' default init (zero bias, unit norms, tiny weights) hides routing and norm bugs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    vocab_size=256,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

SPECS: dict[str, tuple[str, dict]] = {
    "v2_qlora": (
        "deepseek_v2",
        dict(
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            n_shared_experts=2,
        ),
    ),
    "v2_noq": (
        "deepseek_v2",
        dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0),
    ),
    "v3_yarn": (
        "deepseek_v3",
        dict(
            first_k_dense_replace=1,
            max_position_embeddings=128,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
    ),
    "v3_tied": (
        "deepseek_v3",
        dict(
            first_k_dense_replace=2,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            num_nextn_predict_layers=0,
            tie_word_embeddings=True,
            rope_interleave=False,
        ),
    ),
    "v3_odd": (  # tensor parallel: 6 heads (3 per rank at TP=2), an odd vocabulary, attention biases
        "deepseek_v3",
        dict(
            num_attention_heads=6,
            num_key_value_heads=6,
            vocab_size=257,
            intermediate_size=96,
            moe_intermediate_size=24,
            attention_bias=True,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=0,
        ),
    ),
    "glm_lite": (
        "glm4_moe_lite",
        dict(
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            routed_scaling_factor=1.8,
        ),
    ),
    "v32": (
        "deepseek_v32",
        dict(first_k_dense_replace=1, n_group=2, topk_group=1, index_topk=16, index_n_heads=16, index_head_dim=32),
    ),
    "glm_dsa": (
        "glm_moe_dsa",
        dict(
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            index_topk=16,
            index_n_heads=16,
            index_head_dim=32,
        ),
    ),
    # Kimi-K2's layout (deepseek_v3: one expert group, sigmoid + bias, normalised top-k, its scaling
    # factor); hidden 72 / moe_intermediate 40 are not multiples of the FP8 tests' blocks (edge blocks).
    "kimi_k2": (
        "deepseek_v3",
        dict(
            hidden_size=72,
            intermediate_size=100,
            moe_intermediate_size=40,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.827,
            num_nextn_predict_layers=0,
        ),
    ),
    "glm_dsa_shared": (
        "glm_moe_dsa",
        dict(
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
            index_topk=16,
            index_n_heads=16,
            index_head_dim=32,
            indexer_types=["full", "shared", "full"],
        ),
    ),
}


def make_config(kind: str):
    from transformers import AutoConfig

    model_type, extra = SPECS[kind]
    kwargs = {**BASE, **extra}
    return AutoConfig.for_model(model_type, **kwargs)


def reinit_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
        ]:
            if p.dim() >= 2:
                std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_hf_model(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind), dtype=torch.float32, attn_implementation="eager")
    reinit_(model, seed)
    return model.eval()


def save_hf_model(kind: str, folder: Path, seed: int = 0):
    model = build_hf_model(kind, seed)
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("head_dim", None)  # real DeepSeek/GLM configs have none
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int, logits=hf_logits) -> list[int]:
    """transformers' greedy continuation by full recompute (the reference the engine's cached decode is held to):
    the whole sequence through `logits(model, ids)` ([len(ids), vocab], one pass, no cache) for every new token
    -> the n new tokens. `logits`: the family's own pass where it is not hf_logits' (its helper module's)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def random_ids(n: int, vocab: int = 256, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1000)
    return [0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()

"""Tiny random Kimi-Linear models built with transformers (the independent reference), seeded.

Every parameter re-initialised at O(1) scale as tests/hf_models.py reinit_ does, except A_log: log U(0.05, 1) per
head, so the per-token decay exp(-exp(A_log) softplus(.)) keeps some of the state across a 64-token chunk (the
HF init, log U(1, 16), forgets within a few tokens and would hide a state carried wrongly across chunks).
Head counts are not powers of two (MLA 3 heads, KDA 3 or 5 heads).

rms_norm_eps 1e-3 (a config value both sides read): the KDA output's gated RMSNorm divides each head's o by
sqrt(mean(o^2) + eps), and random weights make some head's o nearly 0 at some position (q nearly orthogonal to
the state: measured mean(o^2) 2.2e-7), where eps 1e-5 amplifies o's fp32 rounding 316x -- transformers' own fp32
run was then 2.6e-5 from its float64 run. eps 1e-3 caps that gain at 32, so fp32 rounding stays ~1e-6 .. 7e-6 and
the tests' 1e-5 bound measures the engine, not the conditioning of a random head.

The reference logits are transformers' run in float64 on the same weights (hf_logits of float64_copy): both fp32
runs, its and ours, are held to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_models import reinit_

BASE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    num_local_experts=6,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
    pad_token_id=2,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    rms_norm_eps=1e-3,
)
K, M = "linear_attention", "full_attention"
# the engine's own config.json form (mlaserve's kimi_linear reader), not transformers' (BASE): the config tests'
# model, and the base the snapshot-memory test widens to Kimi-Linear-48B's per-layer shape
RAW_CONFIG = dict(
    model_type="kimi_linear",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_experts=4,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_renormalize=True,
    num_expert_group=1,
    topk_group=1,
    model_max_length=4096,
    first_k_dense_replace=1,
    layer_types=[K, M, K, K],
    linear_num_heads=3,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
)
SPECS = {
    # the released pattern's shape: KDA layers around one MLA layer; q_proj without a LoRA; 5 KDA heads
    "kda_mla_kda": dict(num_hidden_layers=4, layer_types=[K, M, K, K], linear_num_heads=5, q_lora_rank=None),
    # an MLA layer first and the q LoRA path; the pattern as the checkpoint writes it (linear_attn_config)
    "mla_first": dict(
        num_hidden_layers=3,
        layer_types=[M, K, K],
        linear_num_heads=3,
        q_lora_rank=24,
        first_k_dense_replace=2,
        checkpoint_pattern=True,
    ),
}


def build_hf_kimi(spec: str, seed: int = 0):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kw = dict(BASE) | {k: v for k, v in SPECS[spec].items() if k != "checkpoint_pattern"}
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**kw)).eval()
    reinit_(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
    return model


def save_hf_kimi(spec: str, folder: Path, seed: int = 0):
    """-> the transformers model; its save_pretrained folder (checkpoint names) at `folder`. A spec with
    checkpoint_pattern writes the layer pattern as the released config.json does: linear_attn_config's 1-indexed
    kda_layers / full_attn_layers (and its widths), no layer_types."""
    model = build_hf_kimi(spec, seed)
    model.save_pretrained(folder)
    if SPECS[spec].get("checkpoint_pattern"):
        path = folder / "config.json"
        raw = json.loads(path.read_text())
        types = raw.pop("layer_types")
        raw["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == K],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == M],
            "num_heads": raw.pop("linear_num_heads"),
            "head_dim": raw.pop("linear_head_dim"),
            "short_conv_kernel_size": raw.pop("linear_conv_kernel_dim"),
        }
        path.write_text(json.dumps(raw, indent=2))
    return model


def float64_copy(model):
    """The same weights in float64 (the reference run): experts by transformers' eager loop (grouped_mm has no
    float64)."""
    from transformers import KimiLinearForCausalLM

    cfg = model.config
    twin = KimiLinearForCausalLM(cfg).eval()
    twin.load_state_dict(model.state_dict())
    if hasattr(twin, "set_experts_implementation"):
        twin.set_experts_implementation("eager")
    return twin.double()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one pass (no cache) through `model` (a float64_copy for the reference)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()

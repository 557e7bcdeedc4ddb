"""Tiny random DeepSeek-V4 models built with transformers (the independent reference), seeded.

Every parameter re-initialised at O(1) scale as tests/hf_models.py does (matrices N(0,1)/sqrt(fan_in), norm
weights and mHC scales 1 + 0.1 N(0,1), other vectors 0.1 N(0,1)), the router's correction bias 0.1 N(0,1)
and tid2eid a random distinct-expert row per token: transformers' init (zero sinks, zero position bias,
zero tid2eid, unit scales) would hide routing, pooling and sink bugs.

Ratios are small (CSA 4, HCA 8) so that windows close inside short prompts; index_topk is below the number
of CSA rows of the longer prompts so the indexer's choice matters; 8 indexer heads keep exact-zero score
ties away (with 2 heads, relu zeroes tie and top-k breaks ties by shape).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=3,
    head_dim=24,
    q_lora_rank=16,
    partial_rotary_factor=8 / 24,
    n_routed_experts=6,
    num_experts_per_tok=2,
    sliding_window=6,
    o_groups=3,
    o_lora_rank=8,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    compress_rates={CSA: 4, HCA: 8},
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)

SPECS: dict[str, dict] = {
    # every kind, hc_mult 4, one hash layer, odd head count, YaRN on the compress table
    "all_kinds": dict(
        num_hidden_layers=4,
        layer_types=[SW, CSA, HCA, CSA],
        num_hash_layers=1,
        hc_mult=4,
        rope_scaling=YARN,
        swiglu_limit=0.5,  # binds often at O(1) activations: the clamps are exercised
        hc_sinkhorn_iters=3,  # not yet converged: the iteration count shows in the logits (at 20 it does not)
    ),
    # hc_mult 2, learned routing only, 5 heads in 5 groups, odd hidden size, plain compress rope
    "hc2_learned": dict(
        num_hidden_layers=3,
        hidden_size=35,
        num_attention_heads=5,
        o_groups=5,
        layer_types=[HCA, CSA, SW],
        mlp_layer_types=["moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=5,
        index_topk=2,
        compress_rates={CSA: 3, HCA: 6},  # odd ratios
    ),
    # hc_mult 3, hash routing on every layer, kinds from the legacy compress_ratios (4 -> CSA), 3 groups of 3 heads
    "hc3_hash": dict(
        num_hidden_layers=3,
        num_attention_heads=9,
        head_dim=16,
        partial_rotary_factor=0.5,
        o_groups=3,
        compress_ratios=[4, 0, 4],
        mlp_layer_types=["hash_moe"] * 3,
        hc_mult=3,
        n_routed_experts=5,
        num_experts_per_tok=3,
        sliding_window=7,
        index_head_dim=12,
        rope_scaling=YARN,
        swiglu_limit=0.3,
    ),
}


def make_v4_config(kind: str, **overrides):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**BASE, **SPECS[kind], **overrides})


def largest_ratio(kind: str) -> int:
    cfg = make_v4_config(kind)
    rates = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
    return max(rates[t] for t in cfg.layer_types if t != SW)


def reinit_v4_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


def build_hf_v4(kind: str, seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    # eager experts: the grouped-GEMM default needs 16-byte-aligned rows (an odd hidden size is not)
    model = DeepseekV4ForCausalLM(make_v4_config(kind, experts_implementation="eager", **overrides)).float()
    reinit_v4_(model, seed)
    return model.eval()


def save_hf_v4(kind: str, folder: Path, seed: int = 0, **overrides):
    model = build_hf_v4(kind, seed, **overrides)
    model.save_pretrained(folder)
    return model, json.loads((Path(folder) / "config.json").read_text())


def hf_v4_logits(model, ids: list[int]) -> torch.Tensor:
    """One pass, no cache: transformers' stateless compressor path."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def ours_from_hf(hf_model):
    """Our model from transformers' in-memory one, through the project's config reader and name mapping."""
    from mlaserve.config.deepseek_v4 import DeepseekV4Config
    from mlaserve.loading.deepseek_v4 import load_into
    from mlaserve.models.deepseek_v4.model import DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_hf(json.loads(hf_model.config.to_json_string()))
    model = DeepseekV4ForCausalLM(cfg)
    tensors = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    load_into(model, _DictSource(tensors))
    return model.eval()


class _DictSource:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def where(self, name: str) -> str:
        return "state_dict"


def dequantized_folder(src: Path, dst: Path, block: int) -> None:
    """A quantized V4 folder (the project's writer) -> a float folder of the same model, by the plain reference
    dequantizers (fp8_block, fp4_group): what transformers runs as the reference of the quantized forms."""
    from safetensors.torch import load_file, save_file

    from mlaserve.quant import fp4_group, fp8_block

    stored = load_file(src / "model.safetensors")
    deq = {}
    for name, t in stored.items():
        if name.endswith(".weight_scale_inv"):
            continue
        scale = stored.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is None:
            deq[name] = t
        elif t.dtype == torch.int8:  # two e2m1 codes per byte
            deq[name] = fp4_group.dequantize_reference(t, scale.float())
        else:
            deq[name] = fp8_block.dequantize_reference(t, scale.float(), block)
    dst.mkdir()
    save_file(deq, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))

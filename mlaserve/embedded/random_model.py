"""A tiny random-weight MLA model (DeepSeek-V3 layout) with a byte-level tokenizer.

Used as the default model until a trained one ships, and by benchmarks that need a model of a
given shape. Weights are O(1)-scale (N(0,1)/sqrt(fan_in)) so activations and logits are meaningful.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    vocab_size=259,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=0,
)


def hub_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face Hub names (experts one tensor each)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.contiguous()
    return out


def write_random_model(folder: Path, config: dict | None = None, seed: int = 0) -> None:
    from mlaserve.config.model import ModelConfig
    from mlaserve.models.deepseek import MLAForCausalLM

    raw = dict(config or TINY)
    cfg = ModelConfig.from_hf(raw)
    torch.manual_seed(seed)
    model = MLAForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hub_state_dict(model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    if raw["vocab_size"] == TINY["vocab_size"]:
        write_byte_tokenizer(folder)


def write_byte_tokenizer(folder: Path) -> None:
    """Byte-level BPE without merges: 3 specials then the 256 byte symbols (vocab 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2}
    vocab.update({ch: 3 + i for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True}, indent=2)
    )

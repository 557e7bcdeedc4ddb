"""Tiny Kimi-Linear GGUF files in llama.cpp's `kimi-linear` layout, written with the `gguf` package from a
transformers model's save_pretrained folder.

The names and metadata keys are gguf-py's (constants.py MODEL_ARCH.KIMI_LINEAR, Keys.KDA / Keys.SSM) as llama.cpp's
converter (convert_hf_to_gguf.py, KimiLinearModel) writes them:
  q/k/v_proj -> attn_q/k/v; q/k/v_conv1d [W, 1, K] -> ssm_conv1d_q/k/v stored [1, W, 1, K]; f_a/f_b_proj ->
  ssm_f_a/b; g_a/g_b_proj -> ssm_g_a/b; b_proj -> ssm_beta; A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias;
  o_norm -> ssm_norm; o_proj -> attn_output; MLA as deepseek2 (kv_b_proj split into attn_k_b [H, L, n] and
  attn_v_b [H, v, L]); the routed experts stacked per layer.
  attention.head_count_kv per layer: 0 at the KDA layers (llama.cpp's recurrent-layer marker);
  attention.head_count per layer (the KDA layers' and the MLA layers' heads differ here on purpose; the converter
  writes one number, tested by rewriting the key);
  kda.head_dim, ssm.conv_kernel, key_length_mla / value_length_mla, kv_lora_rank, rope.dimension_count (the
  never-rotated slice of NoPE MLA).
Projections whose rows are whole 32-value blocks are Q8_0; norms, convs, ssm_a, dt_bias, the router and the
embedding F32. `write_kimi_gguf` returns the weights as the `gguf` package dequantizes the bytes written, under the
folder's names: the independent reference the tests load into transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from hf_models import reinit_
from kimi_linear_models import BASE, K, M

ARCH = "kimi-linear"
# widths whose matrices are whole Q8_0 blocks (32 values) along every input dimension
BLOCK_DIMS = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    linear_head_dim=32,
    linear_num_heads=5,
    num_hidden_layers=4,
    layer_types=[K, M, K, K],
    q_lora_rank=None,
)

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q.weight",
    "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.g_a_proj.weight": "ssm_g_a.weight",
    "self_attn.g_b_proj.weight": "ssm_g_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.A_log": "ssm_a",
    "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "block_sparse_moe.gate_proj.weight": "ffn_gate.weight",
    "block_sparse_moe.up_proj.weight": "ffn_up.weight",
    "block_sparse_moe.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_STACK = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FLOAT = re.compile(r"(norm|conv1d|ssm_a$|ssm_dt|ffn_gate_inp|exp_probs_b|token_embd)")


def save_block_kimi(folder: Path, seed: int = 0, **overrides):
    """A random Kimi-Linear (tests/kimi_linear_models.py's init: O(1) weights, A_log = log U(0.05, 1)) with
    BLOCK_DIMS widths, saved at `folder`; -> the transformers model."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**(dict(BASE) | BLOCK_DIMS | overrides))).eval()
    reinit_(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
    model.save_pretrained(folder)
    return model


def default_type(gguf_name: str, shape: tuple[int, ...]):
    import gguf

    T = gguf.GGMLQuantizationType
    if _FLOAT.search(gguf_name) or len(shape) < 2 or shape[-1] % 32:
        return T.F32
    return T.Q8_0


def write_kimi_gguf(
    folder: Path,
    out: Path,
    choose_type=default_type,
    drop_tensors: tuple[str, ...] = (),
    drop_keys: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """save_pretrained folder -> `out` (a kimi-linear GGUF); returns the dequantized weights under the folder's
    names (kv_b_proj rejoined from the dequantized k_b / v_b, A_log = log(-ssm_a)). drop_tensors / drop_keys /
    reshape (a GGUF tensor written with another shape) break the file on purpose."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    saved = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(str(out), arch=ARCH)
    _metadata(w, cfg)
    _tokenizer(w, cfg["vocab_size"])
    for key in drop_keys:
        w.kv_data[0].pop(key)

    def add(g: str, arr: np.ndarray) -> np.ndarray:
        """Write one tensor; -> its values as the gguf package decodes them."""
        if g in drop_tensors:
            return arr
        if reshape and g in reshape:
            arr = np.resize(arr, reshape[g]).astype(np.float32)
        qtype = choose_type(g, arr.shape)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, arr)
            return arr
        data = gguf.quants.quantize(arr, qtype)
        w.add_tensor(g, data, raw_dtype=qtype)
        return gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(arr.shape)

    deq: dict[str, torch.Tensor] = {}
    stacks: dict[str, list] = {}
    H, n, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in saved.items():
        arr = t.float().numpy()
        e = _EXPERT.match(name)
        if e:
            stacks.setdefault(f"blk.{e[1]}.{_STACK[e[3]]}", []).append((int(e[2]), name, arr))
            continue
        if name in _GLOBAL:
            deq[name] = torch.from_numpy(add(_GLOBAL[name], arr).copy())
            continue
        m = _LAYER_RE.match(name)
        pre, suf = f"blk.{m[1]}.", m[2]
        if suf == "self_attn.kv_b_proj.weight":  # split per head as llama.cpp's deepseek2 converter does
            per_head = arr.reshape(H, n + v, -1)
            k_b = add(pre + "attn_k_b.weight", np.ascontiguousarray(per_head[:, :n].transpose(0, 2, 1)))
            v_b = add(pre + "attn_v_b.weight", np.ascontiguousarray(per_head[:, n:]))
            joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(arr.shape)
            deq[name] = torch.from_numpy(joined.copy())
        elif suf == "self_attn.A_log":  # the converter stores A = -exp(A_log)
            a = add(pre + "ssm_a", -np.exp(arr.astype(np.float64)).astype(np.float32))
            deq[name] = torch.from_numpy(np.log(-a.astype(np.float64)).astype(np.float32))
        elif suf.endswith("_conv1d.weight"):  # [W, 1, K] -> [1, W, 1, K]
            add(pre + _LAYER[suf], arr.reshape(1, arr.shape[0], 1, arr.shape[2]))
            deq[name] = t.float().clone()
        else:
            deq[name] = torch.from_numpy(add(pre + _LAYER[suf], arr).copy())
    for g, items in stacks.items():
        items.sort()
        values = add(g, np.stack([a for _, _, a in items]))
        for e, name, _ in items:
            deq[name] = torch.from_numpy(values[e].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def _metadata(w, cfg: dict) -> None:
    """The keys llama.cpp's KimiLinearModel.set_gguf_parameters (and DeepseekV2's MLA keys) write."""
    a, types = ARCH, cfg["layer_types"]
    kda = [t == K for t in types]
    w.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{a}.context_length", 4096)
    w.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{a}.vocab_size", cfg["vocab_size"])
    w.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    heads = [cfg["linear_num_heads"] if k else cfg["num_attention_heads"] for k in kda]
    w.add_array(f"{a}.attention.head_count", heads)
    w.add_array(f"{a}.attention.head_count_kv", [0 if k else 1 for k in kda])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32(f"{a}.attention.kv_lora_rank", cfg["kv_lora_rank"])
    w.add_uint32(f"{a}.attention.key_length", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_uint32(f"{a}.attention.value_length", cfg["kv_lora_rank"])
    w.add_uint32(f"{a}.attention.key_length_mla", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_uint32(f"{a}.attention.value_length_mla", cfg["v_head_dim"])
    w.add_uint32(f"{a}.rope.dimension_count", cfg["qk_rope_head_dim"])
    w.add_uint32(f"{a}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32(f"{a}.kda.head_dim", cfg["linear_head_dim"])
    w.add_uint32(f"{a}.leading_dense_block_count", cfg["mlp_layer_types"].index("sparse"))
    w.add_uint32(f"{a}.expert_count", cfg["num_experts"])
    w.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_token"])
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_uint32(f"{a}.expert_shared_count", cfg["num_shared_experts"])
    w.add_uint32(f"{a}.expert_group_count", cfg["num_expert_group"])
    w.add_uint32(f"{a}.expert_group_used_count", cfg["topk_group"])
    w.add_float32(f"{a}.expert_weights_scale", cfg["routed_scaling_factor"])
    w.add_bool(f"{a}.expert_weights_norm", cfg["moe_renormalize"])
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid + e_score_correction_bias


def _tokenizer(w, vocab: int) -> None:
    """A byte-level token list of `vocab` single characters, no merges (the engine needs a tokenizer to start)."""
    chars = [chr(33 + i) if i < 94 else chr(161 + i - 94) for i in range(vocab)]  # byte-level's printable chars
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(chars)
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(2)


def write_dequantized_folder(folder: Path, deq: dict[str, torch.Tensor], dst: Path) -> None:
    """The model as a float folder holding the GGUF's dequantized weights (transformers' input)."""
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in deq.items()}, dst / "model.safetensors")

"""Write tiny DeepSeek-V4 GGUF files in llama.cpp's `deepseek4` layout (this module holds no tests).

The names and metadata keys follow llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV4Model:
_map_dsv4_tensor_name, set_gguf_parameters) and gguf-py's TENSOR_NAMES for MODEL_ARCH.DEEPSEEK4, written
here from that source, not from the project's reader. The bytes are made by the `gguf` package's own
quantizers (Q8_0, MXFP4, ...), and the reference weights are that package's dequantization of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

# the release's name (after save_pretrained's `model.` and renames are undone) -> llama.cpp's GGUF name
_ROOT = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
_LAYER = {
    "hc_attn_fn": "hc_attn_fn.weight",
    "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_base": "hc_ffn_base.weight",
    "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
_EXPERT_STACK = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")

# V4 dims small enough to test and wide enough for 32-value blocks on every matrix (Q8_0, MXFP4)
BLOCK_DIMS = dict(head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_lora_rank=32, moe_intermediate_size=32)


def release_name(saved: str) -> str:
    """transformers' save_pretrained name -> the release's (as tests/models/test_deepseek_v4_weights.py)."""
    name = re.sub(r"^model\.", "", saved)
    name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
    name = re.sub(r"^hc_head\.hc_", "hc_head_", name)
    return re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", name)


def default_type(gguf_name: str, ndim: int):
    """The test file's choice, as llama.cpp's converter makes for a V4 release: routed experts MXFP4 (repacked
    FP4), attention and shared-expert matrices Q8_0 (the release's FP8), norms / hc_* / sinks / ape F32."""
    import gguf

    T = gguf.GGMLQuantizationType
    if gguf_name.endswith("_exps.weight"):
        return T.MXFP4
    if ndim >= 2 and not re.search(r"(hc_|ape|tid2eid|ffn_gate_inp)", gguf_name):
        return T.Q8_0
    return T.F32


def write_v4_gguf(
    saved_folder: Path,
    out: Path,
    choose_type=default_type,
    drop_tensors: tuple[str, ...] = (),
    drop_keys: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
    set_keys: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """A save_pretrained folder of a float V4 model -> `out` (a deepseek4 GGUF). Returns the folder's tensors
    (save_pretrained names) as the `gguf` package dequantizes the bytes written: the reference weights.
    drop_tensors / drop_keys / reshape / set_keys / extra_tensors (F32) change the file on purpose (the tests of
    the reader's errors and of its nextn skipping)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((saved_folder / "config.json").read_text())
    saved = load_file(saved_folder / "model.safetensors")
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), arch="deepseek4")
    _metadata(w, cfg, n)
    for key in drop_keys:
        w.kv_data[0].pop(key)
    for key, (value, vtype) in (set_keys or {}).items():
        w.kv_data[0].pop(key, None)
        sub = gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None
        w.add_key_value(key, value, vtype, sub_type=sub)

    deq: dict[str, torch.Tensor] = {}
    stacks: dict[str, list] = {}
    for name, t in saved.items():
        rel = release_name(name)
        e = _EXPERT.match(rel)
        if e:
            stacks.setdefault(f"blk.{e[1]}.{_EXPERT_STACK[e[3]]}", []).append((int(e[2]), name, t))
            continue
        if rel in _ROOT:
            g = _ROOT[rel]
        else:
            m = _LAYER_RE.match(rel)
            g = f"blk.{m[1]}.{_LAYER[m[2]]}"
        deq[name] = _add(w, g, t, choose_type, drop_tensors, reshape, deq_shape=tuple(t.shape))
    for g, items in stacks.items():
        items.sort()
        stack = torch.stack([t for _, _, t in items])
        values = _add(w, g, stack, choose_type, drop_tensors, reshape, deq_shape=tuple(stack.shape))
        for e, name, _ in items:
            deq[name] = values[e] if values is not None else None
    for g, arr in (extra_tensors or {}).items():
        w.add_tensor(g, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def _add(w, g: str, t: torch.Tensor, choose_type, drop, reshape, deq_shape):
    import gguf

    if g in drop:
        return t
    if g.endswith("tid2eid.weight"):
        w.add_tensor(g, t.to(torch.int32).numpy())  # I32, as the converter writes it
        return t
    arr = t.float().numpy()
    if reshape and g in reshape:
        arr = np.resize(arr, reshape[g]).astype(np.float32)
    qtype = choose_type(g, arr.ndim)
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(g, arr)
        return torch.from_numpy(arr.copy()).reshape(deq_shape) if arr.shape == deq_shape else t
    try:
        data = gguf.quants.quantize(arr, qtype)
    except NotImplementedError:  # the package has no K-quant quantizer: random valid blocks (their own values)
        data = random_blocks(arr.shape, qtype, seed=len(g))
    w.add_tensor(g, data, raw_dtype=qtype)
    values = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    return values.reshape(deq_shape) if tuple(values.shape) == deq_shape else t


def _metadata(w, cfg: dict, n: int) -> None:
    """The keys llama.cpp's DeepseekV4Model.set_gguf_parameters (and TextModel's) writes."""
    types, rates = cfg["layer_types"], cfg["compress_rates"]
    ratio = {"sliding_attention": 0, **rates}
    rope = cfg["rope_parameters"]["compress"]
    a = "deepseek4"
    w.add_uint32(f"{a}.block_count", n)
    w.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{a}.vocab_size", cfg["vocab_size"])
    w.add_uint32(f"{a}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", 1)
    w.add_uint32(f"{a}.attention.key_length", cfg["head_dim"])
    w.add_uint32(f"{a}.attention.value_length", cfg["head_dim"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", cfg["rope_parameters"]["main"]["rope_theta"])
    w.add_uint32(f"{a}.rope.dimension_count", int(cfg["head_dim"] * cfg["partial_rotary_factor"]))
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", rope["factor"])
    w.add_uint32(f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
    w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", rope["beta_slow"])
    w.add_uint32(f"{a}.attention.q_lora_rank", cfg["q_lora_rank"])
    w.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])
    w.add_uint32(f"{a}.expert_count", cfg["n_routed_experts"])
    w.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_tok"])
    # TextModel's: from config.json's scoring_func ("sqrtsoftplus" -> gguf-py's ExpertGatingFuncType 4); llama.cpp's
    # deepseek4 loader requires the key
    w.add_uint32(f"{a}.expert_gating_func", {"sqrtsoftplus": 4}[cfg["scoring_func"]])
    w.add_uint32(f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_uint32(f"{a}.expert_shared_count", cfg["n_shared_experts"])
    w.add_float32(f"{a}.expert_weights_scale", cfg["routed_scaling_factor"])
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(cfg["swiglu_limit"])] * n)
    w.add_array(f"{a}.swiglu_clamp_shexp", [float(cfg["swiglu_limit"])] * n)
    w.add_uint32(f"{a}.attention.indexer.head_count", cfg["index_n_heads"])
    w.add_uint32(f"{a}.attention.indexer.key_length", cfg["index_head_dim"])
    w.add_uint32(f"{a}.attention.indexer.top_k", cfg["index_topk"])
    w.add_uint32(f"{a}.attention.output_group_count", cfg["o_groups"])
    w.add_uint32(f"{a}.attention.output_lora_rank", cfg["o_lora_rank"])
    w.add_array(f"{a}.attention.compress_ratios", [int(ratio[t]) for t in types])
    w.add_float32(f"{a}.attention.compress_rope_freq_base", rope["rope_theta"])
    w.add_uint32(f"{a}.hyper_connection.count", cfg["hc_mult"])
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", cfg["hc_sinkhorn_iters"])
    w.add_float32(f"{a}.hyper_connection.epsilon", cfg["hc_eps"])
    mlp = cfg.get("mlp_layer_types")
    w.add_uint32(f"{a}.hash_layer_count", mlp.count("hash_moe") if mlp else cfg["num_hash_layers"])
    w.add_uint32(f"{a}.embedding_length_out", cfg["hidden_size"] * cfg["hc_mult"])  # DeepseekV4Model's last key


def write_dequantized_folder(saved_folder: Path, deq: dict[str, torch.Tensor], dst: Path) -> None:
    """The same model as a float folder holding the GGUF's dequantized weights (what transformers runs)."""
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((saved_folder / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in deq.items()}, dst / "model.safetensors")


def random_blocks(shape: tuple[int, ...], qtype, seed: int) -> np.ndarray:
    """Random bytes of a K-quant tensor (any code and sub-scale byte is valid) with fp16 super-block scales
    d, dmin set small enough for O(1) weights: the weights are what the `gguf` package decodes them to."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = np.array([2e-3, 1e-3], dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin first
        raw[:, :4] = scales
    else:
        raise NotImplementedError(f"random blocks of {qtype.name}")
    return raw.reshape(*shape[:-1], shape[-1] // block * size)

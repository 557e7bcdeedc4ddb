"""GGUF metadata -> a config.json-like dict in Hugging Face naming, with each field's source
(a GGUF key, llama.cpp's default for an absent optional key, or a derivation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mlaserve.config import families
from mlaserve.config.families import Family
from mlaserve.gguf.read.file import GGUFError, GGUFFile

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*
ABSENT = "llama.cpp default (key absent)"

Provenance = dict[str, tuple[Any, str]]

# =============================================================================================
# config derivation


def _decimal(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(x)))


class _Meta:
    """Reads ``<arch>.*`` keys, recording provenance; missing required keys raise GGUFError."""

    def __init__(self, gf: GGUFFile, arch: str):
        self.gf, self.arch, self.prov = gf, arch, {}

    def key(self, suffix: str) -> str:
        return suffix if suffix.startswith(("general.", "tokenizer.")) else f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.gf.metadata

    def raw(self, suffix: str, default: Any = None) -> Any:
        return self.gf.metadata.get(self.key(suffix), default)

    def req(self, fld: str, suffix: str, conv: Callable = int) -> Any:
        k = self.key(suffix)
        if k not in self.gf.metadata:
            raise GGUFError(
                f"{self.gf.path}: required metadata key '{k}' is missing (the model is undefined without it: {fld})"
            )
        return self.put(fld, self._convert(k, conv), f"gguf:{k}")

    def opt(self, fld: str, suffix: str, default: Any, conv: Callable = int, note: str = "") -> Any:
        k = self.key(suffix)
        if k in self.gf.metadata:
            return self.put(fld, self._convert(k, conv), f"gguf:{k}")
        return self.put(fld, default, f"{ABSENT}: '{k}'{note}")

    def _convert(self, k: str, conv: Callable) -> Any:
        value = self.gf.metadata[k]
        if conv in (int, _scalar) and not _is_int(value) and not (conv is _scalar and isinstance(value, list)):
            raise GGUFError(f"{self.gf.path}: metadata key '{k}' must be an integer, got {value!r}")
        try:
            return conv(value)
        except (TypeError, ValueError) as e:  # GGUFError is a ValueError
            raise GGUFError(f"{self.gf.path}: metadata key '{k}' = {self.gf.metadata[k]!r}: {e}") from None

    def put(self, fld: str, value: Any, source: str) -> Any:
        self.prov[fld] = (value, source)
        return value


def _bool(x: Any) -> bool:
    """A GGUF bool (or the 0 / 1 some writers store); a string such as "false" is an error, not True."""
    if isinstance(x, bool) or (_is_int(x) and x in (0, 1)):
        return bool(x)
    raise ValueError(f"must be a bool, got {x!r} ({type(x).__name__})")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _scalar(x: Any) -> int:
    """Per-layer keys may be arrays; MLA models use one value for all layers."""
    if isinstance(x, list):
        if len(set(x)) != 1:
            raise ValueError(f"per-layer values differ ({x}); only uniform values are supported")
        if not x or not _is_int(x[0]):
            raise ValueError(f"per-layer values must be integers, got {x}")
        x = x[0]
    return int(x)


def _family(m: _Meta) -> Family:
    """The family a file of this arch reads as; where llama.cpp files several under one arch
    (deepseek2: V2's softmax router, V3's sigmoid + bias), its gating tells them apart."""
    readers = families.gguf_readers(m.arch)
    if len(readers) == 1:
        return _put_family(m, readers[0], f"gguf:general.architecture={m.arch}")
    gating = m.raw("expert_gating_func")
    has_bias = any(n.endswith(".exp_probs_b.bias") for n in m.gf.tensors)
    if gating == 2 or has_bias:
        why = "expert_gating_func=sigmoid" if gating == 2 else "exp_probs_b tensors present"
        family = next(f for f in readers if f.scoring_func == "sigmoid")
        return _put_family(m, family, f"gguf:general.architecture={m.arch} + {why}")
    return _put_family(
        m,
        next(f for f in readers if f.scoring_func == "softmax"),
        f"gguf:general.architecture={m.arch} + softmax gating (expert_gating_func 1 or absent), no exp_probs_b",
    )


def _put_family(m: _Meta, family: Family, source: str) -> Family:
    m.put("model_type", family.name, source)
    return family


def _kda_fields(m: _Meta, cfg: dict) -> None:
    """kimi-linear: the layer pattern and the KDA widths (llama.cpp's KimiLinearModel.set_gguf_parameters).

    attention.head_count_kv   per-layer array: 0 marks a KDA (recurrent) layer, as llama.cpp's loader reads it
                              (recurrent_layer_arr = n_head_kv(il) == 0); any other value an MLA layer
    attention.head_count      scalar (both kinds have that many heads) or per layer (each layer's own kind)
    kda.head_dim              linear_head_dim;  ssm.conv_kernel  linear_conv_kernel_dim
    """
    n = cfg["num_hidden_layers"]
    kv_key = m.key("attention.head_count_kv")
    kv = m.raw("attention.head_count_kv")
    if not isinstance(kv, list) or any(not _is_int(x) for x in kv) or len(kv) < n:
        raise GGUFError(
            f"{m.gf.path}: metadata key '{kv_key}' must be an array of {n} integers (0 marks a KDA layer), got {kv!r}"
        )
    types = ["linear_attention" if x == 0 else "full_attention" for x in kv[:n]]
    cfg["layer_types"] = m.put("layer_types", types, f"gguf:{kv_key} (0 = KDA layer)")
    heads_key = m.key("attention.head_count")
    heads = m.raw("attention.head_count")
    if heads is None:
        raise GGUFError(f"{m.gf.path}: required metadata key '{heads_key}' is missing (the heads of every layer)")
    per_layer = heads[:n] if isinstance(heads, list) else [heads] * n
    if len(per_layer) < n or any(not _is_int(x) for x in per_layer):
        raise GGUFError(f"{m.gf.path}: metadata key '{heads_key}' must be an integer or {n} integers, got {heads!r}")
    for kind, fld in (("linear_attention", "linear_num_heads"), ("full_attention", "num_attention_heads")):
        got = sorted({h for h, t in zip(per_layer, types) if t == kind})
        if len(got) > 1:
            raise GGUFError(f"{m.gf.path}: metadata key '{heads_key}' = {heads!r}: {kind} layers differ ({got})")
        if got:
            cfg[fld] = m.put(fld, got[0], f"gguf:{heads_key} at the {kind} layers")
    if "num_attention_heads" not in cfg:  # no MLA layer: the MLA widths still describe the (unused) config
        cfg["num_attention_heads"] = m.put("num_attention_heads", per_layer[0], f"gguf:{heads_key}")
    if "linear_num_heads" not in cfg:  # no KDA layer
        cfg["linear_num_heads"] = m.put("linear_num_heads", cfg["num_attention_heads"], f"gguf:{heads_key}")
    cfg["linear_head_dim"] = m.req("linear_head_dim", "kda.head_dim")
    cfg["linear_conv_kernel_dim"] = m.req("linear_conv_kernel_dim", "ssm.conv_kernel")


def _kimi_linear_router(m: _Meta, cfg: dict) -> None:
    """llama.cpp's converter (KimiLinearModel) writes neither expert_weights_norm nor expert_gating_func: its
    kimi-linear graph renormalizes the top-k weights always (build_moe_ffn norm_w = true) and the model routes by
    sigmoid + exp_probs_b. An absent key takes those, not the deepseek2 defaults (no renormalization, softmax)."""
    if not m.has("expert_weights_norm"):
        cfg["norm_topk_prob"] = m.put(
            "norm_topk_prob", True, f"{ABSENT}: '{m.key('expert_weights_norm')}' -> llama.cpp {m.arch} graph (norm_w)"
        )
    if not m.has("expert_gating_func"):
        cfg["scoring_func"] = m.put(
            "scoring_func", "sigmoid", f"{ABSENT}: '{m.key('expert_gating_func')}' -> {m.arch}: sigmoid + exp_probs_b"
        )
        cfg["topk_method"] = m.put("topk_method", "noaux_tc", "derived (not stored in GGUF): sigmoid + exp_probs_b")


def _attention_fields(m: _Meta, cfg: dict) -> None:
    cfg["hidden_size"] = m.req("hidden_size", "embedding_length")
    if "num_attention_heads" not in cfg:  # kimi-linear: read per layer kind by _kda_fields
        cfg["num_attention_heads"] = m.req("num_attention_heads", "attention.head_count", _scalar)
    cfg["num_key_value_heads"] = m.put(
        "num_key_value_heads",
        cfg["num_attention_heads"],
        f"derived: = num_attention_heads (MLA; gguf:{m.key('attention.head_count_kv')}=1 describes the latent cache)",
    )
    cfg["kv_lora_rank"] = m.req("kv_lora_rank", "attention.kv_lora_rank")
    q_key, q_lora = m.key("attention.q_lora_rank"), m.raw("attention.q_lora_rank")
    if q_lora:
        cfg["q_lora_rank"] = m.put("q_lora_rank", int(q_lora), f"gguf:{q_key}")
    else:  # llama.cpp writes no key (or 0) for models with a plain q_proj (attn_q)
        src = f"{ABSENT}: '{q_key}'" if q_lora is None else f"gguf:{q_key}=0"
        cfg["q_lora_rank"] = m.put("q_lora_rank", None, f"{src} -> no query LoRA (tensor attn_q)")
    cfg["qk_rope_head_dim"] = m.req("qk_rope_head_dim", "rope.dimension_count")
    _head_dims(m, cfg)


def _head_dims(m: _Meta, cfg: dict) -> None:
    # key_length/value_length describe llama.cpp's compressed cache (L+r, L) since the MLA
    # split; the real head sizes are key_length_mla/value_length_mla.  Older files (fused
    # attn_kv_b) have no *_mla keys and key_length/value_length are the real head sizes.
    k_key = "attention.key_length_mla" if m.has("attention.key_length_mla") else "attention.key_length"
    v_key = "attention.value_length_mla" if m.has("attention.value_length_mla") else "attention.value_length"
    qk = m.req("qk_head_dim", k_key)
    rope = cfg["qk_rope_head_dim"]
    if qk <= rope:
        raise GGUFError(f"{m.gf.path}: '{m.key(k_key)}'={qk} must exceed rope.dimension_count={rope}")
    cfg["qk_nope_head_dim"] = m.put(
        "qk_nope_head_dim", qk - rope, f"derived: gguf:{m.key(k_key)} - gguf:{m.key('rope.dimension_count')}"
    )
    cfg["qk_head_dim"] = qk
    cfg["v_head_dim"] = m.req("v_head_dim", v_key)


def _moe_fields(m: _Meta, cfg: dict) -> None:
    cfg["first_k_dense_replace"] = m.req("first_k_dense_replace", "leading_dense_block_count")
    dense_needed = cfg["first_k_dense_replace"] > 0
    if dense_needed:
        cfg["intermediate_size"] = m.req("intermediate_size", "feed_forward_length", _scalar)
    else:
        cfg["intermediate_size"] = m.opt("intermediate_size", "feed_forward_length", None, _scalar)
    cfg["moe_intermediate_size"] = m.req("moe_intermediate_size", "expert_feed_forward_length")
    cfg["n_routed_experts"] = m.req("n_routed_experts", "expert_count")
    cfg["num_experts_per_tok"] = m.req("num_experts_per_tok", "expert_used_count")
    cfg["n_shared_experts"] = m.req("n_shared_experts", "expert_shared_count")
    cfg["n_group"] = m.opt("n_group", "expert_group_count", None, note=" -> no group-limited routing")
    cfg["topk_group"] = m.opt("topk_group", "expert_group_used_count", None, note=" -> no group-limited routing")
    cfg["routed_scaling_factor"] = m.opt("routed_scaling_factor", "expert_weights_scale", 1.0, _decimal)
    cfg["norm_topk_prob"] = m.opt("norm_topk_prob", "expert_weights_norm", False, _bool)
    _gating(m, cfg)


def _check_dense_layers(m: _Meta, k: int, n_layers: int) -> None:
    """leading_dense_block_count against the tensors: layers [0, k) are dense (no expert router
    blk.N.ffn_gate_inp), layer k has one. A wrong count would otherwise surface as a missing
    tensor of the kind the count implies."""
    if not any(f"blk.{i}.ffn_gate_inp.weight" in m.gf.tensors for i in range(n_layers)):
        return  # no router at all: the expert fields and the tensors will say what is missing
    first_moe = next(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in m.gf.tensors)
    if first_moe != min(k, n_layers):
        raise GGUFError(
            f"{m.gf.path}: '{m.key('leading_dense_block_count')}'={k} but the first layer with experts "
            f"(tensor blk.{first_moe}.ffn_gate_inp.weight) is layer {first_moe}: the key should be {first_moe}"
        )


def _gating(m: _Meta, cfg: dict) -> None:
    gf_key = m.key("expert_gating_func")
    g = m.raw("expert_gating_func")
    if g is None:
        cfg["scoring_func"] = m.put("scoring_func", "softmax", f"{ABSENT}: '{gf_key}' -> softmax")
    elif g in GATING_FUNCS:
        cfg["scoring_func"] = m.put("scoring_func", GATING_FUNCS[g], f"gguf:{gf_key}={g}")
    else:
        raise GGUFError(f"{m.gf.path}: '{gf_key}'={g} is not a known expert gating function (1 softmax, 2 sigmoid)")
    if cfg["scoring_func"] == "sigmoid":
        method, why = "noaux_tc", "sigmoid scoring + e_score_correction_bias"
    elif (cfg["n_group"] or 1) > 1:
        method, why = "group_limited_greedy", "softmax scoring with expert groups"
    else:
        method, why = "greedy", "softmax scoring, no expert groups"
    cfg["topk_method"] = m.put("topk_method", method, f"derived (not stored in GGUF): {why}")


def _rope_fields(m: _Meta, cfg: dict, family: Family) -> None:
    theta = m.opt("rope_parameters.rope_theta", "rope.freq_base", 10000.0, _decimal)
    kind = m.raw("rope.scaling.type", "none")
    rp: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind == "yarn":
        rp.update(_yarn(m))
    elif kind == "linear":
        rp.update(rope_type="linear", factor=m.req("rope_parameters.factor", "rope.scaling.factor", _decimal))
    elif kind != "none":
        raise GGUFError(f"{m.gf.path}: unsupported '{m.key('rope.scaling.type')}'={kind!r}")
    cfg["rope_parameters"] = m.put("rope_parameters", rp, f"gguf:{m.key('rope.*')} (see rope_parameters.* entries)")
    cfg["max_position_embeddings"] = m.req("max_position_embeddings", "context_length")
    if family.rope_rule is None:
        # The family reads rope_interleave from config.json, which GGUF does not keep; llama.cpp's
        # graph uses ggml's "NORM" rope = adjacent pairs = HF rope_interleave
        cfg["rope_interleave"] = m.put("rope_interleave", True, f"llama.cpp {m.arch} graph (interleaved RoPE)")


def _yarn(m: _Meta) -> dict[str, Any]:
    out = {
        "rope_type": "yarn",
        "factor": m.req("rope_parameters.factor", "rope.scaling.factor", _decimal),
        "original_max_position_embeddings": m.req(
            "rope_parameters.original_max_position_embeddings", "rope.scaling.original_context_length"
        ),
        "beta_fast": m.opt("rope_parameters.beta_fast", "rope.scaling.yarn_beta_fast", 32.0, _decimal),
        "beta_slow": m.opt("rope_parameters.beta_slow", "rope.scaling.yarn_beta_slow", 1.0, _decimal),
    }
    if m.has("rope.scaling.yarn_attn_factor"):
        out["attention_factor"] = m.req("rope_parameters.attention_factor", "rope.scaling.yarn_attn_factor", _decimal)
    key = m.key("rope.scaling.yarn_log_multiplier")
    if key in m.gf.metadata:
        # The converter writes yarn_log_multiplier = 0.1 * mscale_all_dim for deepseek2-family
        # files (a legacy convention, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); invert it exactly.
        mad = float(f"{float(np.float32(m.gf.metadata[key])) / 0.1:.7g}")
        out["mscale_all_dim"] = m.put("rope_parameters.mscale_all_dim", mad, f"derived: gguf:{key} / 0.1")
        # mscale itself is not stored: llama.cpp applies no separate cos/sin magnitude, which in
        # HF terms is mscale == mscale_all_dim (attention_factor 1, as in DeepSeek-V3's config).
        out["mscale"] = m.put(
            "rope_parameters.mscale",
            mad,
            "derived: = mscale_all_dim (not stored; llama.cpp's deepseek2 graph implies it)",
        )
    return out


def _token_ids(m: _Meta, cfg: dict) -> None:
    md = m.gf.metadata
    bos = md.get("tokenizer.ggml.bos_token_id")
    cfg["bos_token_id"] = m.put(
        "bos_token_id",
        bos,
        "gguf:tokenizer.ggml.bos_token_id" if bos is not None else f"{ABSENT}: 'tokenizer.ggml.bos_token_id'",
    )
    keys = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
    ids = [md[k] for k in keys if md.get(k) is not None]
    ids = list(dict.fromkeys(ids))  # HF lists every stop token; keep eos, eot, eom order
    eos = None if not ids else ids[0] if len(ids) == 1 else ids
    cfg["eos_token_id"] = m.put(
        "eos_token_id",
        eos,
        "gguf:" + " + ".join(k for k in keys if k in md) if ids else f"{ABSENT}: 'tokenizer.ggml.eos_token_id'",
    )
    pad = md.get("tokenizer.ggml.padding_token_id")
    cfg["pad_token_id"] = m.put(
        "pad_token_id",
        pad,
        "gguf:tokenizer.ggml.padding_token_id" if pad is not None else f"{ABSENT}: 'tokenizer.ggml.padding_token_id'",
    )


def vocab_size_field(m: _Meta, cfg: dict) -> None:
    """cfg["vocab_size"]: the metadata key, else the rows of token_embd.weight (each source recorded)."""
    if m.has("vocab_size"):
        cfg["vocab_size"] = m.req("vocab_size", "vocab_size")
    elif "token_embd.weight" in m.gf.tensors:
        rows = m.gf.tensors["token_embd.weight"].shape[0]
        cfg["vocab_size"] = m.put("vocab_size", rows, "derived: rows of tensor token_embd.weight")
    else:
        raise GGUFError(f"{m.gf.path}: neither '{m.key('vocab_size')}' nor tensor token_embd.weight is present")


def _vocab_fields(m: _Meta, cfg: dict) -> None:
    vocab_size_field(m, cfg)
    tied = "output.weight" not in m.gf.tensors
    cfg["tie_word_embeddings"] = m.put(
        "tie_word_embeddings", tied, "derived: tensor output.weight " + ("absent" if tied else "present")
    )


def _dsa_fields(m: _Meta, cfg: dict, n_layers: int, family: Family) -> None:
    cfg["index_topk"] = m.req("index_topk", "attention.indexer.top_k")
    cfg["index_n_heads"] = m.req("index_n_heads", "attention.indexer.head_count")
    cfg["index_head_dim"] = m.req("index_head_dim", "attention.indexer.key_length")
    if family.gguf_indexer_types:
        types = m.raw("attention.indexer.types")
        if types is None:
            m.put("indexer_types", ["full"] * n_layers, f"{ABSENT}: '{m.key('attention.indexer.types')}' -> all full")
        else:
            m.put(
                "indexer_types",
                ["full" if t else "shared" for t in types[:n_layers]],
                f"gguf:{m.key('attention.indexer.types')}",
            )
        cfg["indexer_types"] = m.prov["indexer_types"][0]


def derive_hf_config(gf: GGUFFile) -> tuple[dict[str, Any], Provenance]:
    """GGUF metadata -> (HF config dict, provenance)."""
    arch = gf.metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{gf.path}: required metadata key 'general.architecture' is missing")
    if not families.gguf_readers(arch):
        raise GGUFError(
            f"{gf.path}: general.architecture={arch!r} is not an MLA architecture "
            f"this loader supports ({', '.join(families.gguf_arches())})"
        )
    m = _Meta(gf, arch)
    family = _family(m)
    cfg: dict[str, Any] = {"model_type": family.name}
    cfg["architectures"] = m.put("architectures", [family.hf_architecture], "derived: from model_type")
    blocks = m.req("block_count", "block_count")
    nextn = m.opt("num_nextn_predict_layers", "nextn_predict_layers", 0)
    cfg["num_hidden_layers"] = m.put(
        "num_hidden_layers", blocks - nextn, f"derived: gguf:{m.key('block_count')} - nextn_predict_layers"
    )
    cfg["num_nextn_predict_layers"] = nextn
    if family.kda:
        _kda_fields(m, cfg)  # before the MLA fields: the per-layer head_count names both kinds' heads
    _attention_fields(m, cfg)
    _moe_fields(m, cfg)
    if family.kda:
        _kimi_linear_router(m, cfg)
    _check_dense_layers(m, cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    cfg["rms_norm_eps"] = m.req("rms_norm_eps", "attention.layer_norm_rms_epsilon", _decimal)
    cfg["hidden_act"] = m.put("hidden_act", "silu", "llama.cpp MLA graphs (SwiGLU experts, fixed)")
    if family.kda:  # NoPE MLA: rope.dimension_count is the width of the cached, never rotated slice
        cfg["max_position_embeddings"] = m.req("max_position_embeddings", "context_length")
    else:
        _rope_fields(m, cfg, family)
    _vocab_fields(m, cfg)
    _token_ids(m, cfg)
    if family.has_indexer:
        _dsa_fields(m, cfg, cfg["num_hidden_layers"], family)
    return cfg, m.prov

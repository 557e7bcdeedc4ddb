"""A DeepSeek-V4 GGUF's metadata (llama.cpp's `deepseek4` keys) as the V4 model's config, each value's GGUF key
in provenance (gguf/read/deepseek_v4.py reads the tensors against the model this config builds).

Metadata -> config.json-like dict (transformers' deepseek_v4 names), each value's GGUF key in provenance:
  attention.compress_ratios   per layer: 0 sliding only; 4 CSA (llama.cpp's graph gives exactly the layers of
                              ratio 4 an indexer); any other ratio HCA. The kinds' source is this key.
  hyper_connection.count      hc_mult; llama.cpp's V4 graph requires 4: another value is read (our model runs
                              any) and the provenance says llama.cpp would refuse the file
  hash_layer_count            the first N layers route by tid2eid
  swiglu_clamp_exp / _shexp   one limit per layer; V4 has one swiglu_limit, so every entry must agree
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import Setting
from mlaserve.gguf.read.config import ABSENT, Provenance, _bool, _decimal, _Meta, vocab_size_field
from mlaserve.gguf.read.file import GGUFError, GGUFFile

ARCH = "deepseek4"
LLAMA_CPP_HC_MULT = 4  # llama.cpp's deepseek4 graph refuses any other hyper_connection.count
CSA_RATIO = 4  # llama.cpp: the layers of compress ratio 4 carry the lightning indexer (CSA)
SQRT_SOFTPLUS = 4  # expert_gating_func: gguf-py's ExpertGatingFuncType.SQRTSOFTPLUS


def _f32(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"must be a number, got {x!r} ({type(x).__name__})")
    return _decimal(x)


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise ValueError(f"must be a string, got {x!r} ({type(x).__name__})")
    return x


def _ints(x: Any) -> list[int]:
    if not isinstance(x, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in x):
        raise ValueError(f"must be an array of integers, got {x!r}")
    return list(x)


def _floats(x: Any) -> list[float]:
    if not isinstance(x, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in x):
        raise ValueError(f"must be an array of numbers, got {x!r}")
    return [_decimal(v) for v in x]


def _one(m: _Meta, fld: str, values: list[float], key: str, n: int) -> float:
    """A per-layer array that V4's config keeps as one value: every layer's entry must agree."""
    if len(values) < n or len(set(values[:n])) != 1:
        raise GGUFError(
            f"{m.gf.path}: metadata key '{m.key(key)}' = {values}: DeepSeek-V4 has one {fld} for all "
            f"{n} layers (the array must have {n} equal entries)"
        )
    return values[0]


def derive_v4_config(gf: GGUFFile) -> tuple[dict[str, Any], Provenance]:
    """deepseek4 metadata -> (config.json-like dict in transformers' deepseek_v4 names, provenance)."""
    arch = gf.metadata.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{gf.path}: general.architecture={arch!r}, expected {ARCH!r}")
    m = _Meta(gf, arch)
    cfg: dict[str, Any] = {"model_type": m.put("model_type", "deepseek_v4", f"gguf:general.architecture={arch}")}
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    blocks = m.req("block_count", "block_count")
    nextn = m.opt("num_nextn_predict_layers", "nextn_predict_layers", 0)
    n = m.put("num_hidden_layers", blocks - nextn, f"derived: gguf:{m.key('block_count')} - nextn_predict_layers")
    if n < 1:
        raise GGUFError(f"{gf.path}: '{m.key('block_count')}'={blocks} leaves no layer after {nextn} nextn layer(s)")
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = n, nextn
    cfg["hidden_size"] = m.req("hidden_size", "embedding_length")
    cfg["max_position_embeddings"] = m.req("max_position_embeddings", "context_length")
    cfg["num_attention_heads"] = m.req("num_attention_heads", "attention.head_count")
    kv = m.req("num_key_value_heads", "attention.head_count_kv")
    if kv != 1:
        raise GGUFError(f"{gf.path}: '{m.key('attention.head_count_kv')}'={kv}: DeepSeek-V4 has one shared K=V head")
    cfg["num_key_value_heads"] = 1
    cfg["head_dim"] = m.req("head_dim", "attention.key_length")
    v_len = m.req("value_length", "attention.value_length")
    if v_len != cfg["head_dim"]:
        raise GGUFError(
            f"{gf.path}: '{m.key('attention.value_length')}'={v_len} differs from key_length={cfg['head_dim']} "
            "(V4's one head is both key and value)"
        )
    cfg["qk_rope_head_dim"] = m.req("qk_rope_head_dim", "rope.dimension_count")
    cfg["q_lora_rank"] = m.req("q_lora_rank", "attention.q_lora_rank")
    cfg["o_groups"] = m.req("o_groups", "attention.output_group_count")
    cfg["o_lora_rank"] = m.req("o_lora_rank", "attention.output_lora_rank")
    cfg["sliding_window"] = m.req("sliding_window", "attention.sliding_window")
    cfg["rms_norm_eps"] = m.req("rms_norm_eps", "attention.layer_norm_rms_epsilon", _f32)
    cfg["index_n_heads"] = m.req("index_n_heads", "attention.indexer.head_count")
    cfg["index_head_dim"] = m.req("index_head_dim", "attention.indexer.key_length")
    cfg["index_topk"] = m.req("index_topk", "attention.indexer.top_k")
    _layer_kinds(m, cfg, n)
    _hyper_connections(m, cfg)
    _moe(m, cfg, n)
    _rope(m, cfg)
    _vocab(m, cfg)
    _unread(m)
    return cfg, m.prov


def _unread(m: _Meta) -> None:
    """Every `deepseek4.*` key this reader does not read is listed too (value and "not read"), so a key a newer
    converter adds shows in `inspect` instead of passing unseen."""
    read = {src.split()[0].removeprefix("gguf:") for _, src in m.prov.values() if src.startswith("gguf:")}
    read |= {src.split("'")[1] for _, src in m.prov.values() if src.startswith(ABSENT)}
    for key, value in m.gf.metadata.items():
        if key.startswith(f"{m.arch}.") and key not in read:
            m.put(key, value, f"gguf:{key} present; not read (no DeepSeek-V4 config field)")


def _layer_kinds(m: _Meta, cfg: dict, n: int) -> None:
    key = m.key("attention.compress_ratios")
    ratios = m.req("compress_ratios", "attention.compress_ratios", _ints)
    if len(ratios) < n or any(r < 0 for r in ratios):
        raise GGUFError(f"{m.gf.path}: metadata key '{key}' = {ratios}: expected {n} ratios >= 0 (one per layer)")
    ratios = ratios[:n]  # llama.cpp writes block_count entries; the nextn layers' are not main layers
    hca = sorted({r for r in ratios if r not in (0, CSA_RATIO)})
    if len(hca) > 1:
        raise GGUFError(
            f"{m.gf.path}: metadata key '{key}' = {ratios} has several HCA ratios {hca}; DeepSeek-V4 has one "
            "(compress_rates.heavily_compressed_attention)"
        )
    names = {0: "sliding_attention", CSA_RATIO: "compressed_sparse_attention"}
    cfg["layer_types"] = [names.get(r, "heavily_compressed_attention") for r in ratios]
    m.put(
        "layer_types",
        cfg["layer_types"],
        f"gguf:{key} (0 sliding, {CSA_RATIO} CSA with indexer as llama.cpp's graph, other ratios HCA)",
    )
    rates = {"compressed_sparse_attention": CSA_RATIO}
    if hca:
        rates["heavily_compressed_attention"] = hca[0]
    cfg["compress_rates"] = m.put("compress_rates", rates, f"gguf:{key}")
    cfg["compress_rope_theta"] = m.req("compress_rope_theta", "attention.compress_rope_freq_base", _f32)


def _hyper_connections(m: _Meta, cfg: dict) -> None:
    hc = cfg["hc_mult"] = m.req("hc_mult", "hyper_connection.count")
    if hc != LLAMA_CPP_HC_MULT:
        key = m.key("hyper_connection.count")
        m.put(
            "hc_mult",
            hc,
            f"gguf:{key} (llama.cpp's deepseek4 graph requires {LLAMA_CPP_HC_MULT}: it refuses this file)",
        )
    cfg["hc_sinkhorn_iters"] = m.req("hc_sinkhorn_iters", "hyper_connection.sinkhorn_iterations")
    cfg["hc_eps"] = m.req("hc_eps", "hyper_connection.epsilon", _f32)
    # the streams' width (llama.cpp's converter writes it; its loader derives the same from the two keys)
    width = m.opt("hc_stream_width", "embedding_length_out", cfg["hidden_size"] * hc)
    if width != cfg["hidden_size"] * hc:
        raise GGUFError(
            f"{m.gf.path}: '{m.key('embedding_length_out')}'={width} is not embedding_length x "
            f"hyper_connection.count = {cfg['hidden_size']} x {hc}"
        )


def _moe(m: _Meta, cfg: dict, n: int) -> None:
    cfg["n_routed_experts"] = m.req("n_routed_experts", "expert_count")
    cfg["num_experts_per_tok"] = m.req("num_experts_per_tok", "expert_used_count")
    cfg["n_shared_experts"] = m.req("n_shared_experts", "expert_shared_count")
    cfg["moe_intermediate_size"] = m.req("moe_intermediate_size", "expert_feed_forward_length")
    cfg["routed_scaling_factor"] = m.req("routed_scaling_factor", "expert_weights_scale", _f32)
    # recorded under the key's own name: the config's norm_topk_prob is "not read" (V4 always renormalises)
    norm = m.opt("expert_weights_norm", "expert_weights_norm", True, _bool)
    if not norm:
        raise GGUFError(
            f"{m.gf.path}: '{m.key('expert_weights_norm')}'=false: DeepSeek-V4's router always renormalises its "
            "top-k (transformers' DeepseekV4TopKRouter); a file that says otherwise is not this model"
        )
    gating = m.raw("expert_gating_func")
    if gating is not None and gating != SQRT_SOFTPLUS:
        raise GGUFError(
            f"{m.gf.path}: '{m.key('expert_gating_func')}'={gating}: DeepSeek-V4 routes by sqrt-softplus "
            f"({SQRT_SOFTPLUS}; llama.cpp's deepseek4 loader refuses any other value too)"
        )
    m.put(
        "expert_gating_func",
        gating,
        f"gguf:{m.key('expert_gating_func')} (sqrt-softplus)"
        if gating is not None
        else f"{ABSENT}: '{m.key('expert_gating_func')}' (V4 routes by sqrt-softplus; llama.cpp requires the key)",
    )
    cfg["num_hash_layers"] = m.req("num_hash_layers", "hash_layer_count")
    exp = m.req("swiglu_limit", "swiglu_clamp_exp", _floats)
    sh = m.opt("swiglu_clamp_shexp", "swiglu_clamp_shexp", exp, _floats)
    limit = _one(m, "swiglu_limit", exp, "swiglu_clamp_exp", n)
    if _one(m, "swiglu_limit", sh, "swiglu_clamp_shexp", n) != limit:
        raise GGUFError(
            f"{m.gf.path}: '{m.key('swiglu_clamp_shexp')}' ({sh[0]}) differs from '{m.key('swiglu_clamp_exp')}' "
            f"({limit}): DeepSeek-V4 clamps the routed and shared experts at one swiglu_limit"
        )
    cfg["swiglu_limit"] = m.put("swiglu_limit", limit, f"gguf:{m.key('swiglu_clamp_exp')} (all {n} layers equal)")


def _rope(m: _Meta, cfg: dict) -> None:
    cfg["rope_theta"] = m.req("rope_theta", "rope.freq_base", _f32)
    kind = m.opt("rope.scaling.type", "rope.scaling.type", "none", _str)
    if kind == "none":
        return
    if kind != "yarn":
        raise GGUFError(f"{m.gf.path}: '{m.key('rope.scaling.type')}'={kind!r}: V4's compress table is YaRN or plain")
    # llama.cpp: the compressed layers' table (compress_rope_freq_base) takes YaRN; the sliding layers' does not
    cfg["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": m.req("rope_scaling.factor", "rope.scaling.factor", _f32),
        "original_max_position_embeddings": m.req(
            "rope_scaling.original_max_position_embeddings", "rope.scaling.original_context_length"
        ),
        "beta_fast": m.opt("rope_scaling.beta_fast", "rope.scaling.yarn_beta_fast", 32.0, _f32),
        "beta_slow": m.opt("rope_scaling.beta_slow", "rope.scaling.yarn_beta_slow", 1.0, _f32),
    }


def _vocab(m: _Meta, cfg: dict) -> None:
    vocab_size_field(m, cfg)
    cfg["tie_word_embeddings"] = False
    md = m.gf.metadata
    for fld, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = md.get(key)
        if value is not None:
            cfg[fld] = m.put(fld, value, f"gguf:{key}")


# the config reader's names for what this module derives from one GGUF key
_ALIASES = {
    "layer_kinds": "layer_types",
    "mlp_layer_types": "num_hash_layers",
    "rope_dim": "qk_rope_head_dim",
    "rope": "rope_theta",
}


def v4_config(path: Path, cfg: dict, prov: Provenance) -> DeepseekV4Config:
    """The model config, each field's source its GGUF key (not the dict this reader made of them)."""
    try:
        v4 = DeepseekV4Config.from_hf(cfg, source=path.name)
    except ConfigError as e:
        raise GGUFError(f"{path}: the deepseek4 metadata does not make a DeepSeek-V4 config: {e}") from None
    gguf = {name: src for name, (_, src) in prov.items()}
    gguf |= {ours: gguf[key] for ours, key in _ALIASES.items() if key in gguf}
    settings = tuple(Setting(s.name, s.value, gguf.get(s.name, s.source)) for s in v4.provenance)
    extra = tuple(Setting(k, v, src) for k, (v, src) in prov.items() if k not in {s.name for s in settings})
    return dataclasses.replace(
        v4, layer_kinds_source=f"gguf:{ARCH}.attention.compress_ratios", provenance=settings + extra
    )

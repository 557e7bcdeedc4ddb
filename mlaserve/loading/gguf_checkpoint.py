"""Load an MLA model (DeepSeek-V2/V3/V3.2, GLM-5) from a llama.cpp GGUF file, in HF terms.

Notation (per layer): H heads, L = kv_lora_rank (latent width), n = qk_nope_head_dim,
r = qk_rope_head_dim, v = v_head_dim, E routed experts.  Torch shapes are outermost first
(= reversed ggml ne).  The HF projection ``kv_b_proj`` [H*(n+v), L] decompresses the latent
c: per head, rows [k_nope (n); v (v)].  llama.cpp splits it for the absorbed ("MQA") path into
    attn_k_b  torch [H, L, n]  (= the k rows of each head, *transposed*)
    attn_v_b  torch [H, v, L]
so that   q_lat[h] = k_b[h] @ q_nope[h]   (score = q_lat . c)   and   o[h] = v_b[h] @ (P c).

`load_gguf(path)` returns a `GGUFCheckpoint` with
  * ``hf_config``   a config.json-like dict in Hugging Face naming, ``provenance`` saying where
    each field came from (a GGUF key, a llama.cpp default for an absent optional key, or a
    derivation);
  * ``tensors``     HF Hub checkpoint names -> float32 tensors, dequantized lazily on ``get``
    (per-expert tensors are slices of the stacked ``ffn_*_exps``; kv_b_proj is rebuilt);
  * ``tokenizer``   the ``tokenizer.ggml.*`` data and ``build_tokenizer()`` (a `tokenizers`
    byte-level BPE).
Before returning, every tensor's shape is checked against the config, the k_b/v_b orientation
is checked, and per layer the absorbed and decompressed MLA attention are compared numerically.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .gguf_file import GGUFError, GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFCheckpoint", "GGUFTensors", "GGUFTokenizer", "load_gguf", "derive_hf_config"]

MLA_ARCHES = ("deepseek2", "deepseek32", "glm-dsa")
DSA_ARCHES = ("deepseek32", "glm-dsa")
HF_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_*
ABSENT = "llama.cpp default (key absent)"
MLA_CHECK_RTOL = 1e-5

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
            raise GGUFError(f"{self.gf.path}: required metadata key '{k}' is missing "
                            f"(the model is undefined without it: {fld})")
        return self.put(fld, self._convert(k, conv), f"gguf:{k}")

    def opt(self, fld: str, suffix: str, default: Any, conv: Callable = int, note: str = "") -> Any:
        k = self.key(suffix)
        if k in self.gf.metadata:
            return self.put(fld, self._convert(k, conv), f"gguf:{k}")
        return self.put(fld, default, f"{ABSENT}: '{k}'{note}")

    def _convert(self, k: str, conv: Callable) -> Any:
        try:
            return conv(self.gf.metadata[k])
        except (TypeError, ValueError) as e:  # GGUFError is a ValueError
            raise GGUFError(f"{self.gf.path}: metadata key '{k}' = {self.gf.metadata[k]!r}: {e}") from None

    def put(self, fld: str, value: Any, source: str) -> Any:
        self.prov[fld] = (value, source)
        return value


def _scalar(x: Any) -> int:
    """Per-layer keys may be arrays; MLA models use one value for all layers."""
    if isinstance(x, list):
        if len(set(x)) != 1:
            raise ValueError(f"per-layer values differ ({x}); only uniform values are supported")
        x = x[0]
    return int(x)


def _model_type(m: _Meta) -> str:
    if m.arch == "deepseek32":
        return m.put("model_type", "deepseek_v32", "gguf:general.architecture=deepseek32")
    if m.arch == "glm-dsa":
        return m.put("model_type", "glm_moe_dsa", "gguf:general.architecture=glm-dsa")
    gating = m.raw("expert_gating_func")
    has_bias = any(n.endswith(".exp_probs_b.bias") for n in m.gf.tensors)
    if gating == 2 or has_bias:
        why = "expert_gating_func=sigmoid" if gating == 2 else "exp_probs_b tensors present"
        return m.put("model_type", "deepseek_v3", f"gguf:general.architecture=deepseek2 + {why}")
    return m.put("model_type", "deepseek_v2",
                 "gguf:general.architecture=deepseek2 + softmax gating (expert_gating_func 1 or absent), "
                 "no exp_probs_b")


def _attention_fields(m: _Meta, cfg: dict) -> None:
    cfg["hidden_size"] = m.req("hidden_size", "embedding_length")
    cfg["num_attention_heads"] = m.req("num_attention_heads", "attention.head_count", _scalar)
    cfg["num_key_value_heads"] = m.put(
        "num_key_value_heads", cfg["num_attention_heads"],
        f"derived: = num_attention_heads (MLA; gguf:{m.key('attention.head_count_kv')}=1 describes the latent cache)")
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
    cfg["qk_nope_head_dim"] = m.put("qk_nope_head_dim", qk - rope,
                                    f"derived: gguf:{m.key(k_key)} - gguf:{m.key('rope.dimension_count')}")
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
    cfg["norm_topk_prob"] = m.opt("norm_topk_prob", "expert_weights_norm", False, bool)
    _gating(m, cfg)


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


def _rope_fields(m: _Meta, cfg: dict) -> None:
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
    if cfg["model_type"] == "deepseek_v3":
        # llama.cpp's deepseek2 graph uses ggml's "NORM" rope = adjacent pairs = HF rope_interleave
        cfg["rope_interleave"] = m.put("rope_interleave", True, "llama.cpp deepseek2 graph (interleaved RoPE)")


def _yarn(m: _Meta) -> dict[str, Any]:
    out = {"rope_type": "yarn",
           "factor": m.req("rope_parameters.factor", "rope.scaling.factor", _decimal),
           "original_max_position_embeddings": m.req("rope_parameters.original_max_position_embeddings",
                                                     "rope.scaling.original_context_length"),
           "beta_fast": m.opt("rope_parameters.beta_fast", "rope.scaling.yarn_beta_fast", 32.0, _decimal),
           "beta_slow": m.opt("rope_parameters.beta_slow", "rope.scaling.yarn_beta_slow", 1.0, _decimal)}
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
        out["mscale"] = m.put("rope_parameters.mscale", mad,
                              "derived: = mscale_all_dim (not stored; llama.cpp's deepseek2 graph implies it)")
    return out


def _token_ids(m: _Meta, cfg: dict) -> None:
    md = m.gf.metadata
    bos = md.get("tokenizer.ggml.bos_token_id")
    cfg["bos_token_id"] = m.put("bos_token_id", bos, "gguf:tokenizer.ggml.bos_token_id" if bos is not None
                                else f"{ABSENT}: 'tokenizer.ggml.bos_token_id'")
    keys = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
    ids = [md[k] for k in keys if md.get(k) is not None]
    ids = list(dict.fromkeys(ids))  # HF lists every stop token; keep eos, eot, eom order
    eos = None if not ids else ids[0] if len(ids) == 1 else ids
    cfg["eos_token_id"] = m.put("eos_token_id", eos, "gguf:" + " + ".join(k for k in keys if k in md) if ids
                                else f"{ABSENT}: 'tokenizer.ggml.eos_token_id'")
    pad = md.get("tokenizer.ggml.padding_token_id")
    cfg["pad_token_id"] = m.put("pad_token_id", pad, "gguf:tokenizer.ggml.padding_token_id" if pad is not None
                                else f"{ABSENT}: 'tokenizer.ggml.padding_token_id'")


def _vocab_fields(m: _Meta, cfg: dict) -> None:
    if m.has("vocab_size"):
        cfg["vocab_size"] = m.req("vocab_size", "vocab_size")
    elif "token_embd.weight" in m.gf.tensors:
        rows = m.gf.tensors["token_embd.weight"].shape[0]
        cfg["vocab_size"] = m.put("vocab_size", rows, "derived: rows of tensor token_embd.weight")
    else:
        raise GGUFError(f"{m.gf.path}: neither '{m.key('vocab_size')}' nor tensor token_embd.weight is present")
    tied = "output.weight" not in m.gf.tensors
    cfg["tie_word_embeddings"] = m.put("tie_word_embeddings", tied,
                                       "derived: tensor output.weight " + ("absent" if tied else "present"))


def _dsa_fields(m: _Meta, cfg: dict, n_layers: int) -> None:
    cfg["index_topk"] = m.req("index_topk", "attention.indexer.top_k")
    cfg["index_n_heads"] = m.req("index_n_heads", "attention.indexer.head_count")
    cfg["index_head_dim"] = m.req("index_head_dim", "attention.indexer.key_length")
    if m.arch == "glm-dsa":
        types = m.raw("attention.indexer.types")
        if types is None:
            m.put("indexer_types", ["full"] * n_layers, f"{ABSENT}: '{m.key('attention.indexer.types')}' -> all full")
        else:
            m.put("indexer_types", ["full" if t else "shared" for t in types[:n_layers]],
                  f"gguf:{m.key('attention.indexer.types')}")
        cfg["indexer_types"] = m.prov["indexer_types"][0]


def derive_hf_config(gf: GGUFFile) -> tuple[dict[str, Any], Provenance]:
    """GGUF metadata -> (HF config dict, provenance)."""
    arch = gf.metadata.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{gf.path}: required metadata key 'general.architecture' is missing")
    if arch not in MLA_ARCHES:
        raise GGUFError(f"{gf.path}: general.architecture={arch!r} is not an MLA architecture "
                        f"this loader supports ({', '.join(MLA_ARCHES)})")
    m = _Meta(gf, arch)
    cfg: dict[str, Any] = {"model_type": _model_type(m)}
    cfg["architectures"] = m.put("architectures", [HF_ARCHITECTURES[cfg["model_type"]]], "derived: from model_type")
    blocks = m.req("block_count", "block_count")
    nextn = m.opt("num_nextn_predict_layers", "nextn_predict_layers", 0)
    cfg["num_hidden_layers"] = m.put("num_hidden_layers", blocks - nextn,
                                     f"derived: gguf:{m.key('block_count')} - nextn_predict_layers")
    cfg["num_nextn_predict_layers"] = nextn
    _attention_fields(m, cfg)
    _moe_fields(m, cfg)
    cfg["rms_norm_eps"] = m.req("rms_norm_eps", "attention.layer_norm_rms_epsilon", _decimal)
    cfg["hidden_act"] = m.put("hidden_act", "silu", "llama.cpp MLA graphs (SwiGLU experts, fixed)")
    _rope_fields(m, cfg)
    _vocab_fields(m, cfg)
    _token_ids(m, cfg)
    if arch in DSA_ARCHES:
        _dsa_fields(m, cfg, cfg["num_hidden_layers"])
    return cfg, m.prov


# =============================================================================================
# tensor mapping: GGUF name -> HF Hub checkpoint name

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
            "ffn_down_exps.weight": "down_proj"}
_K_B, _V_B, _KV_B = "attn_k_b.weight", "attn_v_b.weight", "attn_kv_b.weight"
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Entry:
    kind: str                  # "plain" | "expert" | "kv_b_split"
    sources: tuple[str, ...]   # GGUF tensor names
    shape: tuple[int, ...]     # torch shape of the HF tensor
    index: int = -1            # expert index for kind "expert"


def _layer_expectations(cfg: dict, layer: int) -> tuple[set[str], set[str]]:
    """(required, optional) GGUF suffixes of one layer under this config."""
    req = {"attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
           "attn_output.weight"}
    req |= ({"attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"} if cfg["q_lora_rank"]
            else {"attn_q.weight"})
    opt = {_K_B, _V_B, _KV_B}  # one of the two layouts, checked separately
    if layer < cfg["first_k_dense_replace"]:
        req |= {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
    else:
        req |= {"ffn_gate_inp.weight", *_EXPERTS}
        if cfg["n_shared_experts"]:
            req |= {"ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
        opt.add("exp_probs_b.bias")
    if "index_topk" in cfg and cfg.get("indexer_types", ["full"] * (layer + 1))[layer] == "full":
        req |= {s for s in _LAYER if s.startswith("indexer.")}
    return req, opt


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """torch shape of every GGUF tensor (by layer suffix / global name) under this config."""
    hid, H, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    n, r, v, ql = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    E, mff, sh = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    shapes = {
        "token_embd.weight": (cfg["vocab_size"], hid), "output.weight": (cfg["vocab_size"], hid),
        "output_norm.weight": (hid,), "attn_norm.weight": (hid,), "ffn_norm.weight": (hid,),
        "attn_q_a.weight": (ql, hid), "attn_q_a_norm.weight": (ql,), "attn_q_b.weight": (H * (n + r), ql),
        "attn_q.weight": (H * (n + r), hid), "attn_kv_a_mqa.weight": (L + r, hid),
        "attn_kv_a_norm.weight": (L,), _K_B: (H, L, n), _V_B: (H, v, L), _KV_B: (H * (n + v), L),
        "attn_output.weight": (hid, H * v),
        "ffn_gate_inp.weight": (E, hid), "exp_probs_b.bias": (E,),
        "ffn_gate_exps.weight": (E, mff, hid), "ffn_up_exps.weight": (E, mff, hid),
        "ffn_down_exps.weight": (E, hid, mff),
        "ffn_gate_shexp.weight": (sh * mff, hid), "ffn_up_shexp.weight": (sh * mff, hid),
        "ffn_down_shexp.weight": (hid, sh * mff),
    }
    if cfg.get("intermediate_size"):
        ff = cfg["intermediate_size"]
        shapes.update({"ffn_gate.weight": (ff, hid), "ffn_up.weight": (ff, hid), "ffn_down.weight": (hid, ff)})
    if "index_topk" in cfg:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        shapes.update({"indexer.attn_q_b.weight": (ih * idim, ql), "indexer.attn_k.weight": (idim, hid),
                       "indexer.k_norm.weight": (idim,), "indexer.k_norm.bias": (idim,),
                       "indexer.proj.weight": (ih, hid)})
    return shapes


class _Mapper:
    """Assigns every GGUF tensor exactly one consumer and checks shapes."""

    def __init__(self, gf: GGUFFile, cfg: dict):
        self.gf, self.cfg = gf, cfg
        self._arch = gf.metadata["general.architecture"]
        self.shapes = _expected_shapes(cfg)
        self.entries: dict[str, _Entry] = {}
        self.mla: dict[int, dict[str, str]] = {}
        self.skipped: list[str] = []
        self.consumed: set[str] = set()

    def run(self) -> None:
        by_layer: dict[int, dict[str, str]] = {}
        n_layers, n_blocks = self.cfg["num_hidden_layers"], self.gf.metadata[f"{self._arch}.block_count"]
        for name in self.gf.tensors:
            mt = _BLK.match(name)
            if mt and int(mt[1]) >= n_blocks:
                raise GGUFError(f"{self.gf.path}: tensor '{name}' belongs to no block "
                                f"({self._arch}.block_count={n_blocks})")
            if mt and int(mt[1]) >= n_layers:
                self.skipped.append(name)  # nextn / MTP block(s): not part of the main model
                self.consumed.add(name)
            elif mt:
                by_layer.setdefault(int(mt[1]), {})[mt[2]] = name
            elif name in _GLOBAL:
                self._plain(name, _GLOBAL[name], name)
            else:
                raise GGUFError(f"{self.gf.path}: unknown tensor '{name}' (not part of the {self._arch} layout)")
        self._require_globals()
        for layer in range(self.cfg["num_hidden_layers"]):
            self._layer(layer, by_layer.pop(layer, {}))
        unused = sorted(set(self.gf.tensors) - self.consumed)
        if unused:  # cannot happen by construction; guards future edits of the mapping
            raise GGUFError(f"{self.gf.path}: tensors not consumed by the mapping: {unused}")

    def _require_globals(self) -> None:
        for g in ("token_embd.weight", "output_norm.weight"):
            if g not in self.gf.tensors:
                raise GGUFError(f"{self.gf.path}: missing tensor '{g}' (needed for {_GLOBAL[g]})")

    def _check_shape(self, gname: str, key: str) -> TensorInfo:
        info = self.gf.tensors[gname]
        want = self.shapes.get(key)
        if want is not None and info.shape != want:
            raise GGUFError(f"{self.gf.path}: tensor '{gname}' has shape {list(info.shape)} (ggml ne "
                            f"{list(info.ne)}), expected {list(want)} from the config")
        return info

    def _plain(self, gname: str, hf: str, key: str) -> None:
        info = self._check_shape(gname, key)
        self.entries[hf] = _Entry("plain", (gname,), info.shape)
        self.consumed.add(gname)

    def _layer(self, i: int, present: dict[str, str]) -> None:
        req, opt = _layer_expectations(self.cfg, i)
        missing = sorted(req - set(present))
        if missing:
            raise GGUFError(f"{self.gf.path}: missing tensor 'blk.{i}.{missing[0]}' "
                            f"(needed for {self._hf_hint(i, missing[0])})")
        extra = sorted(set(present) - req - opt)
        if extra:
            raise GGUFError(f"{self.gf.path}: unexpected tensor 'blk.{i}.{extra[0]}' "
                            f"(not part of layer {i} for this config: {self._layer_kind(i)})")
        pre = f"model.layers.{i}."
        for suf, gname in present.items():
            if suf in _EXPERTS:
                self._experts(i, suf, gname)
            elif suf not in (_K_B, _V_B, _KV_B):
                self._plain(gname, pre + _LAYER[suf], suf)
        self._kv_b(i, present)

    def _layer_kind(self, i: int) -> str:
        q = f"q_lora_rank={self.cfg['q_lora_rank']}"
        mlp = "dense MLP" if i < self.cfg["first_k_dense_replace"] else "MoE"
        return f"{q}, {mlp}, n_shared_experts={self.cfg['n_shared_experts']}"

    def _hf_hint(self, i: int, suf: str) -> str:
        if suf in _EXPERTS:
            return f"model.layers.{i}.mlp.experts.*.{_EXPERTS[suf]}.weight"
        return f"model.layers.{i}.{_LAYER.get(suf, suf)}"

    def _experts(self, i: int, suf: str, gname: str) -> None:
        info = self._check_shape(gname, suf)
        for e in range(info.shape[0]):
            hf = f"model.layers.{i}.mlp.experts.{e}.{_EXPERTS[suf]}.weight"
            self.entries[hf] = _Entry("expert", (gname,), info.shape[1:], e)
        self.consumed.add(gname)

    def _kv_b(self, i: int, present: dict[str, str]) -> None:
        kb, vb, kvb = present.get(_K_B), present.get(_V_B), present.get(_KV_B)
        if (kb is None) != (vb is None):
            have, lack = (kb, _V_B) if kb else (vb, _K_B)
            raise GGUFError(f"{self.gf.path}: tensor '{have}' is present but 'blk.{i}.{lack}' is missing")
        if kb is None and kvb is None:
            raise GGUFError(f"{self.gf.path}: missing tensor 'blk.{i}.{_K_B}' + 'blk.{i}.{_V_B}' "
                            f"(or a fused 'blk.{i}.{_KV_B}'), needed for model.layers.{i}.self_attn.kv_b_proj.weight")
        hf = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        if kb is not None:
            self._check_k_b(kb)
            self._check_v_b(vb)
            self.mla[i] = {"k_b": kb, "v_b": vb}
            self.consumed |= {kb, vb}
        if kvb is not None:  # fused kv_b wins for kv_b_proj; a split pair then feeds mla_split
            self._plain(kvb, hf, _KV_B)
            self.mla.setdefault(i, {})["kv_b"] = kvb
        else:
            self.entries[hf] = _Entry("kv_b_split", (kb, vb), self.shapes[_KV_B])

    def _check_k_b(self, name: str) -> None:
        H, L, n = self.cfg["num_attention_heads"], self.cfg["kv_lora_rank"], self.cfg["qk_nope_head_dim"]
        got = self.gf.tensors[name].shape
        if got == (H, n, L) and n != L:
            raise GGUFError(
                f"{self.gf.path}: tensor '{name}' is stored the wrong way round: torch shape {list(got)} = "
                f"[heads, qk_nope_head_dim={n}, kv_lora_rank={L}], expected [heads, kv_lora_rank, qk_nope_head_dim] "
                f"= {[H, L, n]} (llama.cpp stores attn_k_b transposed per head, ggml ne = [{n}, {L}, {H}])")
        self._check_shape(name, _K_B)

    def _check_v_b(self, name: str) -> None:
        H, L, v = self.cfg["num_attention_heads"], self.cfg["kv_lora_rank"], self.cfg["v_head_dim"]
        got = self.gf.tensors[name].shape
        if got == (H, L, v) and v != L:
            raise GGUFError(
                f"{self.gf.path}: tensor '{name}' is stored the wrong way round: torch shape {list(got)} = "
                f"[heads, kv_lora_rank={L}, v_head_dim={v}], expected [heads, v_head_dim, kv_lora_rank] = {[H, v, L]}")
        self._check_shape(name, _V_B)


# =============================================================================================
# lazy HF-named tensor view

class GGUFTensors:
    """HF Hub-named float32 tensors of a GGUF file, dequantized on `get`.

    F32 tensors (and per-expert slices of F32 stacks) are views of the memory-mapped file;
    treat them as read-only.
    """

    def __init__(self, gf: GGUFFile, cfg: dict, entries: dict[str, _Entry], mla: dict[int, dict[str, str]]):
        self._gf, self._cfg, self._entries, self._mla = gf, cfg, entries, mla

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def sources(self, name: str) -> tuple[str, ...]:
        """GGUF tensor name(s) an HF tensor is made from."""
        return self._entry(name).sources

    def where(self, name: str) -> str:
        """For error messages: the file and GGUF tensor(s) behind an HF name."""
        e = self._entry(name)
        src = " + ".join(e.sources) + (f"[{e.index}]" if e.kind == "expert" else "")
        return f"{self._gf.tensors[e.sources[0]].path} (GGUF {src})"

    def gguf_type(self, name: str) -> str:
        return self._gf.tensors[self._entry(name).sources[0]].type_name

    def get(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        if e.kind == "plain":
            return self._gf.tensor(e.sources[0])
        if e.kind == "expert":
            return self._gf.slice0(e.sources[0], e.index)
        k_b, v_b = (self._gf.tensor(s) for s in e.sources)
        return _join_kv_b(k_b, v_b)

    def get_experts(self, layer: int, proj: str) -> torch.Tensor:
        """Stacked routed experts [E, out, in] for proj in gate_proj/up_proj/down_proj."""
        e = self._entry(f"model.layers.{layer}.mlp.experts.0.{proj}.weight")
        return self._gf.tensor(e.sources[0])

    def mla_split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, L, n], W_UV [H, v, L]) as llama.cpp stores attn_k_b / attn_v_b.

        q_lat[h] = W_UK[h] @ q_nope[h] (then score = q_lat . c);  o[h] = W_UV[h] @ (P c).
        Taken from the file's attn_k_b/attn_v_b, or split from a fused attn_kv_b.
        """
        src = self._mla_sources(layer)
        if "k_b" in src:
            return self._gf.tensor(src["k_b"]), self._gf.tensor(src["v_b"])
        return _split_kv_b(self._gf.tensor(src["kv_b"]), self._cfg)

    def _mla_sources(self, layer: int) -> dict[str, str]:
        if layer not in self._mla:
            raise KeyError(f"{self._gf.path}: no MLA layer {layer}")
        return self._mla[layer]

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise KeyError(f"{self._gf.path}: no tensor '{name}' in this checkpoint")
        return self._entries[name]


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """k_b [H, L, n] + v_b [H, v, L] -> HF kv_b_proj [H*(n+v), L] (per head: k rows, then v rows)."""
    H, L, _ = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, L)


def _split_kv_b(kv_b: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    H, n, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    per_head = kv_b.reshape(H, n + v, -1)
    return per_head[:, :n].transpose(1, 2), per_head[:, n:]


def _mla_identity_check(gf: GGUFFile, tensors: GGUFTensors, layer: int, seed: int = 0) -> None:
    """Absorbed attention (k_b/v_b on the latent) == decompressed attention (kv_b_proj), per layer.

    A random latent c [T, L] and query q_nope [H, T, n] are pushed through both paths (float64);
    scores and outputs must agree to MLA_CHECK_RTOL relative to their magnitude.
    """
    w_uk, w_uv = (w.double() for w in tensors.mla_split(layer))  # [H, L, n], [H, v, L]
    kv_name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    kv_b = tensors.get(kv_name).double()
    H, L, n = w_uk.shape
    g = torch.Generator().manual_seed(seed + layer)
    c = torch.randn(5, L, generator=g, dtype=torch.float64)
    q = torch.randn(H, 5, n, generator=g, dtype=torch.float64)
    kv = (c @ kv_b.T).reshape(5, H, -1).transpose(0, 1)           # decompressed [H, T, n+v]
    s_dec = q @ kv[..., :n].transpose(1, 2)
    s_abs = (q @ w_uk.transpose(1, 2)) @ c.T                      # q_lat[h] = W_UK[h] q[h]
    p = torch.softmax(s_dec / math.sqrt(n), dim=-1)
    o_dec = p @ kv[..., n:]
    o_abs = (p @ c) @ w_uv.transpose(1, 2)                        # o[h] = W_UV[h] (P c)
    for what, a, b in (("scores", s_abs, s_dec), ("outputs", o_abs, o_dec)):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not err <= MLA_CHECK_RTOL:
            src = tensors._mla_sources(layer)
            raise GGUFError(f"{gf.path}: layer {layer}: MLA absorbed vs decompressed attention {what} differ "
                            f"(relative error {err:.2e}) between {sorted(src.values())} and "
                            f"{list(tensors.sources(kv_name))}")


# =============================================================================================
# tokenizer

_LLAMA3_RE = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp llm_tokenizer_bpe regex lists (applied one after the other, each split "isolated")
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "deepseek-v3": [
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ],
    "glm4": [_LLAMA3_RE], "chatglm-bpe": [_LLAMA3_RE], "llama-bpe": [_LLAMA3_RE],
    "dbrx": [_LLAMA3_RE], "smaug-bpe": [_LLAMA3_RE],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"\p{N}+", r"[0-9][0-9][0-9]"],
}
# pre-tokenizers for which llama.cpp adds no BOS although add_bos_token may be set
_NO_BOS_PRE = ("glm4", "chatglm-bpe")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


@dataclass
class GGUFTokenizer:
    """``tokenizer.ggml.*`` of a GGUF file; `build_tokenizer` makes a `tokenizers.Tokenizer`."""

    path: Path
    model: str | None
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, gf: GGUFFile) -> "GGUFTokenizer":
        md = gf.metadata
        t = lambda k: md.get(f"tokenizer.ggml.{k}")  # noqa: E731
        return cls(gf.path, t("model"), t("pre"), list(t("tokens") or []), list(t("token_type") or []),
                   list(t("merges") or []), t("bos_token_id"), t("eos_token_id"), t("eot_token_id"),
                   t("eom_token_id"), t("padding_token_id"), bool(t("add_bos_token") or False),
                   bool(t("add_eos_token") or False), md.get("tokenizer.chat_template"))

    def token_id(self, text: str) -> int | None:
        try:
            return self.tokens.index(text)
        except ValueError:
            return None

    def prefix_ids(self, glm_prefix: bool | None = None) -> list[int]:
        """Special ids put before the text.

        From the metadata alone: [bos] when add_bos_token (llama.cpp: not for the glm4 /
        chatglm-bpe pre-tokenizers).  GLM models expect "[gMASK]<sop>" instead -- their HF
        tokenizer prepends both, llama.cpp puts them in the chat template -- which the metadata
        does not encode; ``glm_prefix`` (default: auto = when the vocabulary has both tokens and
        [gMASK] is the BOS or there is none) reproduces it.
        """
        gmask, sop = self.token_id("[gMASK]"), self.token_id("<sop>")
        is_glm = gmask is not None and sop is not None and self.bos_token_id in (None, gmask)
        if glm_prefix or (glm_prefix is None and is_glm):
            if not is_glm:
                raise GGUFError(f"{self.path}: glm_prefix requested but the vocabulary has no [gMASK]/<sop>")
            return [gmask, sop]
        if self.add_bos_token and self.bos_token_id is not None and self.pre not in _NO_BOS_PRE:
            return [self.bos_token_id]
        return []

    def build_tokenizer(self, glm_prefix: bool | None = None):
        """A `tokenizers.Tokenizer` equivalent to llama.cpp's BPE tokenizer for this file."""
        from tokenizers import Tokenizer, decoders, models

        if self.model != "gpt2":
            raise GGUFError(f"{self.path}: tokenizer.ggml.model={self.model!r} is not supported "
                            "(only 'gpt2' byte-level BPE)")
        vocab: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            vocab.setdefault(tok, i)  # duplicate strings: the first id wins, as in llama.cpp
        merges = [_split_merge(m, self.path) for m in self.merges]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=self.pre == "llama-bpe"))
        tk.pre_tokenizer = self._pre_tokenizer()
        tk.decoder = decoders.ByteLevel()
        self._add_special_tokens(tk)
        self._post_processor(tk, self.prefix_ids(glm_prefix))
        return tk

    def _pre_tokenizer(self):
        from tokenizers import Regex, pre_tokenizers

        pre = self.pre or "default"
        if pre == "gpt-2":
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise GGUFError(f"{self.path}: tokenizer.ggml.pre={pre!r} is not supported "
                            f"(known: gpt-2, {', '.join(PRE_TOKENIZER_REGEXES)})")
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_REGEXES[pre]]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def _add_special_tokens(self, tk) -> None:
        from tokenizers import AddedToken

        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(self.tokens, self.token_types) if ty == TOKEN_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(self.tokens, self.token_types) if ty == TOKEN_USER_DEFINED]
        tk.add_special_tokens(special)
        tk.add_tokens(user)

    def _post_processor(self, tk, prefix: list[int]) -> None:
        from tokenizers import processors

        suffix = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
        if not prefix and not suffix:
            return
        # template pieces get neutral names: token texts may contain ':' or spaces
        name = {i: f"SPECIAL{k}" for k, i in enumerate(dict.fromkeys(prefix + suffix))}
        specials = [{"id": n, "ids": [i], "tokens": [self.tokens[i]]} for i, n in name.items()]
        pieces = lambda ids, seq: [f"{name[i]}:{seq}" for i in ids]  # noqa: E731
        single = " ".join(pieces(prefix, 0) + ["$A:0"] + pieces(suffix, 0))
        pair = " ".join([single] + pieces(prefix, 1) + ["$B:1"] + pieces(suffix, 1))
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _split_merge(m: str, path: Path) -> tuple[str, str]:
    i = m.find(" ", 1)  # as llama.cpp: the separator is the first space after position 0
    if i < 0:
        raise GGUFError(f"{path}: invalid BPE merge {m!r} in tokenizer.ggml.merges")
    return m[:i], m[i + 1:]


# =============================================================================================
# checkpoint

@dataclass
class GGUFCheckpoint:
    path: Path
    file: GGUFFile
    gguf_arch: str
    hf_config: dict[str, Any]
    provenance: Provenance
    tensors: GGUFTensors
    skipped: list[str]
    tokenizer: GGUFTokenizer

    def mla_split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, kv_lora, nope], W_UV [H, v, kv_lora]); see `GGUFTensors.mla_split`."""
        return self.tensors.mla_split(layer)

    def build_tokenizer(self, glm_prefix: bool | None = None):
        return self.tokenizer.build_tokenizer(glm_prefix)

    def close(self) -> None:
        self.file.close()


def load_gguf(path: str | Path, validate_numeric: bool = True) -> GGUFCheckpoint:
    """Open an MLA GGUF model (any shard of a split model) and map it to HF naming.

    Raises GGUFError on malformed files, missing required keys/tensors, unknown tensors,
    shape mismatches, a wrongly oriented attn_k_b/attn_v_b, or a failed MLA identity check.
    """
    gf = open_gguf(path)
    cfg, prov = derive_hf_config(gf)
    mapper = _Mapper(gf, cfg)
    mapper.run()
    tensors = GGUFTensors(gf, cfg, mapper.entries, mapper.mla)
    if validate_numeric:
        for layer in range(cfg["num_hidden_layers"]):
            _mla_identity_check(gf, tensors, layer)
    return GGUFCheckpoint(gf.path, gf, gf.metadata["general.architecture"], cfg, prov, tensors,
                          mapper.skipped, GGUFTokenizer.from_metadata(gf))

"""Read a DeepSeek-V4 GGUF file (llama.cpp's `deepseek4` layout) as the V4 model's config and tensors.

The layout follows llama.cpp's converter (convert_hf_to_gguf.py, class DeepseekV4Model) and gguf-py's
constants.py (MODEL_ARCH.DEEPSEEK4, TENSOR_NAMES) as merged in ggml-org/llama.cpp#24162: the release's
names (`layers.N.attn.wq_a`, ...) mapped to `blk.N.*`, the routed experts stacked per layer and repacked
from V4's FP4 into ggml MXFP4 blocks, FP8 matrices stored Q8_0, `ffn.gate.tid2eid` as I32.

Notation: D hidden, H heads, Dh head width (key_length = value_length), r q_lora_rank, G o_groups, o
o_lora_rank, E routed experts, I expert width, k experts per token, V vocabulary, c hc_mult, Hi / Di indexer
heads / width, m a layer's compress ratio. Torch shapes (outermost first, = reversed ggml ne):
  token_embd / output                 [V, D]        embed.weight / head.weight
  output_hc_{fn,base,scale}           [c, c*D], [c], [1]   hc_head_*
  blk.N.hc_{attn,ffn}_{fn,base,scale} [(2+c)*c, c*D], [(2+c)*c], [3]   hc_*  (fp32 as the reference keeps them)
  blk.N.attn_q_a / attn_q_b           [r, D] / [H*Dh, r]
  blk.N.attn_kv                       [Dh, D]       the shared K=V head
  blk.N.attn_output_a / _b            [G*o, H/G*Dh] / [D, G*o]
  blk.N.attn_sinks                    [H]
  blk.N.attn_compressor_{kv,gate}     [w*Dh, D] (w = 2 for CSA's overlapping windows, 1 for HCA), ape [m, w*Dh]
  blk.N.indexer.attn_q_b / .proj      [Hi*Di, r] / [Hi, D]; indexer_compressor_* as attn_compressor_* in Di
  blk.N.ffn_gate_inp / exp_probs_b    [E, D] / [E];  ffn_gate_tid2eid [V, k] I32 (hash layers only)
  blk.N.ffn_{gate,up}_exps            [E, I, D];  ffn_down_exps [E, D, I];  *_shexp the shared expert
The expected shapes are the V4 model's own (built on the meta device from the derived config), so a file
and a Hugging Face folder of one model are checked against the same module tree.

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
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import Setting
from mlaserve.gguf.read.config import ABSENT, Provenance, _bool, _decimal, _Meta
from mlaserve.gguf.read.file import GGUFError, GGUFFile, open_gguf
from mlaserve.gguf.read.tokenizer import GGUFTokenizer
from mlaserve.loading.deepseek_v4_names import target

ARCH = "deepseek4"
LLAMA_CPP_HC_MULT = 4  # llama.cpp's deepseek4 graph refuses any other hyper_connection.count
CSA_RATIO = 4  # llama.cpp: the layers of compress ratio 4 carry the lightning indexer (CSA)
SQRT_SOFTPLUS = 4  # expert_gating_func: gguf-py's ExpertGatingFuncType.SQRTSOFTPLUS
I32 = 26  # ggml type id of tid2eid

# GGUF name -> the release's name (loading/deepseek_v4.py maps those onto the module tree)
_GLOBAL = {
    "token_embd.weight": "embed.weight",
    "output.weight": "head.weight",
    "output_norm.weight": "norm.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_base.weight": "hc_head_base",
    "output_hc_scale.weight": "hc_head_scale",
}
_COMPRESSOR = {
    "ape.weight": "ape",
    "kv.weight": "wkv.weight",
    "gate.weight": "wgate.weight",
    "norm.weight": "norm.weight",
}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
}
_LAYER |= {f"hc_{s}_{p}.weight": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
_LAYER |= {f"attn_compressor_{k}": f"attn.compressor.{v}" for k, v in _COMPRESSOR.items()}
_LAYER |= {f"indexer_compressor_{k}": f"attn.indexer.compressor.{v}" for k, v in _COMPRESSOR.items()}
_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2", "ffn_up_exps.weight": "w3"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


# =============================================================================================
# metadata


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
    if m.has("vocab_size"):
        cfg["vocab_size"] = m.req("vocab_size", "vocab_size")
    elif "token_embd.weight" in m.gf.tensors:
        rows = m.gf.tensors["token_embd.weight"].shape[0]
        cfg["vocab_size"] = m.put("vocab_size", rows, "derived: rows of tensor token_embd.weight")
    else:
        raise GGUFError(f"{m.gf.path}: neither '{m.key('vocab_size')}' nor tensor token_embd.weight is present")
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


# =============================================================================================
# tensors


@dataclass(frozen=True)
class _Entry:
    source: str  # the GGUF tensor
    shape: tuple[int, ...]  # torch shape of the release's tensor
    expert: int = -1  # an expert's slice of a stacked ffn_*_exps


class V4GGUFTensors:
    """The release's tensor names -> float32 tensors of the file (dequantized on `get`; tid2eid int32), or
    their stored bytes (`get_blocks`) for the quantized holders. Built by `load_v4_gguf` after every name and
    shape was checked against the model."""

    def __init__(self, gf: GGUFFile, entries: dict[str, _Entry]) -> None:
        self._gf, self._entries = gf, entries

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def where(self, name: str) -> str:
        e = self._entries[name]
        return f"{self._gf.info(e.source).path} (GGUF {e.source}{f'[{e.expert}]' if e.expert >= 0 else ''})"

    def gguf_type(self, name: str) -> str:
        return self._gf.info(self._entries[name].source).type_name

    def ggml_type(self, name: str) -> int:
        return self._gf.info(self._entries[name].source).ggml_type

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        info = self._gf.info(e.source)
        if info.ggml_type == I32:
            return self._gf.raw(e.source).view(torch.int32).reshape(info.shape)
        return self._gf.slice0(e.source, e.expert) if e.expert >= 0 else self._gf.tensor(e.source)

    def get_blocks(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The stored bytes as uint8 [rows, R] (a view of the file; an expert: its slice of the stack). mapped:
        of the read-only shared map (GGUFFile.view; the V4 loader copies, so it never asks for it yet)."""
        e = self._entries[name]
        info = self._gf.info(e.source)
        rows = math.prod(e.shape[:-1])
        per_row = info.nbytes // math.prod(info.shape[:-1])
        start = e.expert * rows * per_row if e.expert >= 0 else 0
        read = self._gf.view if mapped else self._gf.raw
        return read(e.source, start, rows * per_row).view(rows, per_row)


def _expected(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every module tensor of the V4 model this config builds, with its shape (the meta device: no memory)."""
    from mlaserve.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    return {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def gguf_names(num_layers: int, modules: set[str]) -> dict[tuple[str, str | None], str]:
    """This module's name table read the other way (the converter writes with it): (module tensor, expert part
    w1 | w2 | w3 or None) -> the GGUF tensor, for every tensor the table names in `num_layers` layers (a layer's
    kind decides which of them its model has). Experts: gate_up_proj's w1 / w3 parts -> ffn_gate_exps /
    ffn_up_exps, down_proj's w2 -> ffn_down_exps."""
    out: dict[tuple[str, str | None], str] = {}
    for i in range(num_layers):
        for suf, rel in _LAYER.items():
            out.setdefault((target(f"layers.{i}.{rel}", modules).name, None), f"blk.{i}.{suf}")
        for suf, w in _EXPERTS.items():
            out[(target(f"layers.{i}.ffn.experts.0.{w}.weight", modules).name, w)] = f"blk.{i}.{suf}"
    for g, rel in _GLOBAL.items():
        out[(target(rel, modules).name, None)] = g
    return out


def _map_tensors(gf: GGUFFile, cfg: DeepseekV4Config) -> tuple[dict[str, _Entry], list[str]]:
    """Every GGUF tensor -> the release name(s) it fills (each used once), shapes checked against the model;
    every model tensor filled. Returns the entries and the skipped nextn (MTP) tensors."""
    expected = _expected(cfg)
    modules = set(expected)
    entries: dict[str, _Entry] = {}
    filled: dict[str, set] = {}
    skipped: list[str] = []
    gguf_of: dict[str, str] = {}  # module tensor -> the GGUF tensor that fills it (for "missing" errors)
    for (module, _), g in gguf_names(cfg.num_layers, modules).items():
        gguf_of.setdefault(module, g)

    for name, info in gf.tensors.items():
        mt = _BLK.match(name)
        if mt and int(mt[1]) >= cfg.num_layers:
            if int(mt[1]) < cfg.num_layers + cfg.num_nextn_predict_layers:
                skipped.append(name)  # the MTP layer: not built yet
                continue
            raise GGUFError(f"{gf.path}: tensor '{name}' belongs to no block ({ARCH}.block_count)")
        if mt and mt[2] in _EXPERTS:
            layer, part = int(mt[1]), _EXPERTS[mt[2]]
            dest = f"model.layers.{layer}.mlp.experts.{'down_proj' if part == 'w2' else 'gate_up_proj'}"
            e_count, rows, cols = expected[dest]
            want = (cfg.moe.n_routed_experts, rows // 2 if part != "w2" else rows, cols)
            _check(gf, name, info.shape, want, dest)
            for e in range(want[0]):
                entries[f"layers.{layer}.ffn.experts.{e}.{part}.weight"] = _Entry(name, want[1:], e)
            filled.setdefault(dest, set()).add(part)
            continue
        rel = f"layers.{mt[1]}.{_LAYER[mt[2]]}" if mt and mt[2] in _LAYER else _GLOBAL.get(name)
        if rel is None:
            raise GGUFError(f"{gf.path}: unknown tensor '{name}' (not part of llama.cpp's {ARCH} layout)")
        t = target(rel, modules)
        if t.name not in expected:
            layer = int(mt[1]) if mt else None
            kind = f" (layer {layer}: {cfg.layer_kinds[layer]}, {cfg.mlp_layer_types[layer]})" if mt else ""
            raise GGUFError(f"{gf.path}: unexpected tensor '{name}': the model has no {t.name}{kind}")
        _check(gf, name, info.shape, expected[t.name], t.name)
        if t.name.endswith("tid2eid") and info.ggml_type != I32:
            raise GGUFError(f"{gf.path}: tensor '{name}' is {info.type_name}, expected I32 (expert ids)")
        entries[rel] = _Entry(name, info.shape)
        filled.setdefault(t.name, set()).add(None)
    for dest in expected:
        need = (
            {"w1", "w3"} if dest.endswith("gate_up_proj") else {"w2"} if dest.endswith("experts.down_proj") else {None}
        )
        lack = need - filled.get(dest, set())
        if lack:
            g = gguf_of.get(dest, dest)
            if dest.endswith("gate_up_proj"):
                g = " + ".join(f"blk.{dest.split('.')[2]}.{s}" for s, w in _EXPERTS.items() if w in lack)
            raise GGUFError(f"{gf.path}: missing tensor '{g}' (needed for {dest})")
    return entries, skipped


def _check(gf: GGUFFile, name: str, got: tuple[int, ...], want: tuple[int, ...], dest: str) -> None:
    if tuple(got) != tuple(want):
        ne = list(reversed(got))
        raise GGUFError(
            f"{gf.path}: tensor '{name}' has shape {list(got)} (ggml ne {ne}), expected {list(want)} for {dest}"
        )


@dataclass
class V4GGUFCheckpoint:
    path: Path
    file: GGUFFile
    config: DeepseekV4Config
    hf_config: dict[str, Any]
    provenance: Provenance
    tensors: V4GGUFTensors
    skipped: list[str]
    tokenizer: GGUFTokenizer | None

    def close(self) -> None:
        self.file.close()


def load_v4_gguf(path: str | Path) -> V4GGUFCheckpoint:
    """Open a deepseek4 GGUF: metadata -> config (every key type-checked, its source recorded), every tensor
    name and shape checked against the model the config builds, each used once. Errors name the file and the
    key or tensor at fault."""
    gf = open_gguf(path)
    hf, prov = derive_v4_config(gf)
    cfg = v4_config(gf.path, hf, prov)
    entries, skipped = _map_tensors(gf, cfg)
    tok = GGUFTokenizer.from_metadata(gf) if "tokenizer.ggml.model" in gf.metadata else None
    return V4GGUFCheckpoint(gf.path, gf, cfg, hf, prov, V4GGUFTensors(gf, entries), skipped, tok)

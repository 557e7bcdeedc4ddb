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
from typing import Any

import torch

from mlaserve.gguf.quants import GGML_TYPES, dequantize
from mlaserve.gguf.read.config import Provenance, derive_hf_config
from mlaserve.gguf.read.file import GGUFError, GGUFFile, TensorInfo, open_gguf
from mlaserve.gguf.read.tokenizer import GGUFTokenizer

__all__ = ["GGUFError", "GGUFCheckpoint", "GGUFTensors", "GGUFTokenizer", "load_gguf", "derive_hf_config"]

MLA_CHECK_RTOL = 1e-5


# =============================================================================================
# tensor mapping: GGUF name -> HF Hub checkpoint name

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
# MTP (nextn) block extras, as llama.cpp's converter names them (the block's attention and MoE use _LAYER)
_NEXTN = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}
# kimi-linear KDA layers (llama.cpp's names; gguf-py MODEL_ARCH.KIMI_LINEAR). W = linear_num_heads * linear_head_dim,
# hd = linear_head_dim, Hk = linear_num_heads, K = conv kernel. Torch shapes:
#   attn_q / attn_k / attn_v   [W, D]        q_proj / k_proj / v_proj
#   ssm_conv1d_{q,k,v}         [1, W, 1, K] (or [W, 1, K])   {q,k,v}_conv1d.weight [W, 1, K], F32
#   ssm_f_a / ssm_g_a          [hd, D]       f_a_proj / g_a_proj;  ssm_f_b / ssm_g_b [W, hd]
#   ssm_beta                   [Hk, D]       b_proj
#   ssm_a                      [1, 1, Hk, 1] -exp(A_log): the converter stores A itself; A_log = log(-ssm_a)
#   ssm_dt.bias                [W]           dt_bias
#   ssm_norm                   [hd]          o_norm.weight (the gated RMSNorm)
#   attn_output                [D, W]        o_proj
_KDA = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_CONV = ("ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_K_B, _V_B, _KV_B = "attn_k_b.weight", "attn_v_b.weight", "attn_kv_b.weight"
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Entry:
    kind: str  # "plain" | "expert" | "kv_b_split" | "reshape" (a KDA conv) | "a_log" (log(-ssm_a))
    sources: tuple[str, ...]  # GGUF tensor names
    shape: tuple[int, ...]  # torch shape of the HF tensor
    index: int = -1  # expert index for kind "expert"


def _layer_expectations(cfg: dict, layer: int) -> tuple[set[str], set[str]]:
    """(required, optional) GGUF suffixes of one layer under this config."""
    if _is_kda(cfg, layer):
        req, opt = {"attn_norm.weight", "ffn_norm.weight", *_KDA}, set()
    else:
        req = {"attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight"}
        req |= {"attn_output.weight"}
        req |= (
            {"attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"} if cfg["q_lora_rank"] else {"attn_q.weight"}
        )
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


def _is_kda(cfg: dict, layer: int) -> bool:
    types = cfg.get("layer_types")
    return types is not None and layer < len(types) and types[layer] == "linear_attention"


def _kda_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """torch shape of every KDA tensor (by layer suffix); the conv's alternatives are checked by _Mapper._conv."""
    hid, Hk, hd = cfg["hidden_size"], cfg["linear_num_heads"], cfg["linear_head_dim"]
    W = Hk * hd
    return {
        "attn_q.weight": (W, hid),
        "attn_k.weight": (W, hid),
        "attn_v.weight": (W, hid),
        **{c: (1, W, 1, cfg["linear_conv_kernel_dim"]) for c in _CONV},
        "ssm_f_a.weight": (hd, hid),
        "ssm_g_a.weight": (hd, hid),
        "ssm_f_b.weight": (W, hd),
        "ssm_g_b.weight": (W, hd),
        "ssm_beta.weight": (Hk, hid),
        "ssm_a": (1, 1, Hk, 1),
        "ssm_dt.bias": (W,),
        "ssm_norm.weight": (hd,),
        "attn_output.weight": (hid, W),
    }


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """torch shape of every GGUF tensor (by layer suffix / global name) under this config."""
    hid, H, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    n, r, v, ql = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    E, mff, sh = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
    shapes = {
        "token_embd.weight": (cfg["vocab_size"], hid),
        "output.weight": (cfg["vocab_size"], hid),
        "output_norm.weight": (hid,),
        "attn_norm.weight": (hid,),
        "ffn_norm.weight": (hid,),
        "attn_q_a.weight": (ql, hid),
        "attn_q_a_norm.weight": (ql,),
        "attn_q_b.weight": (H * (n + r), ql),
        "attn_q.weight": (H * (n + r), hid),
        "attn_kv_a_mqa.weight": (L + r, hid),
        "attn_kv_a_norm.weight": (L,),
        _K_B: (H, L, n),
        _V_B: (H, v, L),
        _KV_B: (H * (n + v), L),
        "attn_output.weight": (hid, H * v),
        "ffn_gate_inp.weight": (E, hid),
        "exp_probs_b.bias": (E,),
        "ffn_gate_exps.weight": (E, mff, hid),
        "ffn_up_exps.weight": (E, mff, hid),
        "ffn_down_exps.weight": (E, hid, mff),
        "ffn_gate_shexp.weight": (sh * mff, hid),
        "ffn_up_shexp.weight": (sh * mff, hid),
        "ffn_down_shexp.weight": (hid, sh * mff),
        "nextn.eh_proj.weight": (hid, 2 * hid),
        "nextn.embed_tokens.weight": (cfg["vocab_size"], hid),
        "nextn.enorm.weight": (hid,),
        "nextn.hnorm.weight": (hid,),
        "nextn.shared_head_head.weight": (cfg["vocab_size"], hid),
        "nextn.shared_head_norm.weight": (hid,),
    }
    if cfg.get("intermediate_size"):
        ff = cfg["intermediate_size"]
        shapes.update({"ffn_gate.weight": (ff, hid), "ffn_up.weight": (ff, hid), "ffn_down.weight": (hid, ff)})
    if "index_topk" in cfg:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        shapes.update(
            {
                "indexer.attn_q_b.weight": (ih * idim, ql),
                "indexer.attn_k.weight": (idim, hid),
                "indexer.k_norm.weight": (idim,),
                "indexer.k_norm.bias": (idim,),
                "indexer.proj.weight": (ih, hid),
            }
        )
    return shapes


class _Mapper:
    """Assigns every GGUF tensor exactly one consumer and checks shapes."""

    def __init__(self, gf: GGUFFile, cfg: dict, with_mtp: bool = False):
        self.gf, self.cfg, self.with_mtp = gf, cfg, with_mtp
        self._arch = gf.metadata["general.architecture"]
        self.shapes = _expected_shapes(cfg)
        self.kda_shapes = _kda_shapes(cfg) if "linear_head_dim" in cfg else {}
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
                raise GGUFError(
                    f"{self.gf.path}: tensor '{name}' belongs to no block ({self._arch}.block_count={n_blocks})"
                )
            if mt and int(mt[1]) >= n_layers and self.with_mtp:
                by_layer.setdefault(int(mt[1]), {})[mt[2]] = name  # mapped by _mtp_layer
            elif mt and int(mt[1]) >= n_layers:
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
        for layer in sorted(by_layer):  # MTP blocks (with_mtp)
            self._mtp_layer(layer, by_layer.pop(layer))
        unused = sorted(set(self.gf.tensors) - self.consumed)
        if unused:  # cannot happen by construction; guards future edits of the mapping
            raise GGUFError(f"{self.gf.path}: tensors not consumed by the mapping: {unused}")

    def _require_globals(self) -> None:
        for g in ("token_embd.weight", "output_norm.weight"):
            if g not in self.gf.tensors:
                raise GGUFError(f"{self.gf.path}: missing tensor '{g}' (needed for {_GLOBAL[g]})")

    def _check_shape(self, gname: str, key: str, shapes: dict | None = None) -> TensorInfo:
        info = self.gf.tensors[gname]
        want = (self.shapes if shapes is None else shapes).get(key)
        if want is not None and info.shape != want:
            raise GGUFError(
                f"{self.gf.path}: tensor '{gname}' has shape {list(info.shape)} (ggml ne "
                f"{list(info.ne)}), expected {list(want)} from the config"
            )
        return info

    def _plain(self, gname: str, hf: str, key: str) -> None:
        info = self._check_shape(gname, key)
        self.entries[hf] = _Entry("plain", (gname,), info.shape)
        self.consumed.add(gname)

    def _mtp_layer(self, i: int, present: dict[str, str]) -> None:
        """An MTP block: its nextn extras, then a MoE layer (with an indexer if it carries one)."""
        pre = f"model.layers.{i}."
        for suf in [s for s in present if s in _NEXTN]:
            self._plain(present.pop(suf), pre + _NEXTN[suf], suf)
        kind = "full" if any(s.startswith("indexer.") for s in present) else "none"
        self._layer(i, present, {**self.cfg, "first_k_dense_replace": 0, "indexer_types": [kind] * (i + 1)})

    def _layer(self, i: int, present: dict[str, str], cfg: dict | None = None) -> None:
        req, opt = _layer_expectations(cfg or self.cfg, i)
        missing = sorted(req - set(present))
        if missing:
            raise GGUFError(
                f"{self.gf.path}: missing tensor 'blk.{i}.{missing[0]}' (needed for {self._hf_hint(i, missing[0])})"
            )
        extra = sorted(set(present) - req - opt)
        if extra:
            raise GGUFError(
                f"{self.gf.path}: unexpected tensor 'blk.{i}.{extra[0]}' "
                f"(not part of layer {i} for this config: {self._layer_kind(i)})"
            )
        pre = f"model.layers.{i}."
        if _is_kda(cfg or self.cfg, i):
            self._kda_layer(pre, present)
            return
        for suf, gname in present.items():
            if suf in _EXPERTS:
                self._experts(i, suf, gname)
            elif suf not in (_K_B, _V_B, _KV_B):
                self._plain(gname, pre + _LAYER[suf], suf)
        self._kv_b(i, present)

    def _kda_layer(self, pre: str, present: dict[str, str]) -> None:
        """A KDA layer: its attention tensors by _KDA (shapes from the KDA widths), its MLP as any layer's."""
        for suf, gname in present.items():
            if suf in _EXPERTS:
                self._experts(int(pre.split(".")[2]), suf, gname)
            elif suf in _CONV:
                self._conv(gname, pre + _KDA[suf], suf)
            elif suf in _KDA:
                info = self._check_shape(gname, suf, self.kda_shapes)
                if suf == "ssm_a":  # A = -exp(A_log) as the converter stores it: must be negative to invert
                    a = self.gf.tensor(gname)
                    if not bool((a < 0).all()):
                        raise GGUFError(
                            f"{self.gf.path}: tensor '{gname}' must be negative everywhere (llama.cpp stores "
                            f"A = -exp(A_log)); its largest value is {float(a.max()):g}"
                        )
                    self.entries[pre + _KDA[suf]] = _Entry("a_log", (gname,), info.shape)
                else:
                    self.entries[pre + _KDA[suf]] = _Entry("plain", (gname,), info.shape)
                self.consumed.add(gname)
            else:
                self._plain(gname, pre + _LAYER[suf], suf)

    def _conv(self, gname: str, hf: str, key: str) -> None:
        """A depthwise conv: [1, W, 1, K] as the converter writes it, or the 3-D [W, 1, K]; read as [W, 1, K]."""
        info = self.gf.tensors[gname]
        _, W, _, K = self.kda_shapes[key]
        if info.shape not in ((1, W, 1, K), (W, 1, K)):
            raise GGUFError(
                f"{self.gf.path}: tensor '{gname}' has shape {list(info.shape)} (ggml ne {list(info.ne)}), "
                f"expected {[1, W, 1, K]} (or {[W, 1, K]}) from the config (linear_num_heads * linear_head_dim, "
                f"linear_conv_kernel_dim)"
            )
        self.entries[hf] = _Entry("reshape", (gname,), (W, 1, K))
        self.consumed.add(gname)

    def _layer_kind(self, i: int) -> str:
        if _is_kda(self.cfg, i):
            return f"KDA layer (gguf:attention.head_count_kv[{i}] = 0), {'dense MLP' if i < self.cfg['first_k_dense_replace'] else 'MoE'}"
        q = f"q_lora_rank={self.cfg['q_lora_rank']}"
        mlp = "dense MLP" if i < self.cfg["first_k_dense_replace"] else "MoE"
        return f"{q}, {mlp}, n_shared_experts={self.cfg['n_shared_experts']}"

    def _hf_hint(self, i: int, suf: str) -> str:
        if _is_kda(self.cfg, i) and suf in _KDA:
            return f"model.layers.{i}.{_KDA[suf]}"
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
            raise GGUFError(
                f"{self.gf.path}: missing tensor 'blk.{i}.{_K_B}' + 'blk.{i}.{_V_B}' "
                f"(or a fused 'blk.{i}.{_KV_B}'), needed for model.layers.{i}.self_attn.kv_b_proj.weight"
            )
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
                f"= {[H, L, n]} (llama.cpp stores attn_k_b transposed per head, ggml ne = [{n}, {L}, {H}])"
            )
        self._check_shape(name, _K_B)

    def _check_v_b(self, name: str) -> None:
        H, L, v = self.cfg["num_attention_heads"], self.cfg["kv_lora_rank"], self.cfg["v_head_dim"]
        got = self.gf.tensors[name].shape
        if got == (H, L, v) and v != L:
            raise GGUFError(
                f"{self.gf.path}: tensor '{name}' is stored the wrong way round: torch shape {list(got)} = "
                f"[heads, kv_lora_rank={L}, v_head_dim={v}], expected [heads, v_head_dim, kv_lora_rank] = {[H, v, L]}"
            )
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

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the file so far (GGUFFile.raw's count)."""
        return self._gf.bytes_read

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

    def ggml_type(self, name: str) -> int:
        """The stored ggml type id of an HF tensor (kv_b_proj rebuilt from k_b/v_b: attn_k_b's)."""
        return self._gf.tensors[self._entry(name).sources[0]].ggml_type

    def rebuilt(self, name: str) -> bool:
        """True for a tensor made from several GGUF tensors (kv_b_proj from attn_k_b + attn_v_b):
        it has no stored bytes of its own, only a dequantized value."""
        return self._entry(name).kind == "kv_b_split"

    def get_blocks(self, name: str, mapped: bool = False) -> torch.Tensor:
        """The stored bytes of an HF tensor as uint8 [rows, R] (R = bytes of one row of ggml blocks),
        a view of the file; a routed expert's slice of its stack. Nothing is converted. mapped: a view of
        the read-only shared map, to be kept in place (GGUFFile.view); else of the private map, to be
        copied (and its pages released)."""
        e = self._entry(name)
        if e.kind == "kv_b_split":
            raise GGUFError(f"{self.where(name)}: {name!r} is rebuilt from two tensors; it has no stored blocks")
        info = self._gf.info(e.sources[0])
        rows = math.prod(e.shape[:-1])
        per_row = info.nbytes // math.prod(info.shape[:-1])
        start = e.index * rows * per_row if e.kind == "expert" else 0
        read = self._gf.view if mapped else self._gf.raw
        return read(e.sources[0], start, rows * per_row).view(rows, per_row)

    def stacked_blocks(self, names: list[str], mapped: bool = False) -> torch.Tensor | None:
        """The stored bytes of a whole routed-expert stack [E, rows, R] when `names` are experts 0..E-1
        of one stored 3-D tensor, in order (as llama.cpp's merged ffn_*_exps are); else None."""
        entries = [self._entries.get(n) for n in names]
        if not entries or any(e is None or e.kind != "expert" for e in entries):
            return None
        src = entries[0].sources[0]
        info = self._gf.info(src)
        if any(e.sources[0] != src or e.index != i for i, e in enumerate(entries)) or len(entries) != info.shape[0]:
            return None
        rows = math.prod(entries[0].shape[:-1])
        per_row = info.nbytes // math.prod(info.shape[:-1])
        read = self._gf.view if mapped else self._gf.raw
        return read(src, 0, info.nbytes).view(len(entries), rows, per_row)

    def release(self, name: str) -> None:
        """The loader has copied this tensor: drop its file pages (a routed expert: its slice only, as
        the stack's other experts are still to be read)."""
        e = self._entry(name)
        if e.kind != "expert":
            for src in e.sources:
                self._gf.release(src)
            return
        info = self._gf.info(e.sources[0])
        per_expert = info.nbytes // info.shape[0]
        self._gf.release(e.sources[0], e.index * per_expert, per_expert)

    def get(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        if e.kind == "plain":
            return self._gf.tensor(e.sources[0])
        if e.kind == "expert":
            return self._gf.slice0(e.sources[0], e.index)
        if e.kind == "reshape":
            return self._gf.tensor(e.sources[0]).reshape(e.shape)
        if e.kind == "a_log":  # checked negative at open
            return torch.log(-self._gf.tensor(e.sources[0]).reshape(e.shape))
        k_b, v_b = (self._gf.tensor(s) for s in e.sources)
        return _join_kv_b(k_b, v_b)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a 2-D tensor (a tensor-parallel rank's
        part), dequantizing only those blocks. A row is a whole number of blocks, so rows are one
        byte range; columns that start or stop inside a block dequantize the blocks covering them,
        then narrow (the values are the same as the whole tensor's). kv_b (rebuilt from k_b / v_b) is
        rebuilt whole, then narrowed."""
        e = self._entry(name)
        if e.kind in ("kv_b_split", "reshape", "a_log") or len(e.shape) != 2:
            return self.get(name).narrow(dim, start, stop - start)
        info = self._gf.info(e.sources[0])
        rows, cols = e.shape
        row_bytes = info.nbytes // math.prod(info.shape[:-1])
        base = e.index * rows * row_bytes if e.kind == "expert" else 0
        if dim == 0:
            raw = self._gf.raw(e.sources[0], base + start * row_bytes, (stop - start) * row_bytes)
            return dequantize(raw, info.ggml_type, (stop - start, cols))
        t = GGML_TYPES[info.ggml_type]
        # the blocks that cover [start, stop): a slice that starts or stops inside a block (a rank's
        # columns of a K-quant's 256-value blocks) dequantizes those blocks whole, then narrows
        b0, b1 = start // t.block_size, -(-stop // t.block_size)
        raw = self._gf.raw(e.sources[0], base, rows * row_bytes).view(rows, row_bytes)
        part = raw[:, b0 * t.type_size : b1 * t.type_size]
        full = dequantize(part.contiguous(), info.ggml_type, (rows, (b1 - b0) * t.block_size))
        lo = start - b0 * t.block_size
        return full[:, lo : lo + stop - start].contiguous() if (lo or b1 * t.block_size != stop) else full

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

    def mla_split_blocks(
        self, layer: int, mapped: bool = False
    ) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]] | None:
        """The stored bytes of attn_k_b ([H, L, R_n] uint8, rows of n values) and attn_v_b ([H, v, R_L])
        with their ggml type ids, views of the file (mapped: of the read-only shared map, see get_blocks);
        None where the file stores a fused attn_kv_b."""
        src = self._mla_sources(layer)
        if "k_b" not in src:
            return None
        out = []
        for key in ("k_b", "v_b"):
            info = self._gf.info(src[key])
            lead = tuple(info.shape[:-1])
            per_row = info.nbytes // math.prod(lead)
            read = self._gf.view if mapped else self._gf.raw
            out.append((read(src[key], 0, info.nbytes).view(*lead, per_row), info.ggml_type))
        return out[0], out[1]

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
    kv = (c @ kv_b.T).reshape(5, H, -1).transpose(0, 1)  # decompressed [H, T, n+v]
    s_dec = q @ kv[..., :n].transpose(1, 2)
    s_abs = (q @ w_uk.transpose(1, 2)) @ c.T  # q_lat[h] = W_UK[h] q[h]
    p = torch.softmax(s_dec / math.sqrt(n), dim=-1)
    o_dec = p @ kv[..., n:]
    o_abs = (p @ c) @ w_uv.transpose(1, 2)  # o[h] = W_UV[h] (P c)
    for what, a, b in (("scores", s_abs, s_dec), ("outputs", o_abs, o_dec)):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not err <= MLA_CHECK_RTOL:
            src = tensors._mla_sources(layer)
            raise GGUFError(
                f"{gf.path}: layer {layer}: MLA absorbed vs decompressed attention {what} differ "
                f"(relative error {err:.2e}) between {sorted(src.values())} and "
                f"{list(tensors.sources(kv_name))}"
            )


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


def load_gguf(path: str | Path, validate_numeric: bool = True, with_mtp: bool = False) -> GGUFCheckpoint:
    """Open an MLA GGUF model (any shard of a split model) and map it to HF naming.
    with_mtp: map the nextn (MTP) blocks to model.layers.N.* too (else they are skipped and listed).

    Raises GGUFError on malformed files, missing required keys/tensors, unknown tensors,
    shape mismatches, a wrongly oriented attn_k_b/attn_v_b, or a failed MLA identity check.
    """
    gf = open_gguf(path)
    cfg, prov = derive_hf_config(gf)
    mapper = _Mapper(gf, cfg, with_mtp)
    mapper.run()
    tensors = GGUFTensors(gf, cfg, mapper.entries, mapper.mla)
    if validate_numeric:
        for layer in sorted(mapper.mla):
            _mla_identity_check(gf, tensors, layer)
    return GGUFCheckpoint(
        gf.path,
        gf,
        gf.metadata["general.architecture"],
        cfg,
        prov,
        tensors,
        mapper.skipped,
        GGUFTokenizer.from_metadata(gf),
    )

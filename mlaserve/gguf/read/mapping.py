"""The tensor mapping of an MLA GGUF (llama.cpp's names) to the HF Hub checkpoint names: every GGUF tensor gets
exactly one consumer, each shape is checked against the config, and a missing, unknown or misshapen tensor is a
GGUFError naming it. `TensorMapper(gf, cfg).run()` leaves `entries` (HF name -> Entry: how to read it from which
GGUF tensors), `mla` (per layer the k_b / v_b / fused kv_b sources) and `skipped` (MTP blocks not mapped);
gguf/read/checkpoint.py's GGUFTensors reads the tensors through them.

Notation (per layer): H heads, L = kv_lora_rank, n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim,
E routed experts; torch shapes outermost first (= reversed ggml ne).
    attn_k_b  torch [H, L, n]  (= the k rows of kv_b_proj per head, transposed)
    attn_v_b  torch [H, v, L]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlaserve.gguf.read.file import GGUFError, GGUFFile, TensorInfo

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
class Entry:
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
    """torch shape of every KDA tensor (by layer suffix); the conv's alternatives are checked by TensorMapper._conv."""
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


class TensorMapper:
    """Assigns every GGUF tensor exactly one consumer and checks shapes."""

    def __init__(self, gf: GGUFFile, cfg: dict, with_mtp: bool = False):
        self.gf, self.cfg, self.with_mtp = gf, cfg, with_mtp
        self._arch = gf.metadata["general.architecture"]
        self.shapes = _expected_shapes(cfg)
        self.kda_shapes = _kda_shapes(cfg) if "linear_head_dim" in cfg else {}
        self.entries: dict[str, Entry] = {}
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
        self.entries[hf] = Entry("plain", (gname,), info.shape)
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
                    self.entries[pre + _KDA[suf]] = Entry("a_log", (gname,), info.shape)
                else:
                    self.entries[pre + _KDA[suf]] = Entry("plain", (gname,), info.shape)
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
        self.entries[hf] = Entry("reshape", (gname,), (W, 1, K))
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
            self.entries[hf] = Entry("expert", (gname,), info.shape[1:], e)
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
            self.entries[hf] = Entry("kv_b_split", (kb, vb), self.shapes[_KV_B])

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

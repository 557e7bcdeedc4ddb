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

The metadata becomes the config in gguf/read/deepseek_v4_config.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.gguf.read.config import Provenance
from mlaserve.gguf.read.deepseek_v4_config import ARCH, derive_v4_config, v4_config
from mlaserve.gguf.read.file import GGUFError, GGUFFile, open_gguf
from mlaserve.gguf.read.tokenizer import GGUFTokenizer
from mlaserve.loading.deepseek_v4_names import target

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

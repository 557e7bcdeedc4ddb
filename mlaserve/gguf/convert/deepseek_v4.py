"""A DeepSeek-V4 Hugging Face folder -> a GGUF file in llama.cpp's `deepseek4` layout, as its converter
(convert_hf_to_gguf.py, class DeepseekV4Model) writes it, so llama.cpp and `load_v4_gguf` read it.

Notation: n main layers, E routed experts, I expert width, D hidden, V vocabulary, k experts per token. Shapes
are torch order (outermost first; GGUF's ne is the reverse).

Names: one table. gguf/read/deepseek_v4.py maps `blk.N.*` to the release's names and those to the modules;
`gguf_names` reads that table backwards, and every source name (release, save_pretrained or module layout) is
mapped onto its module tensor by loading/deepseek_v4_names.target, then to its GGUF name.
    ffn.experts.e.w1 / w3 / w2 (or a module-layout gate_up_proj / down_proj stack) -> ffn_{gate,up,down}_exps
    [E, I, D] / [E, D, I], stacked one expert at a time; ffn.gate.tid2eid [V, k] -> ffn_gate_tid2eid (I32).
Order as llama.cpp's converter: the hash layers' tid2eid, then each layer's expert stacks (gate, down, up),
then every other tensor in the checkpoint's order. The MTP layer (mtp.*) is dropped, as llama.cpp's
converter drops it (and says so): block_count is n and no nextn key is written.

Types (llama.cpp's converter and quantizer):
    F32: 1-D tensors, `*_norm`, names not ending in `.weight` (exp_probs_b.bias), the mHC tensors (hc_*,
        output_hc_*: the reference keeps them in fp32), the compressors' ape, the router ffn_gate_inp
    I32: ffn_gate_tid2eid
    DeepSeek FP8 blocks (weight_scale_inv): dequantized, then Q8_0 (llama.cpp's tensor_force_quant)
    FP4 routed experts with power-of-two (ue8m0) group-32 scales: repacked into ggml MXFP4 blocks, no value
        changed (llama.cpp's _pack_mxfp4_blocks: the scale's e8m0 byte, the 32 codes reordered so value j is
        the low nibble of byte j and value j + 16 its high nibble; ggml's MXFP4 table is twice e2m1's and its
        scale 2^(e-128), the same products)
    otherwise the outtype, Q8_0 falling back to F16 for rows that are not whole 32-blocks.
Metadata: the keys DeepseekV4Model.set_gguf_parameters and TextModel's write (attention, compression, mHC,
MoE, hash layers, the compressed layers' YaRN table), general.*, and the tokenizer's. What llama.cpp's
`deepseek4` cannot say is refused with the field named: a CSA ratio other than 4 (its graph gives exactly the
layers of ratio 4 an indexer), an HCA ratio of 4, hash layers that are not the leading ones, YaRN on the main
table, a tied head.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mlaserve.config.deepseek_v4 import DeepseekV4Config
from mlaserve.config.families.deepseek_v4 import DEEPSEEK_V4
from mlaserve.config.model import ConfigError
from mlaserve.gguf.convert.metadata import FILE_TYPES, GGML_QUANT_VERSION, OUTTYPES, size_label, title_name
from mlaserve.gguf.convert.plan import ConvertReport, Plan, rows
from mlaserve.gguf.convert.tokenizer import ConvertError, tokenizer_keys
from mlaserve.gguf.convert.writer import (
    F16,
    F32,
    FLOAT32,
    I32,
    INT32,
    MXFP4,
    Q8_0,
    GGUFWriter,
    MetaValue,
    array,
    boolean,
    can_quantize,
    f32,
    string,
    u32,
)
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.gguf.read.deepseek_v4 import _expected, gguf_names, load_v4_gguf
from mlaserve.gguf.read.deepseek_v4_config import ARCH, CSA_RATIO, SQRT_SOFTPLUS
from mlaserve.loading.deepseek_v4_names import SCALE, target
from mlaserve.loading.safetensors_source import SafetensorsSource, WeightError
from mlaserve.quant import fp4_group, fp8_block

__all__ = ["convert_v4", "v4_tensor_type"]

MOSTLY_MXFP4_MOE = 38  # llama_ftype llama.cpp's converter writes when it repacks the FP4 experts
_KEEP_F32 = re.compile(r"(^|\.)(output_)?hc_|_ape\.weight$|(^|\.)ffn_gate_inp\.weight$")
_PARTS = {"w1": "gate", "w2": "down", "w3": "up"}


def v4_tensor_type(gguf_name: str, shape: tuple[int, ...], outtype: str, stored: str = "float") -> int:
    """The ggml type of a deepseek4 tensor (module doc). stored: "float", "fp8" (DeepSeek FP8 blocks) or
    "mxfp4" (FP4 experts with power-of-two scales)."""
    if gguf_name.endswith("tid2eid.weight"):
        return I32
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return F32
    if _KEEP_F32.search(gguf_name):
        return F32
    if stored == "mxfp4":
        return MXFP4
    t = Q8_0 if stored == "fp8" else OUTTYPES[outtype]
    return t if can_quantize(t, shape[-1]) else F16


# =============================================================================================
# the folder's tensors


class _V4Source:
    """The folder's tensors by name: float ones as stored; DeepSeek FP8 ones (`<name>.weight_scale_inv`, e4m3)
    dequantized by the reference dequantizer; FP4 experts (int8, two e2m1 codes a byte, group-32 scales)
    either as MXFP4 blocks (`mxfp4`) or dequantized."""

    def __init__(self, folder: Path, raw: dict):
        self.folder, self.st = folder, SafetensorsSource(folder)
        names = self.st.names()
        self.scales = {n.removesuffix(SCALE) + ".weight" for n in names if n.endswith(SCALE)}
        self.names = [n for n in names if not n.endswith(SCALE)]
        qc = raw.get("quantization_config") or {}
        self.block = tuple(qc.get("weight_block_size") or (128, 128))

    def stored(self, name: str) -> str:
        if name not in self.scales:
            return "float"
        if self.st.get(name).dtype == torch.int8:
            return "mxfp4" if self._pow2(name) and self.st.shape(name)[-1] * 2 % 32 == 0 else "fp4"
        return "fp8"

    def _scale(self, name: str) -> torch.Tensor:
        return self.st.get(name.removesuffix(".weight") + SCALE)

    def _pow2(self, name: str) -> bool:
        s = self._scale(name)
        if s.dtype == torch.float8_e8m0fnu:
            return True
        m, _ = torch.frexp(s.float())
        return bool(((m == 0.5) & (s > 0)).all())

    def get(self, name: str) -> torch.Tensor:
        """The values as float32 (or the stored integers of tid2eid)."""
        t = self.st.get(name)
        if name not in self.scales:
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise ConvertError(f"{self.st.where(name)}: {name} is {t.dtype} without a '{name}_scale_inv'")
            return t
        s = self._scale(name).float()
        if t.dtype == torch.int8:
            return fp4_group.dequantize_reference(t, s)
        return fp8_block.dequantize_reference(t, s, self.block)

    def mxfp4(self, name: str) -> torch.Tensor:
        """FP4 codes [N, K/2] + power-of-two scales [N, K/32] -> ggml MXFP4 blocks uint8 [N, K/32 * 17]."""
        p = self.st.get(name).view(torch.uint8)
        s = self._scale(name)
        e = s.view(torch.uint8) if s.dtype == torch.float8_e8m0fnu else (torch.log2(s.float()) + 127).to(torch.uint8)
        n, blocks = p.shape[0], p.shape[1] * 2 // 32
        codes = fp4_group.unpack_codes(p).reshape(n, blocks, 32)
        qs = codes[..., :16] | (codes[..., 16:] << 4)
        return torch.cat([e.reshape(n, blocks, 1), qs], dim=-1).reshape(n, blocks * 17)


# =============================================================================================
# metadata


def _refuse(where: str, msg: str) -> None:
    raise ConvertError(f"{where}: {msg}, which llama.cpp's {ARCH} layout cannot store")


def _check_layout(cfg: DeepseekV4Config, where: str) -> None:
    kinds, c = cfg.layer_kinds, cfg.compression
    if "csa" in kinds and c.csa_ratio != CSA_RATIO:
        _refuse(where, f"compress_rates CSA ratio {c.csa_ratio} (llama.cpp's graph: exactly ratio {CSA_RATIO})")
    if "hca" in kinds and c.hca_ratio in (0, CSA_RATIO):
        _refuse(where, f"HCA ratio {c.hca_ratio} (read back as {'sliding' if not c.hca_ratio else 'CSA'})")
    hashed = cfg.mlp_layer_types.count("hash_moe")
    if any(t != "hash_moe" for t in cfg.mlp_layer_types[:hashed]):
        _refuse(where, f"mlp_layer_types {list(cfg.mlp_layer_types)} (hash layers after a learned one)")
    if cfg.rope.main.rope_type != "default":
        _refuse(where, f"rope type {cfg.rope.main.rope_type!r} on the main table (YaRN on the compressed one only)")
    if cfg.tie_word_embeddings:
        _refuse(where, "tie_word_embeddings true (the layout has its own output.weight)")


def _v4_keys(cfg: DeepseekV4Config) -> list[tuple[str, MetaValue]]:
    """The deepseek4.* keys, in the order llama.cpp's converter writes them."""
    a, at, c, moe, hc = ARCH, cfg.attention, cfg.compression, cfg.moe, cfg.hc
    n = cfg.num_layers
    ratio = {"sliding": 0, "csa": c.csa_ratio, "hca": c.hca_ratio}
    limit = float(np.float32(moe.swiglu_limit))  # an array is stored as float32 (the reader reads 0.3 back as 0.3)
    out = [
        (f"{a}.block_count", u32(n)),
        (f"{a}.context_length", u32(cfg.max_position_embeddings)),
        (f"{a}.embedding_length", u32(cfg.hidden_size)),
        (f"{a}.vocab_size", u32(cfg.vocab_size)),
        (f"{a}.attention.head_count", u32(at.num_heads)),
        (f"{a}.attention.head_count_kv", u32(1)),
        (f"{a}.attention.key_length", u32(at.head_dim)),
        (f"{a}.attention.value_length", u32(at.head_dim)),
        (f"{a}.attention.layer_norm_rms_epsilon", f32(cfg.rms_norm_eps)),
        (f"{a}.rope.freq_base", f32(cfg.rope.main.theta)),
        (f"{a}.rope.dimension_count", u32(at.rope_dim)),
    ]
    comp = cfg.rope.compress
    if comp.rope_type == "yarn":  # llama.cpp applies it to the compressed layers' table only
        out += [
            (f"{a}.rope.scaling.type", string("yarn")),
            (f"{a}.rope.scaling.factor", f32(comp.factor)),
            (f"{a}.rope.scaling.original_context_length", u32(comp.original_max_position_embeddings)),
            (f"{a}.rope.scaling.yarn_beta_fast", f32(comp.beta_fast)),
            (f"{a}.rope.scaling.yarn_beta_slow", f32(comp.beta_slow)),
        ]
    out += [
        (f"{a}.attention.q_lora_rank", u32(at.q_lora_rank)),
        (f"{a}.attention.sliding_window", u32(at.sliding_window)),
        (f"{a}.expert_count", u32(moe.n_routed_experts)),
        (f"{a}.expert_used_count", u32(moe.num_experts_per_tok)),
        # llama.cpp's loader requires it (4, sqrt-softplus: the only routing its deepseek4 graph runs); its
        # converter writes it from config.json's scoring_func (TextModel.set_gguf_parameters)
        (f"{a}.expert_gating_func", u32(SQRT_SOFTPLUS)),
        (f"{a}.expert_feed_forward_length", u32(moe.moe_intermediate_size)),
        (f"{a}.expert_shared_count", u32(moe.n_shared_experts)),
        (f"{a}.expert_weights_scale", f32(moe.routed_scaling_factor)),
        (f"{a}.expert_weights_norm", boolean(True)),  # V4's router always renormalises its top-k
        (f"{a}.swiglu_clamp_exp", array([limit] * n, FLOAT32)),
        (f"{a}.swiglu_clamp_shexp", array([limit] * n, FLOAT32)),
        (f"{a}.attention.indexer.head_count", u32(c.index_n_heads)),
        (f"{a}.attention.indexer.key_length", u32(c.index_head_dim)),
        (f"{a}.attention.indexer.top_k", u32(c.index_topk)),
        (f"{a}.attention.output_group_count", u32(at.o_groups)),
        (f"{a}.attention.output_lora_rank", u32(at.o_lora_rank)),
        (f"{a}.attention.compress_ratios", array([ratio[k] for k in cfg.layer_kinds], INT32)),
        (f"{a}.attention.compress_rope_freq_base", f32(comp.theta)),
        (f"{a}.hyper_connection.count", u32(hc.hc_mult)),
        (f"{a}.hyper_connection.sinkhorn_iterations", u32(hc.sinkhorn_iters)),
        (f"{a}.hyper_connection.epsilon", f32(hc.eps)),
        (f"{a}.hash_layer_count", u32(cfg.mlp_layer_types.count("hash_moe"))),
        (f"{a}.embedding_length_out", u32(cfg.hidden_size * hc.hc_mult)),  # the mHC streams' width
    ]
    return out


# =============================================================================================
# tensors


class _V4Planner:
    """Source names -> the GGUF tensors to write (module doc: names, order), each with its stored form."""

    def __init__(self, cfg: DeepseekV4Config, src: _V4Source):
        self.cfg, self.src = cfg, src
        self.modules = _expected(cfg)  # the model's tensors and shapes, built on the meta device
        self.module_set = set(self.modules)
        self.names = gguf_names(cfg.num_layers, set(self.modules))
        self.skipped: list[str] = []
        self.stored: dict[str, str] = {}  # GGUF name -> "float" | "fp8" | "fp4" | "mxfp4"

    def run(self) -> list[Plan]:
        hashes, experts, plain = [], {}, []
        for name in self.src.names:
            try:
                t = target(name, self.module_set)
            except WeightError as e:
                raise ConvertError(f"{self.src.st.where(name)}: {e} (no {ARCH} name for it)") from None
            if t is None:  # the MTP layer: the model built without it, as llama.cpp's converter drops it
                self.skipped.append(name)
                continue
            if t.expert is not None:
                experts.setdefault(self.names[(t.name, t.part)], {})[t.expert] = name
                continue
            if t.name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts.setdefault(self.names[(t.name, "w1" if "gate_up" in t.name else "w2")], {})[-1] = name
                continue
            gguf = self.names.get((t.name, None))
            if gguf is None or t.name not in self.modules:
                raise ConvertError(
                    f"{self.src.st.where(name)}: {name!r} fills no tensor of the model config.json builds"
                )
            self._check(name, self.src.st.shape(name), self.modules[t.name], gguf)
            (hashes if gguf.endswith("tid2eid.weight") else plain).append(self._plain(gguf, name))
        stacks = self._stacks(experts)
        return hashes + stacks + plain

    def _check(self, name: str, got, want, gguf: str) -> None:
        if self.src.stored(name) in ("fp4", "mxfp4"):
            got = (*got[:-1], got[-1] * 2)  # two codes a byte
        if tuple(got) != tuple(want):
            raise ConvertError(
                f"{self.src.st.where(name)}: {name} has shape {list(got)}, {gguf} needs {list(want)} (config.json)"
            )

    def _plain(self, gguf: str, name: str) -> Plan:
        self.stored[gguf] = self.src.stored(name)
        shape = tuple(self.modules[target(name, self.module_set).name])
        if gguf.endswith("tid2eid.weight"):
            return Plan(gguf, shape, lambda: iter([self.src.get(name)]))
        return Plan(gguf, shape, lambda: rows(self.src.get(name)))

    def _stacks(self, experts: dict[str, dict[int, str]]) -> list[Plan]:
        n_exp = self.cfg.moe.n_routed_experts
        out = []
        for i in range(self.cfg.num_layers):
            for part in ("gate", "down", "up"):  # llama.cpp's order: w1, w2, w3
                gguf = f"blk.{i}.ffn_{part}_exps.weight"
                by = experts.pop(gguf, None)
                if by is None:
                    raise ConvertError(f"{self.src.folder}: no routed expert tensors for {gguf} (layer {i})")
                out.append(self._stack(gguf, by, n_exp))
        return out

    def _stack(self, gguf: str, by: dict[int, str], n_exp: int) -> Plan:
        if -1 in by:  # the module layout: one stacked tensor (gate_up_proj holds gate and up)
            raise ConvertError(
                f"{self.src.st.where(by[-1])}: {by[-1]}: a stacked expert tensor; convert a folder in the release's "
                "or save_pretrained's per-expert layout"
            )
        if sorted(by) != list(range(n_exp)):
            missing = sorted(set(range(n_exp)) - set(by))
            raise ConvertError(
                f"{self.src.folder}: {gguf}: experts {missing or sorted(by)} missing or extra "
                f"(n_routed_experts={n_exp}; e.g. {by[min(by)]})"
            )
        names = [by[e] for e in range(n_exp)]
        forms = {self.src.stored(n) for n in names}
        if len(forms) != 1:
            raise ConvertError(f"{self.src.folder}: {gguf}: the experts are stored in different forms {sorted(forms)}")
        form = forms.pop()
        inter, hidden = self.cfg.moe.moe_intermediate_size, self.cfg.hidden_size
        want = (hidden, inter) if "_down_" in gguf else (inter, hidden)
        for n in names:
            self._check(n, self.src.st.shape(n), want, gguf)
        self.stored[gguf] = form

        def chunks() -> Iterator[torch.Tensor]:
            for n in names:  # one expert at a time: the stack is never built in memory
                if form == "mxfp4":
                    yield self.src.mxfp4(n)
                else:
                    yield from rows(self.src.get(n))

        return Plan(gguf, (n_exp, *want), chunks)


# =============================================================================================
# entry point


def convert_v4(
    folder: Path, raw: dict, out_path: str | Path, outtype: str, name: str | None, pre_tokenizer: str | None
) -> ConvertReport:
    """`convert_hf_to_gguf` for a DeepSeek-V4 folder (module doc). The written file is read back with
    `load_v4_gguf` and its config must equal the folder's (else an error naming the field that differs)."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    where = f"{folder}/config.json"
    try:
        cfg = DeepseekV4Config.from_hf(raw, source=where)
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    _check_layout(cfg, where)
    planner = _V4Planner(cfg, _V4Source(folder, raw))
    plans = {p.name: p for p in planner.run()}
    mxfp4 = any(s == "mxfp4" for s in planner.stored.values())
    shapes = {p.name: p.shape for p in plans.values()}
    meta = [
        ("general.architecture", string(ARCH)),
        ("general.type", string("model")),
        ("general.name", string(name or title_name(folder.resolve().name))),
        ("general.size_label", string(size_label(shapes))),
        *_v4_keys(cfg),
        ("general.file_type", u32(MOSTLY_MXFP4_MOE if mxfp4 else FILE_TYPES[outtype])),
        ("general.quantization_version", u32(GGML_QUANT_VERSION)),
        *tokenizer_keys(folder, raw, DEEPSEEK_V4.tokenizer_specials, cfg.vocab_size, pre_tokenizer),
    ]
    writer = GGUFWriter(out_path)
    for key, value in meta:
        writer.add(key, value)
    for p in plans.values():
        writer.add_tensor(p.name, p.shape, v4_tensor_type(p.name, p.shape, outtype, planner.stored[p.name]))
    writer.write(lambda spec: plans[spec.name].chunks())
    report = ConvertReport(Path(out_path), ARCH, outtype, skipped=planner.skipped)
    report.tensors = {t.name: GGML_TYPES[t.ggml_type].name for t in writer.tensors}
    if planner.skipped:
        report.notes.append(
            f"dropped {len(planner.skipped)} MTP tensor(s) (mtp.*), as llama.cpp's {ARCH} converter does: the file "
            "has no MTP layer (speculative='mtp' needs the folder)"
        )
    forms = sorted({s for s in planner.stored.values() if s != "float"})
    if forms:
        report.notes.append(
            f"stored forms converted: {', '.join(forms)} (fp8 -> Q8_0, FP4 experts -> MXFP4 or dequantized)"
        )
    _check_read_back(report.path, cfg)
    return report


def _check_read_back(path: Path, cfg: DeepseekV4Config) -> None:
    ck = load_v4_gguf(path)
    try:
        got = dataclasses.replace(ck.config, layer_kinds_source=cfg.layer_kinds_source)
        kinds = set(cfg.layer_kinds)  # a ratio no layer uses is not in compress_ratios: the reader's default
        got = dataclasses.replace(
            got,
            compression=dataclasses.replace(
                got.compression,
                csa_ratio=got.compression.csa_ratio if "csa" in kinds else cfg.compression.csa_ratio,
                hca_ratio=got.compression.hca_ratio if "hca" in kinds else cfg.compression.hca_ratio,
            ),
        )
        want = dataclasses.replace(cfg, bos_token_id=got.bos_token_id, eos_token_ids=got.eos_token_ids)
        want = dataclasses.replace(want, num_nextn_predict_layers=0, mtp_layer_kinds=())
        for f in dataclasses.fields(want):
            if f.compare and getattr(got, f.name) != getattr(want, f.name):
                path.unlink()  # not the folder's model: no file rather than a wrong one
                raise ConvertError(
                    f"{path}: read back, '{f.name}' is {getattr(got, f.name)!r}, the folder's {getattr(want, f.name)!r}"
                    f" (the {ARCH} metadata cannot say it)"
                )
    finally:
        ck.close()

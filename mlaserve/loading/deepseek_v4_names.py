"""DeepSeek-V4 checkpoint names -> models/deepseek_v4's module tree (transformers' DeepseekV4ForCausalLM names):
the released layout, transformers' save_pretrained names and the module names themselves (loading/deepseek_v4.py
lists them). Plain name arithmetic, shared by the folder loader, the deepseek4 GGUF reader (gguf/read/deepseek_v4.py)
and its holders' plan (quant/ggml_deepseek_v4.py), which therefore need not import the loader."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlaserve.loading.safetensors_source import WeightError

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias"}
_COMPRESSOR |= {"norm.weight": "kv_norm.weight", "kv_norm.weight": "kv_norm.weight"}
_LAYER = {
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_LAYER |= {f"hc_{s}_{p}": f"{s}_hc.{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
_LAYER |= {f"attn.compressor.{k}": f"self_attn.compressor.{v}" for k, v in _COMPRESSOR.items()}
_LAYER |= {f"attn.indexer.compressor.{k}": f"self_attn.compressor.indexer.{v}" for k, v in _COMPRESSOR.items()}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
# the MTP layer's own tensors (models/deepseek_v4/mtp.py); its block uses _LAYER's names
_MTP = {f"{k}.weight": f"{k}.weight" for k in ("e_proj", "h_proj", "enorm", "hnorm", "norm")}
_MTP |= {f"hc_head_{p}": f"hc_head.hc_{p}" for p in ("fn", "base", "scale")}
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter or buffer name, and for a released expert projection its
    expert and which part (w1 gate rows, w3 up rows of gate_up_proj; w2 down_proj)."""

    name: str
    expert: int | None = None
    part: str | None = None


SCALE = ".weight_scale_inv"  # DeepSeek FP8 block scales (quant/config.py), beside `<module>.weight`
_EXPERT_SCALE = {"gate_up_proj": "gate_up_scale", "down_proj": "down_scale"}  # quant/deepseek_v4.FP8V4Experts


def target(name: str, module_names: set[str]) -> Target | None:
    """The module tensor a checkpoint name fills; None for an MTP layer the model did not build (skipped:
    speculative decoding off)."""
    if name in module_names:
        return Target(name)
    if name.endswith(SCALE):  # the scale of a weight goes beside that weight's target
        t = target(name.removesuffix(SCALE) + ".weight", module_names)
        if t is None or t.expert is None:
            return t and Target(t.name.removesuffix(".weight") + SCALE)
        layer, _, which = t.name.rpartition(".")
        return Target(f"{layer}.{_EXPERT_SCALE[which]}", t.expert, t.part)
    bare = name[len("model.") :] if name.startswith("model.") else name
    if bare.startswith("mtp."):
        return _mtp_target(bare, module_names)
    if bare in _TOP:
        return Target(_TOP[bare])
    m = _LAYER_RE.match(bare)
    if m:
        layer, rest = m.groups()
        found = _layer_target(f"model.layers.{layer}.", rest)
        if found is not None:
            return found
    raise WeightError(f"unknown DeepSeek-V4 tensor {name!r}")


def _layer_target(prefix: str, rest: str, extra: dict[str, str] | None = None) -> Target | None:
    """A decoder layer's released tensor name (after `layers.N.` or `mtp.j.`) -> its module tensor."""
    if extra and rest in extra:
        return Target(prefix + extra[rest])
    if rest in _LAYER:
        return Target(prefix + _LAYER[rest])
    e = _EXPERT_RE.match(rest)
    if e:
        which = "down_proj" if e.group(2) == "w2" else "gate_up_proj"
        return Target(f"{prefix}mlp.experts.{which}", int(e.group(1)), e.group(2))
    return None


def _mtp_target(bare: str, module_names: set[str]) -> Target | None:
    """mtp.j.* (released names or the module names): the MTP layer j's tensor when the model built it
    (speculative="mtp"), else None (skipped)."""
    m = _MTP_RE.match(bare)
    if m is None:
        raise WeightError(f"unknown DeepSeek-V4 tensor {bare!r} (MTP tensors are named mtp.<j>.*)")
    prefix = f"mtp.{m.group(1)}."
    if prefix + "e_proj.weight" not in module_names:
        return None  # the MTP layer is not built: its tensors are skipped and reported
    if bare in module_names:
        return Target(bare)
    found = _layer_target(prefix, m.group(2), _MTP)
    if found is None:
        raise WeightError(f"unknown DeepSeek-V4 MTP tensor {bare!r}")
    return found

"""GGUF metadata for `gguf_convert`: the checkpoint's config.json -> llama.cpp's key/value pairs
(architecture keys, MLA/MoE/rope/indexer keys, general.*, then the tokenizer's from
`gguf_convert_tokenizer`). The choices that differ from llama.cpp's converter are listed in
`gguf_convert`'s docstring.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaserve.config.families import Family
from mlaserve.config.model import ModelConfig
from mlaserve.gguf.convert.tokenizer import ConvertError, _read_json, tokenizer_keys
from mlaserve.gguf.convert.writer import BF16, BOOL, F16, F32, Q8_0, MetaValue, array, boolean, f32, string, u32

OUTTYPES = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype: ALL_F32, MOSTLY_F16, ...
GGML_QUANT_VERSION = 2
SIGMOID, SOFTMAX = 2, 1  # llama.cpp expert_gating_func values


@dataclass(frozen=True)
class _Model:
    """What the metadata and tensor steps need to know about the checkpoint."""

    folder: Path
    raw: dict[str, Any]  # config.json as written
    cfg: ModelConfig  # the engine's reading of it (class defaults filled in)
    family: Family
    arch: str  # the family's gguf_arch
    n_blocks: int  # block_count: main layers (+ MTP layers where they are kept)

    def setting(self, name: str) -> Any:
        """The value the config reading used (config.json, else the class default)."""
        return next((s.value for s in self.cfg.provenance if s.name == name), None)


def _open_model(folder: Path) -> _Model:
    raw = _read_json(folder / "config.json")
    cfg = ModelConfig.from_hf(raw, source=str(folder / "config.json"))
    family = cfg.family
    if not family.gguf_arch:
        raise ConvertError(
            f"{folder}/config.json: {family.name} has no llama.cpp architecture (gguf-py lists none), so there is "
            "no GGUF layout to write it in"
        )
    if cfg.kda is not None:  # a kimi-linear GGUF is read (gguf/read/mapping.py), not written: no KDA writer
        raise ConvertError(
            f"{folder}/config.json: {family.name} (KDA layers {list(cfg.kda.layers)}) has no GGUF layout this "
            "converter writes"
        )
    if cfg.moe is None:
        raise ConvertError(f"{folder}/config.json: no n_routed_experts -- dense MLA models are not supported")
    n = cfg.num_layers
    n_blocks = n + cfg.num_nextn_predict_layers if family.gguf_keeps_mtp else n
    return _Model(folder, raw, cfg, family, family.gguf_arch, n_blocks)


def _leading_dense(cfg: ModelConfig) -> int:
    types = list(cfg.mlp_layer_types)
    k = types.index("moe") if "moe" in types else len(types)
    if "dense" in types[k:]:  # llama.cpp describes the layout by one count of leading dense layers
        raise ConvertError(f"mlp layer types {types}: dense layers after a MoE layer cannot be stored in GGUF")
    return k


def _rope_params(raw: dict) -> dict:
    """rope_parameters (or legacy rope_scaling) as llama.cpp's converter reads them."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    return params


def _rope_keys(m: _Model) -> list[tuple[str, MetaValue]]:
    a, p, rope = m.arch, _rope_params(m.raw), m.cfg.rope
    out: list[tuple[str, MetaValue]] = []
    if p.get("rope_type") == "yarn" and p.get("factor") is not None:
        out += [
            (f"{a}.rope.scaling.type", string("yarn")),
            (f"{a}.rope.scaling.factor", f32(p["factor"])),
            (f"{a}.rope.scaling.original_context_length", u32(p["original_max_position_embeddings"])),
        ]
        optional = [
            ("extrapolation_factor", "yarn_ext_factor"),
            ("attention_factor", "yarn_attn_factor"),
            ("attn_factor", "yarn_attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ]
        for hf, key in optional:
            if p.get(hf) is not None and f"{a}.rope.scaling.{key}" not in dict(out):
                out.append((f"{a}.rope.scaling.{key}", f32(p[hf])))
    out.append((f"{a}.rope.freq_base", f32(rope.theta)))
    return out


def _gating(m: _Model) -> list[tuple[str, MetaValue]]:
    scoring_keys = (
        "score_function",
        "scoring_func",
        "score_func",
        "moe_router_activation",
        "moe_router_activation_func",
    )
    given = next((m.raw[k] for k in scoring_keys if m.raw.get(k) is not None), None)
    func = m.cfg.moe.scoring_func  # what transformers computes for this family
    if given is not None and given not in ("softmax", "sigmoid"):
        raise ConvertError(f"{m.folder}/config.json: unsupported expert scoring function {given!r}")
    if given is None and func == "softmax":
        return []  # llama.cpp's converter writes nothing; llama.cpp's default is softmax
    return [(f"{m.arch}.expert_gating_func", u32(SIGMOID if func == "sigmoid" else SOFTMAX))]


def _moe_keys(m: _Model) -> list[tuple[str, MetaValue]]:
    a, moe = m.arch, m.cfg.moe
    out = [(f"{a}.expert_count", u32(moe.n_routed_experts)), (f"{a}.expert_used_count", u32(moe.num_experts_per_tok))]
    for name, key in (("n_group", "expert_group_count"), ("topk_group", "expert_group_used_count")):
        if m.setting(name) is not None:
            out.append((f"{a}.{key}", u32(m.setting(name))))
    return out + _gating(m)


def _mla_keys(m: _Model) -> list[tuple[str, MetaValue]]:
    a, c = m.arch, m.cfg
    out = [(f"{a}.leading_dense_block_count", u32(_leading_dense(c))), (f"{a}.vocab_size", u32(c.vocab_size))]
    if c.q_lora_rank is not None:  # V2-Lite style plain q_proj: no key, as llama.cpp
        out.append((f"{a}.attention.q_lora_rank", u32(c.q_lora_rank)))
    out += [
        (f"{a}.attention.kv_lora_rank", u32(c.kv_lora_rank)),
        (f"{a}.attention.key_length_mla", u32(c.qk_nope_head_dim + c.qk_rope_head_dim)),
        (f"{a}.attention.value_length_mla", u32(c.v_head_dim)),
        (f"{a}.expert_feed_forward_length", u32(c.moe.moe_intermediate_size)),
        (f"{a}.expert_shared_count", u32(c.moe.n_shared_experts)),
        (f"{a}.expert_weights_scale", f32(c.moe.routed_scaling_factor)),
    ]
    if c.moe.norm_topk_prob:
        out.append((f"{a}.expert_weights_norm", boolean(True)))
    rope_dim = c.qk_rope_head_dim
    if m.family.gguf_rope_dim_partial:
        rope_dim = int(rope_dim * _rope_params(m.raw).get("partial_rotary_factor", 1.0))
    out.append((f"{a}.rope.dimension_count", u32(rope_dim)))
    mscale_all_dim = _rope_params(m.raw).get("mscale_all_dim")
    if mscale_all_dim is not None:
        # llama.cpp's legacy encoding [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: 0.1 * mscale_all_dim, and
        # its loader divides by 0.1 again
        out.append((f"{a}.rope.scaling.yarn_log_multiplier", f32(0.1 * mscale_all_dim)))
    return out


def _writes_nextn(m: _Model) -> bool:
    """Whether nextn_predict_layers is written: the family's rule, as llama.cpp's converter class."""
    rule = m.family.gguf_nextn_key
    if rule == "if_set":
        return "num_nextn_predict_layers" in m.raw
    if rule == "if_kept":
        return m.n_blocks > m.cfg.num_layers
    return False


def _nextn_indexer_keys(m: _Model) -> list[tuple[str, MetaValue]]:
    a, out = m.arch, []
    if _writes_nextn(m):
        out.append((f"{a}.nextn_predict_layers", u32(m.cfg.num_nextn_predict_layers)))
    ix = m.cfg.indexer
    if ix is not None:
        out += [
            (f"{a}.attention.indexer.head_count", u32(ix.n_heads)),
            (f"{a}.attention.indexer.key_length", u32(ix.head_dim)),
            (f"{a}.attention.indexer.top_k", u32(ix.topk)),
        ]
        if m.family.gguf_indexer_types:
            types = list(ix.layer_types) + ["full"] * (m.n_blocks - len(ix.layer_types))
            out.append((f"{a}.attention.indexer.types", array([t == "full" for t in types[: m.n_blocks]], BOOL)))
    return out


def _model_keys(m: _Model, outtype: str, name: str, label: str | None) -> list[tuple[str, MetaValue]]:
    a, c = m.arch, m.cfg
    out = [("general.architecture", string(a)), ("general.type", string("model")), ("general.name", string(name))]
    if label:
        out.append(("general.size_label", string(label)))
    out += [
        (f"{a}.block_count", u32(m.n_blocks)),
        (f"{a}.context_length", u32(c.max_position_embeddings)),
        (f"{a}.embedding_length", u32(c.hidden_size)),
        (f"{a}.feed_forward_length", u32(c.intermediate_size)),
        (f"{a}.attention.head_count", u32(c.num_heads)),
        (f"{a}.attention.head_count_kv", u32(1)),
    ]  # MLA is run as MQA over the latent cache
    out += _rope_keys(m)
    out.append((f"{a}.attention.layer_norm_rms_epsilon", f32(c.rms_norm_eps)))
    out += _moe_keys(m)
    # the cached "key" is [latent | rope] and the "value" the latent; real head sizes in *_mla
    out += [
        (f"{a}.attention.key_length", u32(c.kv_lora_rank + c.qk_rope_head_dim)),
        (f"{a}.attention.value_length", u32(c.kv_lora_rank)),
        ("general.file_type", u32(FILE_TYPES[outtype])),
    ]
    out += _mla_keys(m) + _nextn_indexer_keys(m)
    out.append(("general.quantization_version", u32(GGML_QUANT_VERSION)))
    return out


def title_name(folder_name: str) -> str:
    """general.name as llama.cpp derives it from a folder name when there is no model card:
    words (split at '-' and spaces) that are all lower case are title-cased, except version-like
    ones ("ds2lite" -> "Ds2Lite", "deepseek-v3" -> "Deepseek v3")."""
    words = folder_name.strip().replace("-", " ").split()
    return " ".join(w.title() if w.islower() and not re.match(r"^(v\d+(?:\.\d+)*|\d.*)$", w) else w for w in words)


def _rounded_count(n: int) -> str:
    """gguf-py's model_weight_count_rounded_notation with min_digits=2 (935_123 -> "935K")."""
    scale, suffix = next(
        ((s, x) for limit, s, x in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")) if n > limit), (1e-3, "K")
    )
    value = n * scale
    digits = max(2 - len(str(round(value)).lstrip("0")), 0)
    return f"{value:.{digits}f}{suffix}"


def size_label(shapes: dict[str, tuple[int, ...]]) -> str:
    """general.size_label as gguf-py computes it: "<E>x<params on one expert path>" for MoE
    models, where a path counts every non-expert tensor plus one expert of each stack."""
    shared = per_expert = expert_sum = stacks = 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        if "_exps." in name and len(shape) >= 3:
            n = shape[-2] if ".bias" in name else shape[0]
            per_expert, expert_sum, stacks = per_expert + size // n, expert_sum + n, stacks + 1
        else:
            shared += size
    pretty = _rounded_count(shared + per_expert)
    return f"{expert_sum // stacks}x{pretty}" if stacks else pretty


def _metadata(
    m: _Model, outtype: str, name: str | None, pre: str | None, shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, MetaValue]]:
    if outtype not in OUTTYPES:
        raise ConvertError(f"unknown outtype {outtype!r} (choose from {', '.join(OUTTYPES)})")
    name = name or title_name(m.folder.resolve().name)
    return _model_keys(m, outtype, name, size_label(shapes) if shapes else None) + tokenizer_keys(
        m.folder, m.raw, m.family.tokenizer_specials, m.cfg.vocab_size, pre
    )

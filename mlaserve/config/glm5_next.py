"""GLM-5.3-Flash's text config (transformers' Glm5NextTextConfig, under the Glm5NextConfig wrapper's text_config):
the layer schedule and the fields that are not DeepSeek-V3's, each with where it was read (docs/GLM5_NEXT.md): the
reader the glm5_next family builds on (config/model.py _glm5_next), checked against transformers' own parse.

What it reads (transformers 5.24 class defaults where absent, recorded as such):
  layer_types      per layer "linear_attention" (KDA) | "indexed_attention" (MLA + pooled DSA indexer);
                   "full_attention" is read as indexed_attention, as transformers does; absent: layer i is KDA
                   unless i % 4 == 3
  mlp_layer_types  per layer "dense" | "sparse"; absent: the first min(3, layers) dense
  indexer_types    per layer "full" | "shared"; else index_topk_pattern ("F"/"S" per layer); else
                   index_topk_freq / index_skip_topk_offset (defaults 1, 2: every layer full)
  KDA widths       linear_num_heads, linear_head_dim, linear_conv_kernel_dim, linear_lower_bound, each overridden
                   by linear_attn_config's num_heads, head_dim, short_conv_kernel_size, gate_lower_bound (its
                   safe_gate, default true, makes a null bound -5)
  index_kpool      tokens per pooled key (class default 16; the released checkpoint writes 4), index_topk a
                   multiple of it; index_kpool_always_select_tail must be true (the tail is always kept here)
  qk_rope_head_dim must be 0 (NoPE), q_lora_rank required (the indexer reads the query latent)
  hc_mult, hc_sinkhorn_iters, hc_eps: mHC (the final collapse a mean: learned_head False); swiglu_limit
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaserve.config.deepseek_v4_parts import V4HyperConnections
from mlaserve.config.model_parts import ConfigError, KDAConfig
from mlaserve.config.provenance import ProvenanceLog, Setting

DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=45,
    qk_rope_head_dim=0,
    q_lora_rank=1536,
    linear_head_dim=128,
    linear_num_heads=64,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    index_topk=2048,
    index_kpool=16,
    index_kpool_always_select_tail=True,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    swiglu_limit=10.0,
)
KDA, INDEXED = "linear_attention", "indexed_attention"


@dataclass(frozen=True)
class Glm5NextLayout:
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: KDA | INDEXED
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" | "sparse"
    indexer_types: tuple[str, ...]  # per layer: "full" | "shared" (read for the indexed layers)
    kda: KDAConfig
    index_kpool: int
    index_topk: int
    hc: V4HyperConnections
    swiglu_limit: float
    provenance: tuple[Setting, ...]


def text_part(raw: dict, source: str) -> tuple[dict, str]:
    """The wrapper's text_config (model_type glm5_next), or the text config itself (glm5_next_text)."""
    if raw.get("model_type") == "glm5_next":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: glm5_next needs a text_config object (its text model), got {text!r}")
        return text, f"{source}:text_config"
    return raw, source


def read_glm5_next(raw: dict, source: str = "config.json") -> Glm5NextLayout:
    text, where = text_part(raw, source)
    log = ProvenanceLog()

    def get(key: str) -> Any:
        if key in text and text[key] is not None:
            return log.record(key, text[key], f"{where}:{key}")
        return log.record(key, DEFAULTS[key], f"class default (glm5_next_text; '{key}' absent)")

    def integer(key: str, value: Any, least: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{where}: {key} must be an integer >= {least}, got {value!r}")
        return value

    n = integer("num_hidden_layers", get("num_hidden_layers"), 1)
    if get("qk_rope_head_dim") != 0:
        raise ConfigError(
            f"{where}: qk_rope_head_dim must be 0 (GLM-5.3-Flash's MLA is NoPE), got {text['qk_rope_head_dim']!r}"
        )
    integer("q_lora_rank", get("q_lora_rank"), 1)
    layer_types = _per_layer(text, "layer_types", n, (KDA, INDEXED, "full_attention"), where, log)
    if layer_types is None:
        layer_types = tuple(KDA if i % 4 != 3 else INDEXED for i in range(n))
        log.record("layer_types", layer_types, "class default (glm5_next_text: KDA unless layer % 4 == 3)")
    layer_types = tuple(INDEXED if t == "full_attention" else t for t in layer_types)
    mlp = _per_layer(text, "mlp_layer_types", n, ("dense", "sparse"), where, log)
    if mlp is None:
        mlp = tuple("dense" if i < min(3, n) else "sparse" for i in range(n))
        log.record("mlp_layer_types", mlp, "class default (glm5_next_text: the first 3 dense)")
    indexer = _indexer_types(text, n, where, log)
    given = text.get("linear_attn_config")
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{where}: linear_attn_config must be a JSON object, got {given!r}")
    sub = given or {}

    def kda_width(flat: str, nested: str, least: int) -> int:
        if sub.get(nested) is not None:
            value = log.record(flat, sub[nested], f"{where}:linear_attn_config.{nested}")
            return integer(f"linear_attn_config.{nested}", value, least)
        return integer(flat, get(flat), least)

    # as transformers: linear_lower_bound (class default -5; null: no bound), then linear_attn_config's
    # gate_lower_bound, then its safe_gate (default true) turns a null bound into -5
    if "linear_lower_bound" in text:
        bound = log.record("linear_lower_bound", text["linear_lower_bound"], f"{where}:linear_lower_bound")
    else:
        bound = get("linear_lower_bound")
    if given is not None:
        if "gate_lower_bound" in sub:
            src = f"{where}:linear_attn_config.gate_lower_bound"
            bound = log.record("linear_lower_bound", sub["gate_lower_bound"], src)
        if bound is None and sub.get("safe_gate", True):
            bound = log.record("linear_lower_bound", -5.0, f"{where}:linear_attn_config.safe_gate (null bound: -5)")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound < 0):
        raise ConfigError(f"{where}: linear_lower_bound must be a negative number or null, got {bound!r}")
    kda = KDAConfig(
        layers=tuple(i for i, t in enumerate(layer_types) if t == KDA),
        num_heads=kda_width("linear_num_heads", "num_heads", 1),
        head_dim=kda_width("linear_head_dim", "head_dim", 1),
        conv_kernel=kda_width("linear_conv_kernel_dim", "short_conv_kernel_size", 2),
        lower_bound=None if bound is None else float(bound),
    )
    kpool = integer("index_kpool", get("index_kpool"), 1)
    topk = integer("index_topk", get("index_topk"), 1)
    if topk % kpool:
        raise ConfigError(f"{where}: index_topk={topk} must be a multiple of index_kpool={kpool}")
    if get("index_kpool_always_select_tail") is not True:
        raise ConfigError(
            f"{where}: index_kpool_always_select_tail=false is not run here (the incomplete tail pool is always kept)"
        )
    hc = V4HyperConnections(
        integer("hc_mult", get("hc_mult"), 1),
        integer("hc_sinkhorn_iters", get("hc_sinkhorn_iters"), 1),
        float(get("hc_eps")),
        learned_head=False,
    )
    _shared_after_kda(layer_types, indexer, where, log)
    return Glm5NextLayout(n, layer_types, mlp, indexer, kda, kpool, topk, hc, float(get("swiglu_limit")), log.freeze())


def _shared_after_kda(layer_types: tuple[str, ...], indexer: tuple[str, ...], where: str, log) -> None:
    """A "shared" indexed layer reuses the nearest previous "full" indexed layer's selection (docs/GLM5_NEXT.md
    "Shared indexer layers after KDA layers"). Where KDA layers lie between the two, transformers raises (it passes a
    selection only from the immediately preceding decoder layer): that reuse is this engine's decision, recorded in
    the provenance as (shared layer, the layer whose selection it reuses) pairs."""
    across, last_full = [], None
    for i, (kind, role) in enumerate(zip(layer_types, indexer)):
        if kind != INDEXED:
            continue  # a KDA layer's indexer_types entry is not read
        if role == "full":
            last_full = i
            continue
        if last_full is not None and last_full != i - 1:  # none before it: nothing to reuse (the layer raises
            # if a step ever asks it to select, as transformers' does)
            across.append((i, last_full))
    if across:
        log.record(
            "shared_indexer_reuse",
            tuple(across),
            "engine: a shared layer after KDA layers reuses the nearest previous full layer's selection "
            "(transformers raises there; docs/GLM5_NEXT.md)",
        )


def _per_layer(text: dict, key: str, n: int, allowed: tuple[str, ...], where: str, log) -> tuple[str, ...] | None:
    value = text.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n or not set(value) <= set(allowed):
        raise ConfigError(
            f"{where}: {key} must be a list of {n} entries (num_hidden_layers), each one of {allowed}, got {value!r}"
        )
    return log.record(key, tuple(value), f"{where}:{key}")


def _indexer_types(text: dict, n: int, where: str, log) -> tuple[str, ...]:
    got = _per_layer(text, "indexer_types", n, ("full", "shared"), where, log)
    if got is not None:
        return got
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        names = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and len(pattern) == n and set(pattern) <= set(names):
            return log.record("indexer_types", tuple(names[c] for c in pattern), f"{where}:index_topk_pattern")
        if isinstance(pattern, list) and len(pattern) == n and set(pattern) <= set(names.values()):
            return log.record("indexer_types", tuple(pattern), f"{where}:index_topk_pattern")
        raise ConfigError(f"{where}: index_topk_pattern must be {n} letters F / S (or full / shared), got {pattern!r}")
    freq, offset = text.get("index_topk_freq", 1), text.get("index_skip_topk_offset", 2)
    for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    freq = max(freq, 1)
    kinds = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))
    return log.record("indexer_types", kinds, f"{where}:index_topk_freq={freq}, index_skip_topk_offset={offset}")

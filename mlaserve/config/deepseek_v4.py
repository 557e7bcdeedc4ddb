"""DeepSeek-V4's model config: read from config.json, type-checked, with the provenance of every value.

V4 is not MLA (no kv_lora_rank, no latent up-projection: one shared K=V head), so it is its own frozen
dataclass composed of parts, not ModelConfig with bent fields; today's MLA models never see it.

Layer kinds (one per layer) come from `layer_types` (names) or the legacy `compress_ratios` (0 / 4 / 128,
transformers' fixed table), and the config records which key they came from. A config with neither is an
error naming both keys: transformers would silently apply a default schedule (2 HCA layers then CSA/HCA
alternating) that matches neither released model's table.
  sliding_attention             "sliding": the last `sliding_window` K=V rows only
  compressed_sparse_attention   "csa": sliding + overlapping 2m-token pooled rows (m = compress ratio),
                                top-`index_topk` of them chosen per query by a lightning indexer
  heavily_compressed_attention  "hca": sliding + non-overlapping m'-token pooled rows, all visible ones

The frozen parts it is composed of are in config/deepseek_v4_parts.py; the layers' `inspect` lines and the default
page size in config/deepseek_v4_layers.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mlaserve.config import families
from mlaserve.config.deepseek_v4_parts import V4AttentionShape, V4Compression, V4HyperConnections, V4MoE, V4Rope
from mlaserve.config.model_parts import ConfigError, RopeConfig
from mlaserve.config.provenance import ProvenanceLog, Setting

# config.json names -> the short kind names used in the model and state code
LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
# transformers' legacy table (configuration_deepseek_v4.py _COMPRESS_RATIO_TO_LAYER_TYPE): the value names
# the kind; the kind's ratio itself comes from compress_rates.
LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_NUM_HASH_LAYERS = 3  # transformers' default_num_hash_layers
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size")
_INT_FIELDS = {
    "hidden_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "q_lora_rank": 1,
    "vocab_size": 1,
    "moe_intermediate_size": 1,
    "n_routed_experts": 1,
    "num_experts_per_tok": 1,
    "n_shared_experts": 0,
    "qk_rope_head_dim": 2,
    "sliding_window": 1,
    "o_groups": 1,
    "o_lora_rank": 1,
    "index_n_heads": 1,
    "index_head_dim": 2,
    "index_topk": 1,
    "hc_mult": 1,
    "hc_sinkhorn_iters": 1,
    "num_hash_layers": 0,
    "compress_rate_csa": 1,
    "compress_rate_hca": 1,
    "max_position_embeddings": 2,
    "num_nextn_predict_layers": 0,
}
_FLOAT_FIELDS = (
    "rms_norm_eps",
    "rope_theta",
    "compress_rope_theta",
    "routed_scaling_factor",
    "swiglu_limit",
    "hc_eps",
    "partial_rotary_factor",
)
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob")


@dataclass(frozen=True)
class DeepseekV4Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    attention: V4AttentionShape
    compression: V4Compression
    rope: V4Rope
    moe: V4MoE
    hc: V4HyperConnections
    layer_kinds: tuple[str, ...]  # per layer: "sliding" | "csa" | "hca"
    layer_kinds_source: str  # "layer_types" | "compress_ratios"
    mlp_layer_types: tuple[str, ...]  # per layer: "hash_moe" | "moe"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    # the MTP layers' kinds when compress_ratios lists them after the main layers (the release's config.json:
    # num_hidden_layers + num_nextn_predict_layers entries); () when the config gives the main layers' only
    mtp_layer_kinds: tuple[str, ...] = ()
    provenance: tuple[Setting, ...] = field(default=(), compare=False, repr=False)

    # The engine's questions of a model config (config/engine.py resolve, config/layer_kinds.py), answered for
    # V4: it has no MLA DSA indexer (its lightning indexer belongs to its CSA layers, declared as their states).
    is_dsa_architecture = False
    indexer = None

    @property
    def family(self) -> families.Family:
        return families.by_model_type(self.model_type)

    def estimated_params(self) -> int:
        """Weights from the config (embeddings, attention, experts, lm_head), to a few percent: enough to
        choose a thread count (config/machine.py)."""
        a, m, d = self.attention, self.moe, self.hidden_size
        attn = d * a.q_lora_rank + a.q_lora_rank * a.num_heads * a.head_dim + d * a.head_dim
        attn += a.num_heads * a.head_dim * a.o_lora_rank + a.o_groups * a.o_lora_rank * d
        ffn = 3 * d * m.moe_intermediate_size * (m.n_routed_experts + 1)
        return self.num_layers * (attn + ffn) + 2 * self.vocab_size * d

    def ratio(self, layer: int) -> int:
        """Tokens per compressed row of a layer (0: sliding only)."""
        kind = self.layer_kinds[layer]
        return 0 if kind == "sliding" else self.compression.ratio(kind)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> DeepseekV4Config:
        return _V4Reader(raw, source).build()


def is_v4(raw: Any) -> bool:
    """A config.json dict whose model_type is read by this module."""
    fam = families.by_model_type(raw.get("model_type")) if isinstance(raw, dict) else None
    return fam is not None and fam.reader == "deepseek_v4"


class _V4Reader:
    def __init__(self, raw: dict[str, Any], source: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the config must be a JSON object (a dict), got {type(raw).__name__}")
        if not is_v4(raw):
            raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} is not read as DeepSeek-V4")
        self.raw, self.source, self.log = raw, source, ProvenanceLog()
        self.family = families.by_model_type(raw["model_type"])
        self.log.record("model_type", self.family.name, f"{source}:model_type")

    def get(self, key: str, required: bool = False) -> Any:
        if self.raw.get(key) is not None:
            return self.log.record(key, self.raw[key], f"{self.source}:{key}")
        if required or key not in self.family.defaults:
            raise ConfigError(f"{self.source}: missing required field {key!r} for model_type {self.family.name}")
        return self.log.record(key, self.family.defaults[key], f"class default ({self.family.name}; '{key}' absent)")

    def build(self) -> DeepseekV4Config:
        self._check_types()
        g = self.get
        for key in _REQUIRED:
            g(key, required=True)
        n = self.raw["num_hidden_layers"]
        kv_heads = self.raw.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ConfigError(f"{self.source}: num_key_value_heads must be 1 for DeepSeek-V4 (one shared K=V head)")
        if self.raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"{self.source}: hidden_act {self.raw['hidden_act']!r} is not supported; one of silu")
        if self.raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ConfigError(
                f"{self.source}: scoring_func {self.raw['scoring_func']!r} is not supported for deepseek_v4 "
                "(sqrtsoftplus, as the released models and transformers' DeepseekV4TopKRouter)"
            )
        for key in ("attention_bias", "mlp_bias"):
            if self.raw.get(key):
                raise ConfigError(f"{self.source}: {key}=true is not supported for deepseek_v4 (no biases)")
        attention = self._attention()
        compression = self._compression()
        kinds, kinds_source, mtp_kinds = self._layer_kinds(n)
        cfg = DeepseekV4Config(
            model_type=self.family.name,
            vocab_size=self.raw["vocab_size"],
            hidden_size=self.raw["hidden_size"],
            num_layers=n,
            rms_norm_eps=float(g("rms_norm_eps")),
            attention=attention,
            compression=compression,
            rope=self._rope(attention.rope_dim),
            moe=self._moe(),
            hc=V4HyperConnections(int(g("hc_mult")), int(g("hc_sinkhorn_iters")), float(g("hc_eps"))),
            layer_kinds=kinds,
            layer_kinds_source=kinds_source,
            mlp_layer_types=self._mlp_layer_types(n),
            tie_word_embeddings=bool(self.raw.get("tie_word_embeddings", False)),
            bos_token_id=self.raw.get("bos_token_id"),
            eos_token_ids=_as_ints(self.raw.get("eos_token_id"), self.source),
            max_position_embeddings=int(g("max_position_embeddings")),
            num_nextn_predict_layers=int(g("num_nextn_predict_layers")),
            mtp_layer_kinds=mtp_kinds,
            provenance=self.log.freeze(),
        )
        _check(cfg, self.source)
        return cfg

    def _check_types(self) -> None:
        src, raw = self.source, self.raw
        for key in _BOOL_FIELDS:
            v = raw.get(key)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"{src}: {key} must be true or false, got {v!r} ({type(v).__name__})")
        for key, least in _INT_FIELDS.items():
            v = raw.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{src}: {key} must be an integer, got {v!r} ({type(v).__name__})")
            if v < least:
                raise ConfigError(f"{src}: {key} must be >= {least}, got {v}")
        for key in _FLOAT_FIELDS:
            v = raw.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{src}: {key} must be a number, got {v!r} ({type(v).__name__})")
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{src}: {key} must be a finite number > 0, got {v}")

    def _attention(self) -> V4AttentionShape:
        g, src = self.get, self.source
        heads, head_dim = self.raw["num_attention_heads"], int(g("head_dim"))
        # rope width: partial_rotary_factor * head_dim (transformers), or the legacy qk_rope_head_dim
        prf, legacy = self.raw.get("partial_rotary_factor"), self.raw.get("qk_rope_head_dim")
        if prf is not None:
            rope_dim = int(head_dim * prf)
            self.log.record("rope_dim", rope_dim, f"{src}:partial_rotary_factor x head_dim")
            if legacy is not None and legacy != rope_dim:
                raise ConfigError(
                    f"{src}: qk_rope_head_dim={legacy} disagrees with partial_rotary_factor x head_dim = {rope_dim}"
                )
        elif legacy is not None:
            rope_dim = self.log.record("rope_dim", legacy, f"{src}:qk_rope_head_dim")
        else:
            rope_dim = self.log.record("rope_dim", head_dim // 8, "class default (partial_rotary_factor 64/512)")
        if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
            raise ConfigError(f"{src}: the rope width {rope_dim} must be even and in [2, head_dim={head_dim}]")
        o_groups = int(g("o_groups"))
        if heads % o_groups:
            raise ConfigError(f"{src}: o_groups={o_groups} must divide num_attention_heads={heads}")
        return V4AttentionShape(
            num_heads=heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(g("q_lora_rank")),
            o_groups=o_groups,
            o_lora_rank=int(g("o_lora_rank")),
            sliding_window=int(g("sliding_window")),
        )

    def _compression(self) -> V4Compression:
        src, raw = self.source, self.raw
        rates = raw.get("compress_rates")
        if rates is None:
            rates = dict(DEFAULT_COMPRESS_RATES)
            where = "class default (compress_rates absent)"
        elif not isinstance(rates, dict) or not set(rates) <= set(DEFAULT_COMPRESS_RATES):
            raise ConfigError(
                f"{src}: compress_rates must be an object with keys from {tuple(DEFAULT_COMPRESS_RATES)}, got {rates!r}"
            )
        else:
            rates, where = {**DEFAULT_COMPRESS_RATES, **rates}, f"{src}:compress_rates"
        for legacy, key in (
            ("compress_rate_csa", "compressed_sparse_attention"),
            ("compress_rate_hca", "heavily_compressed_attention"),
        ):
            if raw.get(legacy) is not None:  # transformers folds these in over compress_rates
                rates[key], where = raw[legacy], f"{src}:{legacy}"
        for key, v in rates.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{src}: compress_rates.{key} must be an integer >= 1, got {v!r}")
        self.log.record("compress_rates", dict(rates), where)
        return V4Compression(
            csa_ratio=rates["compressed_sparse_attention"],
            hca_ratio=rates["heavily_compressed_attention"],
            index_n_heads=int(self.get("index_n_heads")),
            index_head_dim=int(self.get("index_head_dim")),
            index_topk=int(self.get("index_topk")),
        )

    def _layer_kinds(self, n: int) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
        src, raw = self.source, self.raw
        types, ratios = raw.get("layer_types"), raw.get("compress_ratios")
        from_ratios = None
        if ratios is not None:
            if not isinstance(ratios, list) or any(isinstance(r, bool) or r not in LEGACY_RATIOS for r in ratios):
                raise ConfigError(
                    f"{src}: compress_ratios must be a list of values from {tuple(LEGACY_RATIOS)} "
                    f"(transformers' legacy table), got {ratios!r}"
                )
            from_ratios = [LEGACY_RATIOS[r] for r in ratios]
        if types is None and from_ratios is None:
            raise ConfigError(
                f"{src}: neither layer_types nor compress_ratios is set; DeepSeek-V4 needs one of them to know "
                "each layer's attention kind (no default schedule is applied)"
            )
        key = "layer_types" if types is not None else "compress_ratios"
        chosen = types if types is not None else from_ratios
        mtp: list = []
        nextn = raw.get("num_nextn_predict_layers") or 0
        if from_ratios is not None and isinstance(nextn, int) and nextn > 0 and len(from_ratios) == n + nextn:
            # the release lists the MTP layers' ratios after the main layers' (V4-Flash: 43 + 1 entries)
            from_ratios, mtp = from_ratios[:n], from_ratios[n:]
            chosen = types if types is not None else from_ratios
        if not isinstance(chosen, list) or len(chosen) != n:
            raise ConfigError(
                f"{src}: {key} must be a list of {n} entries (num_hidden_layers; compress_ratios may add one per "
                f"num_nextn_predict_layers), got {raw[key]!r}"
            )
        bad = [t for t in chosen if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"{src}: layer_types entries must be from {tuple(LAYER_TYPES)}, got {bad}")
        if types is not None and from_ratios is not None and from_ratios != types:
            raise ConfigError(f"{src}: layer_types and compress_ratios disagree; set one of them")
        kinds = tuple(LAYER_TYPES[t] for t in chosen)
        self.log.record("layer_kinds", kinds, f"{src}:{key}")
        mtp_kinds = tuple(LAYER_TYPES[t] for t in mtp)
        if mtp_kinds:
            self.log.record("mtp_layer_kinds", mtp_kinds, f"{src}:compress_ratios[{n}:]")
        return kinds, key, mtp_kinds

    def _mlp_layer_types(self, n: int) -> tuple[str, ...]:
        src, raw = self.source, self.raw
        types = raw.get("mlp_layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != n or not set(types) <= set(MLP_LAYER_TYPES):
                raise ConfigError(
                    f"{src}: mlp_layer_types must be a list of {n} entries from {MLP_LAYER_TYPES}, got {types!r}"
                )
            return self.log.record("mlp_layer_types", tuple(types), f"{src}:mlp_layer_types")
        hashed = raw.get("num_hash_layers")
        where = f"{src}:num_hash_layers"
        if hashed is None:
            hashed, where = DEFAULT_NUM_HASH_LAYERS, "class default (3 hash_moe layers; no mlp_layer_types)"
        out = ("hash_moe",) * min(n, hashed) + ("moe",) * max(0, n - hashed)
        return self.log.record("mlp_layer_types", out, where)

    def _rope(self, rope_dim: int) -> V4Rope:
        src, raw = self.source, self.raw
        params = raw.get("rope_parameters")
        if params is None:
            params = raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{src}: rope_parameters must be a JSON object, got {params!r}")
        theta, ctheta = float(self.get("rope_theta")), float(self.get("compress_rope_theta"))
        if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
            main_p = {"rope_theta": theta, **params["main"]}
            comp_p = {"rope_theta": ctheta, **params["compress"]}
            where = "rope_parameters.{main,compress}"
            # nested: transformers derives YaRN's attention factor when the config omits it
            forced = None
        else:
            flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
            main_p = {"rope_type": "default", "rope_theta": theta}
            comp_p = {**flat, "rope_theta": ctheta}
            where = "rope_parameters (flat: main = rope_theta, compress = compress_rope_theta + these)"
            forced = 1.0  # transformers sets attention_factor 1 for a flat YaRN compress table (V4: no mscale)
        main = self._table(main_p, rope_dim, f"{where}.main")
        comp = self._table(comp_p, rope_dim, f"{where}.compress")
        if main.rope_type != "default":
            raise ConfigError(f"{src}: the main rope table must be plain (rope_type default), got {main.rope_type!r}")
        factor = comp_p.get("attention_factor", forced)
        if comp.rope_type != "yarn":
            factor = 1.0
        elif factor is None:
            factor = comp.attention_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise ConfigError(f"{src}: rope_parameters.compress.attention_factor must be a number, got {factor!r}")
        self.log.record("rope", f"main theta={main.theta}; compress {comp.rope_type} theta={comp.theta}", where)
        return V4Rope(main=main, compress=comp, compress_attention_factor=float(factor))

    def _table(self, p: dict, dim: int, where: str) -> RopeConfig:
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"{self.source}: {where}.rope_type {rope_type!r} is not supported (default, yarn)")

        def num(key: str, default: float) -> float:
            v = p.get(key)
            if v is None:
                return float(default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{self.source}: {where}.{key} must be a finite number, got {v!r}")
            return float(v)

        theta = num("rope_theta", 10000.0)
        if theta <= 0:
            raise ConfigError(f"{self.source}: {where}.rope_theta must be > 0, got {theta}")
        if rope_type == "default":
            return RopeConfig(dim=dim, theta=theta, interleaved=True)
        orig = p.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise ConfigError(f"{self.source}: {where}.original_max_position_embeddings (an integer) is required")
        factor = p.get("factor")
        factor = num("factor", 0) if factor is not None else self.raw.get("max_position_embeddings", 1048576) / orig
        if factor <= 0:
            raise ConfigError(f"{self.source}: {where}.factor must be > 0, got {factor}")
        truncate = p.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{self.source}: {where}.truncate must be true or false, got {truncate!r}")
        return RopeConfig(
            dim=dim,
            theta=theta,
            interleaved=True,
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=orig,
            # transformers: `get("beta_fast") or 32` -- a 0 reads as the default too
            beta_fast=num("beta_fast", 32.0) or 32.0,
            beta_slow=num("beta_slow", 1.0) or 1.0,
            mscale=num("mscale", 0.0),
            mscale_all_dim=num("mscale_all_dim", 0.0),
            truncate=truncate,
        )

    def _moe(self) -> V4MoE:
        g = self.get
        if not self.raw.get("n_routed_experts"):
            raise ConfigError(f"{self.source}: n_routed_experts must be set for deepseek_v4 (every layer is MoE)")
        self.log.record(
            "norm_topk_prob", "not read", "reference rule: transformers' V4 routers always renormalise the top-k"
        )
        return V4MoE(
            n_routed_experts=self.raw["n_routed_experts"],
            num_experts_per_tok=int(g("num_experts_per_tok")),
            n_shared_experts=int(g("n_shared_experts")),
            moe_intermediate_size=self.raw["moe_intermediate_size"],
            routed_scaling_factor=float(g("routed_scaling_factor")),
            swiglu_limit=float(g("swiglu_limit")),
        )


def _check(cfg: DeepseekV4Config, src: str) -> None:
    a, c, m = cfg.attention, cfg.compression, cfg.moe
    if not 1 <= m.num_experts_per_tok <= m.n_routed_experts:
        raise ConfigError(
            f"{src}: num_experts_per_tok must be in [1, n_routed_experts={m.n_routed_experts}], got "
            f"{m.num_experts_per_tok}"
        )
    if m.n_shared_experts > 1:
        # transformers builds one shared MLP of moe_intermediate_size whatever n_shared_experts says
        raise ConfigError(f"{src}: n_shared_experts={m.n_shared_experts}; deepseek_v4 has at most 1 shared expert")
    if c.index_head_dim % 2 or c.index_head_dim < a.rope_dim:
        raise ConfigError(
            f"{src}: index_head_dim={c.index_head_dim} must be even and >= the rope width {a.rope_dim} "
            "(the indexer ropes its trailing dims)"
        )
    for key, value in (("bos_token_id", cfg.bos_token_id),) + tuple(("eos_token_id", e) for e in cfg.eos_token_ids):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.vocab_size
        ):
            raise ConfigError(f"{src}: {key} {value!r} is outside the vocabulary [0, {cfg.vocab_size})")


def _as_ints(value: Any, src: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"{src}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values

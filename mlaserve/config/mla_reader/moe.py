"""The MLP schedule (dense | moe per layer: mlp_layer_types, the family's leading dense layers, or
first_k_dense_replace) and the router of the MoE layers (the family's scoring rule: V2's softmax or V3's sigmoid
+ correction bias; LongCat-Flash's identity experts in config/mla_reader/longcat_flash.py)."""

from __future__ import annotations

from mlaserve.config.mla_reader.longcat_flash import zero_expert_moe
from mlaserve.config.mla_reader.raw import RawConfig
from mlaserve.config.model_parts import ConfigError, MoEConfig


def mlp_layer_types(r: RawConfig, num_layers: int) -> tuple[str, ...]:
    types = r.raw.get("mlp_layer_types")
    if types is not None and r.family.reads_mlp_layer_types:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(
                f"{r.source}: mlp_layer_types must be a list of {num_layers} entries (num_hidden_layers), got {types!r}"
            )
        out = tuple("dense" if t == "dense" else "moe" for t in types)
        r.log.record("mlp_layer_types", out, f"{r.source}:mlp_layer_types")
        return out
    first = r.family.first_dense_layers
    if first is not None:
        out = ("dense",) * first + ("moe",) * (num_layers - first)
        dense = "first layer dense" if first == 1 else f"first {first} layers dense" if first else "every layer MoE"
        return r.log.record("mlp_layer_types", out, f"class default ({r.family.name}: {dense})")
    n_dense = int(r.get("first_k_dense_replace"))
    if n_dense > num_layers:
        raise ConfigError(f"{r.source}: first_k_dense_replace={n_dense} exceeds num_hidden_layers={num_layers}")
    out = ("dense",) * n_dense + ("moe",) * (num_layers - n_dense)
    return r.log.record("mlp_layer_types", out, "derived from first_k_dense_replace")


def read_moe(r: RawConfig) -> MoEConfig | None:
    if not r.raw.get("n_routed_experts"):
        return None
    g, name = r.get, r.family.name
    if r.family.zero_experts:
        return zero_expert_moe(r)
    if r.family.scoring_func == "softmax":
        scoring, method = "softmax", g("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{r.source}: topk_method {method!r} not supported for {name}")
        norm = r.log.record(
            "norm_topk_prob", False, f"reference rule: transformers' {name} router ignores norm_topk_prob"
        )
    else:
        scoring = r.log.record("scoring_func", "sigmoid", f"family rule ({name}: sigmoid + correction bias)")
        method = r.log.record("topk_method", "noaux_tc", f"family rule ({name})")
        norm = bool(g("norm_topk_prob"))
    n_group, topk_group = g("n_group"), g("topk_group")
    if method in ("group_limited_greedy", "noaux_tc") and (n_group is None or topk_group is None):
        raise ConfigError(f"{r.source}: topk_method {method} needs n_group and topk_group")
    return MoEConfig(
        n_routed_experts=g("n_routed_experts"),
        num_experts_per_tok=g("num_experts_per_tok"),
        n_shared_experts=int(g("n_shared_experts") or 0),
        moe_intermediate_size=g("moe_intermediate_size", required=True),
        scoring_func=scoring,
        topk_method=method,
        n_group=int(n_group or 1),
        topk_group=int(topk_group or 1),
        norm_topk_prob=norm,
        routed_scaling_factor=float(g("routed_scaling_factor")),
    )

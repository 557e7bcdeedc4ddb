"""LongCat-Flash's fields (config/families/longcat_flash.py): decoder layers of two attention sublayers
(num_layers; num_hidden_layers derived), the sqrt(hidden / rank) latent scales and where each is applied, and
the router over real and identity (zero-computation) experts. `decoder_layers` reads every family's layer count."""

from __future__ import annotations

from mlaserve.config.mla_reader.raw import RawConfig
from mlaserve.config.model_parts import ConfigError, LatentScale, MoEConfig, power_of_two


def decoder_layers(r: RawConfig) -> int:
    """Decoder layers. A family of two attention sublayers per layer (LongCat-Flash) gives `num_layers`;
    transformers derives num_hidden_layers = 2 x num_layers (LongcatFlashConfig's property, whose setter
    reads a given num_hidden_layers back as num_layers = value // 2), recorded as derived."""
    n_sub, name = r.family.sublayers, r.family.name
    if n_sub == 1:
        return r.get("num_hidden_layers", required=True)
    given = r.raw.get("num_hidden_layers")
    if "num_layers" in r.raw:
        n = r.get("num_layers")
        if given is not None and given != n_sub * n:
            raise ConfigError(
                f"{r.source}: num_hidden_layers={given} but num_layers={n}: {name} has {n_sub} attention "
                f"sublayers per decoder layer, so num_hidden_layers must be {n_sub} x num_layers = {n_sub * n}"
            )
    elif given is not None:
        if given % n_sub:
            raise ConfigError(
                f"{r.source}: num_hidden_layers={given} is not a multiple of {n_sub} ({name}: {n_sub} "
                "attention sublayers per decoder layer) and num_layers is absent"
            )
        n = r.log.record(
            "num_layers", given // n_sub, f"derived: {r.source}:num_hidden_layers / {n_sub} (num_layers absent)"
        )
    else:
        raise ConfigError(f"{r.source}: missing required field 'num_layers' for model_type {name}")
    r.log.record(
        "num_hidden_layers",
        n_sub * n,
        f"derived: {n_sub} x num_layers ({name}: {n_sub} attention sublayers per decoder layer, "
        "each with its own latent cache row)",
    )
    return n


def latent_scale(r: RawConfig, q_lora: int | None) -> LatentScale | None:
    """LongCat-Flash's sqrt(hidden / rank) on q and c_kv, and where each is applied (LatentScale)."""
    if r.family.sublayers == 1:
        return None
    name, d = r.family.name, r.raw["hidden_size"]
    if not q_lora:
        raise ConfigError(f"{r.source}: q_lora_rank must be set for {name} (its query always has a latent)")
    head_dim = r.raw.get("head_dim")
    if head_dim is not None and head_dim != r.raw["qk_rope_head_dim"]:
        # transformers builds the rope tables over head_dim and rotates the qk_rope_head_dim slice with them
        raise ConfigError(
            f"{r.source}: head_dim={head_dim} must equal qk_rope_head_dim={r.raw['qk_rope_head_dim']} "
            f"({name}'s rope is built over head_dim and applied to the rope slice)"
        )
    qk = r.raw.get("qk_head_dim")
    if qk is not None and qk != r.raw["qk_nope_head_dim"] + r.raw["qk_rope_head_dim"]:
        raise ConfigError(
            f"{r.source}: qk_head_dim={qk} must equal qk_nope_head_dim + qk_rope_head_dim = "
            f"{r.raw['qk_nope_head_dim'] + r.raw['qk_rope_head_dim']}"
        )
    for key in (
        "mla_scale_q_lora",
        "mla_scale_kv_lora",
    ):  # the original release's flags; transformers always scales
        flag = r.raw.get(key)
        if flag is not None and flag is not True:
            raise ConfigError(
                f"{r.source}: {key}={flag!r}: {name} is run with the scale (transformers always applies it); "
                "a model trained without it is not this family"
            )
    method = r.raw.get("attention_method")
    if method is not None and method != "MLA":
        raise ConfigError(f"{r.source}: attention_method {method!r} is not supported ({name}: 'MLA')")
    scales = {}
    for part, rank, weight in (("q", q_lora, "q_b_proj"), ("kv", r.raw["kv_lora_rank"], "kv_a_layernorm")):
        s = (d / rank) ** 0.5  # transformers' (hidden_size / rank) ** 0.5
        folded = power_of_two(s)
        where = (
            f"folded into {weight}'s weight (a power of two: the same products bit for bit)"
            if folded
            else f"applied at run time after {weight} (not a power of two: folding would round)"
        )
        r.log.record(
            f"{part}_latent_scale", s, f"derived: sqrt(hidden_size / {part}_lora_rank) = sqrt({d}/{rank}); {where}"
        )
        scales[part] = (s, folded)
    return LatentScale(scales["q"][0], scales["kv"][0], scales["q"][1], scales["kv"][1])


def zero_expert_moe(r: RawConfig) -> MoEConfig:
    """LongCat-Flash's router (LongcatFlashTopkRouter): softmax over the real and the identity experts, top-k
    on the scores plus e_score_correction_bias, no renormalisation, x routed_scaling_factor; no shared expert."""
    g, name = r.get, r.family.name
    # transformers reads it with getattr(config, "router_bias", False): no class field, absent is False
    given = r.raw.get("router_bias")
    bias = r.log.record(
        "router_bias",
        bool(given),
        f"{r.source}:router_bias" if given is not None else "absent: False (transformers' getattr default)",
    )
    if bias:
        raise ConfigError(
            f"{r.source}: router_bias true is not supported for {name}: transformers then allocates "
            "router.classifier.bias but its router never adds it"
        )
    kind = r.raw.get("zero_expert_type")
    if kind is not None and kind != "identity":  # the original release's key: transformers runs identity only
        raise ConfigError(f"{r.source}: zero_expert_type {kind!r} is not supported ({name}: 'identity')")
    rule = f"family rule ({name}: LongcatFlashTopkRouter)"
    r.log.record("scoring_func", "softmax", rule)
    r.log.record("topk_method", "greedy", f"{rule}: top-k of softmax + e_score_correction_bias")
    r.log.record("norm_topk_prob", False, f"{rule}: the top-k weights are not renormalised")
    return MoEConfig(
        n_routed_experts=g("n_routed_experts"),
        num_experts_per_tok=g("num_experts_per_tok"),
        n_shared_experts=0,
        moe_intermediate_size=g("moe_intermediate_size", required=True),
        scoring_func="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=float(g("routed_scaling_factor")),
        zero_experts=int(g("zero_expert_num") or 0),
    )

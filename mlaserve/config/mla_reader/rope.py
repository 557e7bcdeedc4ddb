"""The main rope of an MLA family: NoPE (the family's rule: the identity), else rope_parameters (or the pre-v5
rope_scaling + rope_theta) with the family's legacy rope types, default theta and interleave rule."""

from __future__ import annotations

from mlaserve.config.mla_reader.raw import RawConfig, flag, number
from mlaserve.config.model_parts import ConfigError, RopeConfig


def read_rope(r: RawConfig) -> RopeConfig:
    if r.family.nope is not None:  # NoPE: the rope slice is kept, never rotated
        r.log.record("rope", "none (identity: cos 1, sin 0)", f"family rule ({r.family.name}: {r.family.nope})")
        return RopeConfig(dim=r.raw["qk_rope_head_dim"], theta=10000.0, interleaved=False, rope_type="none")
    params = r.raw.get("rope_parameters")
    where = "rope_parameters"
    if params is None:  # pre-v5 configs: rope_theta + rope_scaling
        params = dict(r.raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", r.raw.get("rope_theta", _default_theta(r)))
        where = "rope_scaling/rope_theta"
    if not isinstance(params, dict):
        raise ConfigError(f"{r.source}: {where} must be a JSON object, got {params!r}")
    num = lambda key, default, zero_absent=True: number(  # noqa: E731
        params.get(key), default, f"{r.source}: {where}.{key}", zero_absent
    )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in r.family.rope_type_aliases:
        legacy, rope_type = rope_type, r.family.rope_type_aliases[rope_type]
        r.log.record(
            "rope_type <- legacy",
            rope_type,
            f"{r.source}:{where}: {legacy!r} read as {rope_type!r} ({r.family.name})",
        )
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{r.source}: {where}.rope_type {rope_type!r} is not supported (default, yarn)")
    interleaved = _interleaved(r)
    rope = RopeConfig(
        dim=r.raw["qk_rope_head_dim"],
        theta=num("rope_theta", _default_theta(r), zero_absent=False),
        interleaved=interleaved,
        rope_type=rope_type,
        factor=num("factor", 1.0, zero_absent=rope_type != "yarn"),  # yarn: 0 is an error, not 1
        original_max_position_embeddings=int(num("original_max_position_embeddings", 0)),
        beta_fast=num("beta_fast", 32.0),
        beta_slow=num("beta_slow", 1.0),
        mscale=num("mscale", 0.0),
        mscale_all_dim=num("mscale_all_dim", 0.0),
        truncate=flag(params.get("truncate"), True, f"{r.source}: {where}.truncate"),
    )
    if rope_type == "yarn" and not rope.original_max_position_embeddings:
        raise ConfigError(f"{r.source}: {where}.original_max_position_embeddings is required for yarn")
    r.log.record("rope", f"{rope_type}, theta={rope.theta}, factor={rope.factor}", f"{r.source}:{where}")
    return rope


def _default_theta(r: RawConfig) -> float:
    """rope_theta when the config gives none: the family's (transformers' default_theta), else 10000."""
    return r.family.default_theta


def _interleaved(r: RawConfig) -> bool:
    rule = r.family.rope_rule
    if rule is not None:
        return r.log.record("rope_interleave", True, f"family rule ({r.family.name}: {rule})")
    return bool(r.get("rope_interleave"))

"""Kimi-Linear's KDA layers (config/families/kimi_linear.py): which layers are KDA (layer_types, else
linear_attn_config's 1-indexed lists; neither is an error), the KDA widths (linear_attn_config or the flat
linear_* keys; both given and different is an error) and, where the family reads one, the gate's lower bound."""

from __future__ import annotations

from mlaserve.config.mla_reader.raw import RawConfig
from mlaserve.config.model_parts import ConfigError, KDAConfig


def read_kda(r: RawConfig, num_layers: int) -> KDAConfig | None:
    """Kimi-Linear: which layers are KDA (from layer_types, else linear_attn_config's 1-indexed lists; neither
    is an error naming the keys) and the KDA widths (linear_attn_config or the flat linear_* keys)."""
    if not r.family.kda:
        return None
    sub = r.raw.get("linear_attn_config")
    if sub is not None and not isinstance(sub, dict):
        raise ConfigError(f"{r.source}: linear_attn_config must be a JSON object, got {sub!r}")
    sub = sub or {}
    kda = _kda_layers(r, num_layers, sub)
    widths = {}
    for flat, nested in (
        ("linear_num_heads", "num_heads"),
        ("linear_head_dim", "head_dim"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ):
        least = 2 if flat == "linear_conv_kernel_dim" else 1  # a conv of width 1 keeps no state
        here = {k: v for k, v in ((flat, r.raw.get(flat)), (f"linear_attn_config.{nested}", sub.get(nested)))}
        for key, value in here.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ConfigError(f"{r.source}: {key} must be an integer >= {least}, got {value!r}")
        given = {k: v for k, v in here.items() if v is not None}
        if len(set(given.values())) > 1:
            raise ConfigError(f"{r.source}: {' and '.join(f'{k}={v}' for k, v in given.items())} differ; give one")
        if given:
            key, value = next(reversed(given.items()))  # linear_attn_config's name when both agree
            widths[flat] = r.log.record(flat, value, r.field_sources.get(key, f"{r.source}:{key}"))
        else:
            widths[flat] = r.get(flat)
    return KDAConfig(
        layers=kda,
        num_heads=widths["linear_num_heads"],
        head_dim=widths["linear_head_dim"],
        conv_kernel=widths["linear_conv_kernel_dim"],
        lower_bound=_lower_bound(r) if r.family.kda_lower_bound else None,
    )


def _lower_bound(r: RawConfig) -> float | None:
    """linear_lower_bound: a negative number (the log-space gate's floor), or null (no bound: the softplus gate)."""
    if "linear_lower_bound" not in r.raw:
        return r.get("linear_lower_bound")  # the family's class default, recorded as such
    value = r.raw["linear_lower_bound"]
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value < 0):
        raise ConfigError(f"{r.source}: linear_lower_bound must be a negative number or null, got {value!r}")
    bound = None if value is None else float(value)
    return r.log.record("linear_lower_bound", bound, f"{r.source}:linear_lower_bound")


def _kda_layers(r: RawConfig, num_layers: int, sub: dict) -> tuple[int, ...]:
    types = r.raw.get("layer_types")
    from_types = None
    if types is not None:
        kinds = ("linear_attention", "full_attention")
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(kinds):
            raise ConfigError(
                f"{r.source}: layer_types must be a list of {num_layers} entries (num_hidden_layers), each "
                f"one of {kinds}, got {types!r}"
            )
        from_types = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    from_sub = None
    if "kda_layers" in sub or "full_attn_layers" in sub:
        lists = {}
        for key in ("kda_layers", "full_attn_layers"):
            got = sub.get(key)
            if not isinstance(got, list) or any(
                isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= num_layers for n in got
            ):
                raise ConfigError(
                    f"{r.source}: linear_attn_config.{key} must be a list of 1-indexed layer numbers in "
                    f"[1, {num_layers}], got {got!r}"
                )
            lists[key] = got
        named = lists["kda_layers"] + lists["full_attn_layers"]
        if sorted(named) != list(range(1, num_layers + 1)):
            raise ConfigError(
                f"{r.source}: linear_attn_config.kda_layers and full_attn_layers must name every layer 1.."
                f"{num_layers} exactly once, got kda {lists['kda_layers']} and full {lists['full_attn_layers']}"
            )
        from_sub = tuple(sorted(n - 1 for n in lists["kda_layers"]))
    if from_types is None and from_sub is None:
        raise ConfigError(
            f"{r.source}: kimi_linear needs its layer pattern: layer_types (per layer 'linear_attention' | "
            "'full_attention') or linear_attn_config.kda_layers + full_attn_layers; neither is given"
        )
    if from_types is not None and from_sub is not None and from_types != from_sub:
        raise ConfigError(
            f"{r.source}: layer_types makes layers {list(from_types)} KDA but linear_attn_config.kda_layers "
            f"makes {list(from_sub)} (0-indexed); give one"
        )
    if from_types is not None:
        where = r.field_sources.get("layer_types", f"{r.source}:layer_types")  # a GGUF: its key
        return r.log.record("kda_layers", from_types, f"{where} ('linear_attention')")
    return r.log.record("kda_layers", from_sub, f"{r.source}:linear_attn_config.kda_layers (1-indexed, read 0-indexed)")

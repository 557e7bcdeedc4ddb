"""One config.json dict as the MLA reader sees it (`RawConfig`): its source, where each key came from, its
`Family`, the provenance log, and `get` (a value, else the family's class default, each recorded). The family's
legacy and own key names are read under the current ones here, before any field is. Plus the small value
parsers the field readers share (`flag`, `number`, `as_tuple`)."""

from __future__ import annotations

from typing import Any

from mlaserve.config import families
from mlaserve.config.model_parts import ConfigError
from mlaserve.config.provenance import ProvenanceLog, Setting

# Why the MLA reader refuses a DeepSeek-V4 config, and where it goes instead.
V4_NOT_SERVED = (
    "model_type deepseek_v4 is not MLA (one shared K=V head, sliding window, compressed rows): its config is read "
    "by mlaserve.config.deepseek_v4 and its model is mlaserve.models.deepseek_v4; the loader opens a V4 folder "
    "through them (loading/model_loader.py)"
)


class RawConfig:
    """One config.json dict of an MLA family, its key names translated, with the log of where each value came
    from (config/model.py builds the ModelConfig from it)."""

    def __init__(
        self, raw: dict[str, Any], source: str, field_sources: dict[str, str], wrapper_tie: Setting | None = None
    ) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: the config must be a JSON object (a dict), got {type(raw).__name__}")
        self.raw, self.source, self.log = raw, source, ProvenanceLog()
        self.field_sources = field_sources
        mt = raw.get("model_type")
        if mt is None:
            raise ConfigError(f"{source}: missing required field 'model_type'")
        family = families.by_model_type(mt)
        if family is None:
            raise ConfigError(f"{source}: unknown model_type {mt!r}; supported: {', '.join(families.model_types())}")
        if family.reader != "mla":
            raise ConfigError(
                f"{source}: {V4_NOT_SERVED}" if family.reader == "deepseek_v4" else f"{source}: {mt} is not MLA"
            )
        self.family, name = family, family.name
        self.log.record("model_type", name, f"{source}:model_type" + (f" ({mt} alias)" if mt != name else ""))
        self.raw = self._translate_legacy(raw)
        if wrapper_tie is not None:  # the text config's own tie flag is not the one the wrapper class uses
            self.log.record(wrapper_tie.name, wrapper_tie.value, wrapper_tie.source)

    def _translate_legacy(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The family's legacy keys read under their current names, each recorded ("from legacy key X");
        keys the reference drops recorded as dropped. The caller's dict is not changed."""
        family, out = self.family, dict(raw)
        self.renamed: dict[str, str] = {}  # current name -> the legacy key it was read from (error messages)
        for old, new in family.legacy_keys.items():
            if old not in raw:
                continue
            if new in raw and raw[new] != raw[old]:
                raise ConfigError(
                    f"{self.source}: {old} (legacy key for {new}) = {raw[old]!r} but {new} = {raw[new]!r}; give one"
                )
            out[new] = out.pop(old)
            self.renamed[new] = f"legacy key {old}"
            where = self.field_sources.get(old, f"{self.source}:{old}")
            self.field_sources = {**self.field_sources, new: f"{where} (from legacy key {old})"}
            self.log.record(f"{new} <- {old}", out[new], f"{where}: legacy key of {family.name}, read as {new}")
        for own, new in family.own_keys.items():
            if own not in raw:
                continue
            if new in raw and raw[new] != raw[own]:
                raise ConfigError(
                    f"{self.source}: {own} ({family.name}'s name for {new}) = {raw[own]!r} but {new} = {raw[new]!r}; give one"
                )
            out[new] = out.pop(own)
            self.renamed[new] = f"{family.name} key {own}"
            where = self.field_sources.get(own, f"{self.source}:{own}")
            self.field_sources = {**self.field_sources, new: f"{where} ({family.name}'s name for {new})"}
        for key, why in family.dropped_keys.items():
            if key in out:
                self.log.record(f"{key} (dropped)", out.pop(key), f"{self.source}:{key}: {why}")
        return out

    def get(self, key: str, required: bool = False) -> Any:
        if key in self.raw and self.raw[key] is not None or (key in self.raw and key == "q_lora_rank"):
            return self.log.record(key, self.raw[key], self.field_sources.get(key, f"{self.source}:{key}"))
        name, defaults = self.family.name, self.family.defaults
        if required or key not in defaults:
            raise ConfigError(f"{self.source}: missing required field {key!r} for model_type {name}")
        return self.log.record(key, defaults[key], f"class default ({name}; '{key}' absent)")


def flag(value: Any, default: bool, where: str) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def number(value: Any, default: float, where: str, zero_absent: bool = True) -> float:
    """A float field that may be absent or null (then its default; 0 too where zero_absent)."""
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return float(value or default) if zero_absent else float(value)


def as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    return values

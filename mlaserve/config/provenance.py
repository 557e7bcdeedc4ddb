"""Provenance: every derived switch remembers where its value came from.

A value read from config.json, a class default taken because a key was absent, a user
option, or a loader decision with its reason -- each is recorded as a `Setting`, so
`mlaserve inspect` can print why the engine runs the way it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    value: Any
    source: str  # e.g. "config.json:kv_lora_rank", "class default", "user option", "loader: <reason>"


class ProvenanceLog:
    """An append-only list of Settings (mutable only while a config is being built)."""

    def __init__(self) -> None:
        self._items: dict[str, Setting] = {}

    def record(self, name: str, value: Any, source: str) -> Any:
        self._items[name] = Setting(name, value, source)
        return value

    def source(self, name: str) -> str:
        """Where a recorded setting's value came from (for error messages)."""
        return self._items[name].source

    def freeze(self) -> tuple[Setting, ...]:
        return tuple(self._items.values())


def format_table(settings: tuple[Setting, ...] | list[Setting]) -> str:
    """A plain-text table: name | value | source."""
    rows = [(s.name, _short(s.value), s.source) for s in settings]
    w0 = max([len("setting")] + [len(r[0]) for r in rows])
    w1 = max([len("value")] + [len(r[1]) for r in rows])
    lines = [f"{'setting':<{w0}}  {'value':<{w1}}  source", f"{'-' * w0}  {'-' * w1}  ------"]
    lines += [f"{n:<{w0}}  {v:<{w1}}  {s}" for n, v, s in rows]
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."

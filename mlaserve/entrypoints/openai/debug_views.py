"""The JSON the web page's configuration view reads (/debug/provenance, /debug/kernels, /debug/verify):
plain data built from what the server already holds; nothing here touches the engine's state.

"Differs from the checkpoint" is decided only where it is well defined: the checkpoint is a folder
with a config.json (a GGUF's metadata are mapped key by key by the loader, and their sources already
name the GGUF key), and the setting's name is itself a key of that config (or of its text_config, for
a multimodal wrapper read as its text model). A setting derived from a key under another name (`rope`
from `rope_parameters`) is not compared: its value is a summary, not the key's value. A setting whose
source is that very key ("config.json:mlp_layer_types") took the checkpoint's value by definition, in
the engine's vocabulary ("sparse" MLP layers are "moe"): shown beside it, never marked.
"""

from __future__ import annotations

import json
from pathlib import Path

# What a setting's value and a config.json value look like when they mean the same thing: a tuple is a
# JSON list, a torch dtype is its name ("torch.float32" -> "float32", as config.json's dtype writes it).
_DTYPE_PREFIX = "torch."


def jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def _comparable(value):
    value = jsonable(value)
    return value.removeprefix(_DTYPE_PREFIX) if isinstance(value, str) else value


def checkpoint_config(path: Path) -> tuple[dict | None, str]:
    """The checkpoint's own config (text_config merged under it for a wrapper), or None and why not."""
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return (
            None,
            f"{path.name} has no config.json (a GGUF file's metadata are mapped by the loader; each source names its key)",
        )
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{config.name} could not be read again: {e}"
    if not isinstance(raw, dict):
        return None, f"{config.name} is not a JSON object"
    text = raw.get("text_config")
    merged = {**raw, **text} if isinstance(text, dict) else raw
    return merged, "config.json"


def provenance_rows(settings, checkpoint: dict | None) -> list[dict]:
    """Every setting: name, value, source, the checkpoint's value of the same key (absent: not a key) and
    whether the engine runs with another value."""
    rows = []
    for s in settings:
        row = {"name": s.name, "value": jsonable(s.value), "source": s.source}
        if checkpoint is not None and s.name in checkpoint:
            read_from_it = s.source.endswith(f"config.json:{s.name}")
            row["checkpoint"] = jsonable(checkpoint[s.name])
            row["differs"] = not read_from_it and _comparable(s.value) != _comparable(checkpoint[s.name])
        rows.append(row)
    return rows


def kernel_rows(plan) -> dict:
    """The KernelPlan as the page's table: its digest (every ledger record carries it) and one row per
    (op, implementation, reason) with the layers that share it."""
    if plan is None:
        return {"digest": None, "rows": []}
    rows = [{"op": op, "impl": impl, "layers": layers, "reason": why} for op, impl, layers, why in plan.summary()]
    return {"digest": plan.digest, "rows": rows}


def verify_rows(checks) -> dict:
    """`serve --verify`'s checks as run before serving (None: the server was started without it)."""
    if checks is None:
        return {"ran": False, "why": "the server was started without --verify", "checks": []}
    out = [
        {
            "name": c.name,
            "max_abs_diff": c.max_abs_diff,
            "top1_agreement": c.top1_agreement,
            "tolerance": c.tolerance,
            "passed": c.passed,
        }
        for c in checks
    ]
    return {"ran": True, "passed": all(c["passed"] for c in out), "checks": out}

"""Shared helpers for the GGUF tests (this module holds no tests).

The fixtures live in ``../shared/fixtures/`` next to the repository; tests that need them skip
when that folder is absent.  `rewrite_gguf` makes modified copies of fixture files with the
``gguf`` package (a test-only dependency; the runtime code never imports it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # plain `pytest` (not `python -m pytest`) does not add the repo root
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT.parent / "shared" / "fixtures"
MODELS = ("ds3", "ds2lite", "ds32", "glm5")
TYPES = ("f32", "f16", "q8_0", "q4_k_m", "q4_0")


def need_fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip("GGUF fixtures not found: expected the folder ../shared/fixtures/ next to the repository")
    return FIXTURES


def fixture_files() -> list[tuple[str, str, Path]]:
    """(model, type, path) of every fixture GGUF present; [] when the fixtures are absent."""
    if not FIXTURES.is_dir():
        return []
    return [
        (m, t, FIXTURES / m / f"model-{t}.gguf")
        for m in MODELS
        for t in TYPES
        if (FIXTURES / m / f"model-{t}.gguf").is_file()
    ]


def fixture_params() -> list:
    """pytest params over all fixture files, or one param that skips when they are absent."""
    files = fixture_files()
    if not files:
        return [
            pytest.param(
                None,
                None,
                None,
                marks=pytest.mark.skip(
                    reason="GGUF fixtures not found: expected the folder ../shared/fixtures/ next to the repository"
                ),
            )
        ]
    return [pytest.param(m, t, p, id=f"{m}-{t}") for m, t, p in files]


def copy_kv(reader, writer, drop_keys=(), set_keys: dict | None = None) -> None:
    """Copy all metadata of a GGUFReader into a GGUFWriter (minus/plus some keys)."""
    import gguf

    set_keys = set_keys or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in set_keys.items():
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            vtype, sub = gguf.GGUFValueType.ARRAY, _array_type(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)


def _array_type(values: list):
    import gguf

    v = values[0]
    return (
        gguf.GGUFValueType.BOOL
        if isinstance(v, bool)
        else gguf.GGUFValueType.INT32
        if isinstance(v, int)
        else gguf.GGUFValueType.FLOAT32
        if isinstance(v, float)
        else gguf.GGUFValueType.STRING
    )


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    drop_keys=(),
    set_keys: dict | None = None,
    drop_tensors=(),
    replace: dict[str, np.ndarray] | None = None,
    add: dict[str, np.ndarray] | None = None,
    arch: str | None = None,
    split_max_tensors: int = 0,
    alignment: int | None = None,
) -> Path:
    """Write a modified copy of ``src``.

    replace/add: name -> float32 array in torch order (written as F32); set_keys: key ->
    (value, gguf.GGUFValueType).  Other tensors keep their type and bytes.
    """
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(
        dst, arch or reader.fields["general.architecture"].contents(), split_max_tensors=split_max_tensors
    )
    if alignment:
        writer.add_custom_alignment(alignment)
    copy_kv(reader, writer, drop_keys, set_keys)
    replace = replace or {}
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace:
            writer.add_tensor(t.name, np.ascontiguousarray(replace[t.name], dtype=np.float32))
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.ascontiguousarray(t.data))
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (add or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def gguf_f32(path: Path, name: str) -> np.ndarray:
    """A tensor of a GGUF file dequantized by the gguf package, torch order."""
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def hf_state_dict(get: Callable[[str], Any], names: list[str]) -> dict:
    """HF Hub names -> transformers' in-memory names (experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import torch

    sd: dict[str, Any] = {}
    experts: dict[str, dict[str, dict[int, Any]]] = {}
    for n in names:
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", n)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = get(n)
        else:
            sd[n] = get(n)
    for prefix, d in experts.items():
        n_exp = len(d["gate"])
        sd[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([d["gate"][e], d["up"][e]]) for e in range(n_exp)])
        sd[f"{prefix}.down_proj"] = torch.stack([d["down"][e] for e in range(n_exp)])
    return sd

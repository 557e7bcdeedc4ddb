"""Helpers for the robustness and fuzz tests (this module holds no tests): a tiny self-made model as
an HF folder and as a Q8_0 GGUF, and an independent walk of a GGUF header that tells where each
field lies, so a test can corrupt exactly one of them."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class KV:
    key: str
    vtype: int
    type_at: int  # byte offset of the u32 value type
    value_at: int  # byte offset of the value (for arrays: of the element type)


@dataclass
class TensorField:
    name: str
    n_dims_at: int
    ne_at: list[int]
    type_at: int
    offset_at: int


@dataclass
class Header:
    n_tensors_at: int = 8
    n_kv_at: int = 16
    kvs: dict[str, KV] = field(default_factory=dict)
    tensors: list[TensorField] = field(default_factory=list)
    end: int = 0


def walk_header(data: bytes) -> Header:
    """Where every metadata value and tensor-info field of a GGUF v3 header lies (spec order)."""
    h, pos = Header(), 8
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16

    def string(p: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", data, p)[0]
        return data[p + 8 : p + 8 + n].decode(), p + 8 + n

    def skip_value(vtype: int, p: int) -> int:
        if vtype == 8:
            return string(p)[1]
        if vtype == 9:
            etype, n = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(n):
                p = skip_value(etype, p)
            return p
        return p + struct.calcsize(_SCALAR[vtype])

    for _ in range(n_kv):
        key, pos = string(pos)
        vtype = struct.unpack_from("<I", data, pos)[0]
        h.kvs[key] = KV(key, vtype, pos, pos + 4)
        pos = skip_value(vtype, pos + 4)
    for _ in range(n_tensors):
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        ne_at = [pos + 4 + 8 * i for i in range(n_dims)]
        type_at = pos + 4 + 8 * n_dims
        h.tensors.append(TensorField(name, pos, ne_at, type_at, type_at + 4))
        pos = type_at + 12
    h.end = pos
    return h


def patched(data: bytes, at: int, payload: bytes) -> bytes:
    out = bytearray(data)
    out[at : at + len(payload)] = payload
    return bytes(out)


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


_TINY: dict[str, tuple[Path, Path]] = {}


def tiny_model(tmp_path_factory) -> tuple[Path, Path]:
    """make_tiny once per test session (read-only: copy before editing)."""
    if "tiny" not in _TINY:
        _TINY["tiny"] = make_tiny(tmp_path_factory.mktemp("robust-tiny"))
    return _TINY["tiny"]


def make_tiny(root: Path) -> tuple[Path, Path]:
    """(HF folder, Q8_0 GGUF) of the random tiny DeepSeek-V3 model (259 tokens, 3 layers, 8 experts)."""
    from mlaserve.embedded import build_random_tiny
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf

    folder = build_random_tiny(root / "random-tiny")
    gguf = root / "tiny-q8_0.gguf"
    convert_hf_to_gguf(folder, gguf, "q8_0")
    return folder, gguf

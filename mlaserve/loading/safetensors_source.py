"""Tensors of a Hugging Face folder, read lazily from memory-mapped safetensors files.

A folder holds `model.safetensors`, or shards listed by `model.safetensors.index.json`.
`get(name)` maps one tensor from its file on demand; nothing is read twice or all at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from mlaserve.loading.files import path_problem, read_json, regular_file


class WeightError(ValueError):
    """A checkpoint that does not match the model; the message names the file and tensor."""


# Bytes a file handle may have handed out before the loader's release() closes it: a handle's memory map
# keeps every page it has read resident, so a load would otherwise peak at the model plus the file.
RELEASE_BYTES = 256 << 20


class SafetensorsSource:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._file_of = self._index()
        self._handles: dict[Path, object] = {}
        self._read: dict[Path, int] = {}  # bytes handed out by each open handle
        self.bytes_read = 0  # tensor bytes read so far, every file (a load's share of the checkpoint)

    def _index(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        if path_problem(index) != "does not exist":
            weight_map = (read_json(index, WeightError) or {}).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightError(f'{index}: no "weight_map" object (tensor name -> file)')
            return {name: self.folder / file for name, file in weight_map.items()}
        single = self.folder / "model.safetensors"
        # Like transformers: model.safetensors alone when present (other .safetensors files in the
        # folder, e.g. test references, are not weights); otherwise every *.safetensors file.
        files = [single] if path_problem(single) != "does not exist" else sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{self.folder}: no *.safetensors file and no model.safetensors.index.json")
        out: dict[str, Path] = {}
        for f in files:
            for name in self._open(f).keys():
                if name in out:
                    raise WeightError(f"{f}: tensor {name!r} also appears in {out[name].name}")
                out[name] = f
        return out

    def _open(self, path: Path):
        regular_file(path, WeightError)  # a directory, FIFO or link loop named as such (a FIFO would block)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            why = header_problem(path)  # its messages name no tensor, or a neighbour of the bad one
            raise WeightError(f"{path}: cannot read safetensors file ({why or e})") from e

    def names(self) -> list[str]:
        return list(self._file_of)

    def where(self, name: str) -> str:
        return str(self._file_of[name])

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            if path_problem(path) == "does not exist":
                raise WeightError(f"{path}: file listed in the index is missing (needed for {name!r})")
            self._handles[path] = self._open(path)
        try:
            tensor = self._handles[path].get_tensor(name)
        except Exception as e:
            raise WeightError(f"{path}: cannot read tensor {name!r} ({e})") from e
        self._read[path] = self._read.get(path, 0) + tensor.nbytes
        self.bytes_read += tensor.nbytes
        return tensor

    def release(self, name: str) -> None:
        """The loader has copied this tensor: once its file's handle has handed out RELEASE_BYTES, close
        it (unmapping the pages it read); the next read opens the file again."""
        path = self._file_of[name]
        if self._read.get(path, 0) >= RELEASE_BYTES and path in self._handles:
            del self._handles[path]
            self._read[path] = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def stored_type(self, name: str) -> str:
        """The file's dtype name for a tensor ("BF16", "F32", "F8_E4M3", ...), from its header."""
        return self._slice(name).get_dtype()

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor, read as a slice: a rank of a
        tensor-parallel group reads its part of the file, not the whole tensor."""
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        try:
            part = self._slice(name)[index]
        except Exception as e:
            raise WeightError(f"{self.where(name)}: cannot read {name!r}[{index}] ({e})") from e
        path = self._file_of[name]
        self._read[path] = self._read.get(path, 0) + part.nbytes
        self.bytes_read += part.nbytes
        return part

    def _slice(self, name: str):
        path = self._file_of[name]
        if path not in self._handles:
            if path_problem(path) == "does not exist":
                raise WeightError(f"{path}: file listed in the index is missing (needed for {name!r})")
            self._handles[path] = self._open(path)
        return self._handles[path].get_slice(name)


_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def header_problem(path: Path) -> str | None:
    """What is wrong in a safetensors header, naming the tensor at fault: its dtype, shape or
    data_offsets (their span must be the shape's bytes), a range that leaves a gap or overlaps
    (the tensor whose range is off on both sides is named alone), or a data section that is not
    the file's remainder. None when nothing is found (the library's own message stands)."""
    import math
    import struct

    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            size = path.stat().st_size
            if n > size - 8:
                return f"header length {n} runs past the end of the {size}-byte file"
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        return f"unreadable header: {e}"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    ranges = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            return f"tensor {name!r}: its entry is not an object"
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            return f"tensor {name!r}: unknown dtype {dtype!r}"
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            return f"tensor {name!r}: shape {shape!r} is not a list of sizes"
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and o >= 0 for o in offs)):
            return f"tensor {name!r}: data_offsets {offs!r} is not [begin, end]"
        need = math.prod(shape) * _DTYPE_BYTES[dtype]
        if offs[1] - offs[0] != need:
            return (
                f"tensor {name!r}: {dtype} {shape} needs {need} bytes but data_offsets {offs} span {offs[1] - offs[0]}"
            )
        ranges.append((offs[0], offs[1], name))
    ranges.sort()
    ends = [0] + [r[1] for r in ranges]
    starts = [r[0] for r in ranges] + [size - 8 - n]
    off = [ends[i] != starts[i] for i in range(len(starts))]  # off[i]: the boundary before ranges[i]
    for i, (begin, end, name) in enumerate(ranges):
        if off[i] and off[i + 1]:
            return f"tensor {name!r}: data_offsets [{begin}, {end}] do not fit between its neighbours"
    for i, bad in enumerate(off):
        if not bad:
            continue
        before = f"{ranges[i - 1][2]!r} ends at {ends[i]}" if i else "the data starts at 0"
        if i == len(ranges):
            return f"{before} but the file holds {starts[i]} bytes of data (truncated or padded)"
        return f"tensor {ranges[i][2]!r} starts at {starts[i]} but {before} (a gap or an overlap)"
    return None

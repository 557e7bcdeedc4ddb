"""Tensors of a Hugging Face folder, read lazily from memory-mapped safetensors files.

A folder holds `model.safetensors`, or shards listed by `model.safetensors.index.json`.
`get(name)` maps one tensor from its file on demand; nothing is read twice or all at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


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

    def _index(self) -> dict[str, Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.folder / file for name, file in weight_map.items()}
        single = self.folder / "model.safetensors"
        # Like transformers: model.safetensors alone when present (other .safetensors files in the
        # folder, e.g. test references, are not weights); otherwise every *.safetensors file.
        files = [single] if single.exists() else sorted(self.folder.glob("*.safetensors"))
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
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightError(f"{path}: cannot read safetensors file ({e})") from e

    def names(self) -> list[str]:
        return list(self._file_of)

    def where(self, name: str) -> str:
        return str(self._file_of[name])

    def get(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        if path not in self._handles:
            if not path.exists():
                raise WeightError(f"{path}: file listed in the index is missing (needed for {name!r})")
            self._handles[path] = self._open(path)
        try:
            tensor = self._handles[path].get_tensor(name)
        except Exception as e:
            raise WeightError(f"{path}: cannot read tensor {name!r} ({e})") from e
        self._read[path] = self._read.get(path, 0) + tensor.nbytes
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
        return part

    def _slice(self, name: str):
        path = self._file_of[name]
        if path not in self._handles:
            if not path.exists():
                raise WeightError(f"{path}: file listed in the index is missing (needed for {name!r})")
            self._handles[path] = self._open(path)
        return self._handles[path].get_slice(name)

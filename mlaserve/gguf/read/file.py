"""GGUF v2/v3 container parser (memory-mapped, no full copy in RAM), incl. split GGUF files.

Notation: a GGUF file is
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv x (key, u32 type, value)
    | n_tensors x (name, u32 n_dims, n_dims x u64 ne, u32 ggml_type, u64 offset)
    | padding to `general.alignment` (default 32) | tensor data
All integers little-endian; strings are u64 length + UTF-8 bytes.  ``ne`` is ggml's dimension
order (ne[0] = innermost / row length), so the torch shape is ``reversed(ne)``.  A tensor's
``offset`` is relative to the start of the data section.

A model split by llama.cpp's gguf-split is ``<stem>-00001-of-0000N.gguf`` ... with keys
``split.no`` / ``split.count`` / ``split.tensors.count``; the first shard holds the metadata.
`open_gguf` merges the shards into one `GGUFFile` view.

Errors are `GGUFError` (a ValueError) and always name the file (and the tensor or key).
"""

from __future__ import annotations

import mmap
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlaserve.gguf.quants import GGML_TYPES, dequantize, tensor_nbytes
from mlaserve.gguf.read.header import DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, Cursor, GGUFError, TensorInfo

# raw bytes [nbytes] uint8, ggml type id, torch shape -> the float32 tensor, or None where it does not decode that type
Decoder = Callable[[torch.Tensor, int, tuple[int, ...]], "torch.Tensor | None"]
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFShard:
    """One GGUF file: parsed header plus a copy-on-write memory map of its bytes.

    The map is private (mode 'c'): tensors handed out alias the file's pages, and writing to
    them never reaches the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        if self.path.stat().st_size < 4:
            raise GGUFError(f"{self.path}: truncated file ({self.path.stat().st_size} bytes), not GGUF")
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="c")
        self.shared: np.memmap | None = None  # the read-only shared map for views kept in place (`view`)
        cur = Cursor(self.mm, self.path)
        try:
            self._read_preamble(cur)
            self.metadata, self.value_types = self._read_kv(cur)
            self.alignment = self._alignment()
            infos = self._read_tensor_infos(cur)
        finally:
            cur.release()
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._place_tensors(infos)

    # -- header parts -------------------------------------------------------------------------
    def _read_preamble(self, cur: Cursor) -> None:
        magic = self.mm[:4].tobytes()
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: bad magic {magic!r}, expected {GGUF_MAGIC!r} (not a GGUF file)")
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            hint = " (a big-endian GGUF?)" if self.version > 0xFFFF else ""
            raise GGUFError(
                f"{self.path}: unsupported GGUF version {self.version}{hint}; only versions 2 and 3 are supported"
            )
        self.n_tensors, self.n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        # Each entry takes at least this many header bytes: an absurd count is a corrupt header, not
        # a reason to loop 2^63 times (or to report the first garbage entry as the fault).
        for what, count, least in (("n_tensors", self.n_tensors, 28), ("n_kv", self.n_kv, 13)):
            if count * least > len(self.mm):
                raise GGUFError(
                    f"{self.path}: truncated file or corrupt header: it says {what}={count}, which needs at "
                    f"least {count * least} bytes, and the file has {len(self.mm)}"
                )

    def _read_kv(self, cur: Cursor) -> tuple[dict[str, Any], dict[str, int]]:
        meta: dict[str, Any] = {}
        types: dict[str, int] = {}
        for _ in range(self.n_kv):
            key = cur.string()
            vtype = cur.scalar("<I")
            if key in meta:
                raise GGUFError(f"{self.path}: duplicate metadata key '{key}'")
            meta[key], types[key] = cur.value(vtype, key), vtype
        return meta, types

    def _alignment(self) -> int:
        a = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(a, int) or a <= 0 or a & (a - 1):
            raise GGUFError(f"{self.path}: general.alignment must be a power of two, got {a!r}")
        return a

    def _read_tensor_infos(self, cur: Cursor) -> list[tuple[str, tuple[int, ...], int, int]]:
        infos, seen = [], set()
        for i in range(self.n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(
                    f"{self.path}: tensor '{name}' (tensor info {i + 1} of n_tensors={self.n_tensors}) has {n_dims} "
                    f"dimensions (1..{MAX_DIMS} allowed): a corrupt header, or n_tensors / n_kv={self.n_kv} is wrong"
                )
            ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
            ggml_type, offset = cur.scalar("<I"), cur.scalar("<Q")
            if name in seen:
                raise GGUFError(f"{self.path}: duplicate tensor name '{name}'")
            seen.add(name)
            infos.append((name, ne, ggml_type, offset))
        return infos

    def _place_tensors(self, infos) -> dict[str, TensorInfo]:
        """Each tensor's data range, checked as llama.cpp does: in header order, tensor k starts where
        tensor k-1's data (padded to the alignment) ends, so ranges lie inside the data section, never
        overlap and are exactly the byte size their type and shape imply."""
        out: dict[str, TensorInfo] = {}
        size, expect, prev = len(self.mm), 0, None
        for name, ne, ggml_type, rel in infos:
            if ggml_type not in GGML_TYPES:
                raise GGUFError(f"{self.path}: tensor '{name}' has unknown ggml type id {ggml_type}")
            block = GGML_TYPES[ggml_type].block_size
            if ne[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor '{name}' row length {ne[0]} is not a multiple of "
                    f"the {GGML_TYPES[ggml_type].name} block size {block}"
                )
            if rel % self.alignment:
                raise GGUFError(
                    f"{self.path}: tensor '{name}' data offset {rel} is not aligned to {self._alignment_said()}"
                )
            start, nbytes = self.data_offset + rel, tensor_nbytes(ggml_type, ne)
            if rel != expect:
                raise GGUFError(
                    f"{self.path}: tensor '{name}' data offset {rel} should be {expect}: "
                    + (
                        f"the {prev} data before it takes bytes up to {expect}"
                        if prev
                        else "the first tensor starts at 0"
                    )
                    + (" (the ranges overlap)" if rel < expect else " (a gap: a size or offset is wrong)")
                )
            expect, prev = rel + -(-nbytes // self.alignment) * self.alignment, f"'{name}' ({nbytes} bytes)"
            if start + nbytes > size:
                raise GGUFError(
                    f"{self.path}: truncated file: tensor '{name}' needs bytes {start}..{start + nbytes} "
                    f"but the file has {size} bytes"
                )
            out[name] = TensorInfo(name, ne, ggml_type, start, nbytes, self.path)
        # Writers pad each tensor to the alignment, so the data ends within one alignment of the
        # file's end. An alignment smaller than the one the data was written with starts the data
        # section early (the header's end rounded up less far): every tensor would be read shifted,
        # and at least one alignment's worth of bytes is left over at the end.
        trailing = size - (self.data_offset + expect)
        if out and trailing >= self.alignment:
            raise GGUFError(
                f"{self.path}: {trailing} bytes follow the last tensor's data (from byte "
                f"{self.data_offset + expect}) with {self._alignment_said()}: the alignment does not match "
                "the data (every tensor would be read shifted), or the file has bytes appended"
            )
        return out

    def _alignment_said(self) -> str:
        if "general.alignment" in self.metadata:
            return f"general.alignment={self.alignment}"
        return f"the default alignment {self.alignment} (no general.alignment key)"

    # -- data ---------------------------------------------------------------------------------
    def raw(self, info: TensorInfo, start: int = 0, length: int | None = None) -> torch.Tensor:
        """uint8 view (no copy) of a tensor's bytes, optionally a sub-range of them."""
        length = info.nbytes - start if length is None else length
        view = np.asarray(self.mm[info.offset + start : info.offset + start + length])
        return torch.from_numpy(view)

    def view(self, info: TensorInfo, start: int = 0, length: int | None = None) -> torch.Tensor:
        """uint8 view of a tensor's bytes in a read-only, shared map of the file, for weights kept in place.

        Unlike `raw`'s private map, these pages are the page cache's own: every process that maps the
        file reads the same physical pages, and nothing here can write to them (a write would fault, so
        a holder over such a view must never be modified in place). The address is the map's (page
        aligned) plus the tensor's offset, which the file aligns to `general.alignment`."""
        if self.shared is None:
            self.shared = np.memmap(self.path, dtype=np.uint8, mode="r")
        length = info.nbytes - start if length is None else length
        view = np.asarray(self.shared[info.offset + start : info.offset + start + length])
        with warnings.catch_warnings():  # torch warns that the array is not writable: that is the point
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(view)


def _release(mm: np.memmap, start: int, length: int) -> None:
    """Drop the pages of bytes [start, start + length) from this process's memory (the map is never
    written, so a later read faults them in from the file again): the loader calls it after copying a
    tensor, so file pages do not pile up on top of the copies while a model loads."""
    raw = getattr(mm, "_mmap", None)
    if raw is None or not hasattr(raw, "madvise") or length <= 0:
        return
    page = mmap.PAGESIZE
    lo = (mm.offset + start) // page * page  # whole pages; neighbours' pages refault if still needed
    raw.madvise(mmap.MADV_DONTNEED, lo, mm.offset + start + length - lo)


class GGUFFile:
    """One logical GGUF model, possibly made of several split shards.

    ``metadata`` comes from the first shard (split shards repeat only the split.* keys);
    ``tensors`` maps every tensor name of every shard to its `TensorInfo`.
    """

    def __init__(self, shards: list[GGUFShard]):
        self.shards = shards
        self.path = shards[0].path
        self.paths = [s.path for s in shards]
        self.version = shards[0].version
        self.metadata = dict(shards[0].metadata)
        self.value_types = dict(shards[0].value_types)
        self.tensors: dict[str, TensorInfo] = {}
        self._shard_of: dict[str, GGUFShard] = {}
        for shard in shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{shard.path}: duplicate tensor name '{name}' (also in {self.tensors[name].path})")
                self.tensors[name], self._shard_of[name] = info, shard
        # bytes of tensor data handed out by raw() and view() (views of a map the caller copies or keeps in
        # place): what a load took from the file, e.g. an expert-parallel rank's share of it
        # (distributed/expert_source.py); a kept view's pages come in when a step first reads them
        self.bytes_read = 0
        # how tensor() / slice0() decode block types: None = the reference (gguf/quants.py); the loader sets the
        # native kernels' decoder (bit-identical with it) where the engine runs them (loading/model_loader.py)
        self.decoder: Decoder | None = None

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor named '{name}'")
        return self.tensors[name]

    def raw(self, name: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        info = self.info(name)
        view = self._shard_of[name].raw(info, start, length)
        self.bytes_read += view.numel()
        return view

    def view(self, name: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        """As `raw`, but from the read-only shared map (GGUFShard.view): for bytes kept in place."""
        info = self.info(name)
        view = self._shard_of[name].view(info, start, length)
        self.bytes_read += view.numel()
        return view

    def release(self, name: str, start: int = 0, length: int | None = None) -> None:
        """Drop a copied tensor's (or a byte range of it) file pages from memory (see _release)."""
        info = self.info(name)
        length = info.nbytes - start if length is None else length
        shard = self._shard_of[name]
        for mm in (shard.mm, shard.shared):  # copied out of either map (the shared one's pages stay cached)
            if mm is not None:
                _release(mm, info.offset + start, length)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, torch shape (F32 tensors: a view of the file)."""
        info = self.info(name)
        return _dequant(info, self.raw(name), info.shape, self.decoder)

    def slice0(self, name: str, index: int) -> torch.Tensor:
        """Dequantize only ``tensor[index]`` (outermost torch dim), reading just its bytes.

        Valid because each slice of the outermost dim is a whole number of rows, hence blocks.
        """
        info = self.info(name)
        n0 = info.shape[0]
        if not 0 <= index < n0:
            raise IndexError(f"{self.path}: index {index} out of range for '{name}' with {n0} slices")
        per = info.nbytes // n0
        return _dequant(info, self.raw(name, index * per, per), info.shape[1:], self.decoder)

    def close(self) -> None:
        """Drop our references to the maps (tensors already handed out keep theirs alive)."""
        for s in self.shards:
            s.mm = s.shared = None


def _dequant(info: TensorInfo, raw: torch.Tensor, shape, decoder: Decoder | None = None) -> torch.Tensor:
    if decoder is not None:
        out = decoder(raw, info.ggml_type, tuple(shape))
        if out is not None:
            return out
    try:
        return dequantize(raw, info.ggml_type, shape)
    except NotImplementedError as e:
        raise GGUFError(f"{info.path}: tensor '{info.name}': {e}") from None


def split_paths(path: str | Path) -> list[Path]:
    """All shard paths of the model ``path`` belongs to (just [path] when it is not split)."""
    path = Path(path)
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _check_split(shards: list[GGUFShard]) -> None:
    count = len(shards)
    for i, s in enumerate(shards):
        no, n = s.metadata.get("split.no"), s.metadata.get("split.count")
        if n is None and count == 1:
            continue
        if n != count or no != i:
            raise GGUFError(f"{s.path}: split.no={no}, split.count={n}, expected shard {i} of {count}")
    total = shards[0].metadata.get("split.tensors.count")
    found = sum(len(s.tensors) for s in shards)
    if total is not None and count > 1 and total != found:
        raise GGUFError(f"{shards[0].path}: split.tensors.count={total} but the {count} shards hold {found} tensors")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF model; a path to any shard of a split model opens all of its shards."""
    paths = split_paths(path)
    if not Path(path).is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: split GGUF is missing shard(s): {', '.join(str(p) for p in missing)}")
    shards = [GGUFShard(p) for p in paths]
    if len(shards) == 1 and shards[0].metadata.get("split.count", 1) > 1:
        raise GGUFError(
            f"{path}: file declares split.count={shards[0].metadata['split.count']} "
            "but its name does not follow <stem>-00001-of-0000N.gguf, so the shards cannot be found"
        )
    _check_split(shards)
    return GGUFFile(shards)

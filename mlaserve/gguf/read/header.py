"""The GGUF header's pieces (gguf/read/file.py reads the container with them): the format's constants, its metadata
value types, the error every reader raises, a tensor's place in its file, and the cursor over the mapped header.

Notation (file.py has the whole layout): metadata values are typed by a u32 id (VALUE_TYPES); strings are a u64
length and UTF-8 bytes; arrays a u32 element type, a u64 count and the elements.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlaserve.gguf.quants import GGML_TYPES

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF metadata value types: id -> (name, struct format or None for string/array)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"),
    1: ("INT8", "<b"),
    2: ("UINT16", "<H"),
    3: ("INT16", "<h"),
    4: ("UINT32", "<I"),
    5: ("INT32", "<i"),
    6: ("FLOAT32", "<f"),
    7: ("BOOL", "<?"),
    8: ("STRING", None),
    9: ("ARRAY", None),
    10: ("UINT64", "<Q"),
    11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}
_NUMPY_OF = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """A GGUF file is malformed or does not describe a model we can load."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order
    ggml_type: int
    offset: int  # absolute byte offset in `path`
    nbytes: int
    path: Path

    @property
    def shape(self) -> tuple[int, ...]:
        """torch shape (outermost first)."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name


class Cursor:
    """Sequential little-endian reader over the mapped header; reports truncation clearly.

    Reads go through a memoryview of the map (struct.unpack_from and str() on its slices): a
    numpy slice per value cost ~5 us, and a tokenizer's vocabulary is 10^5 strings."""

    def __init__(self, buf: np.ndarray, path: Path):
        self.buf, self.path, self.pos = memoryview(buf), path, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated file: the header needs bytes {start}..{start + n} "
                f"but the file has {len(self.buf)} bytes"
            )
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return self._decode(start, n)

    def _decode(self, start: int, n: int) -> str:
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: invalid UTF-8 string at byte {start}: {e}") from None

    def value(self, vtype: int, key: str) -> Any:
        if vtype not in VALUE_TYPES:
            raise GGUFError(f"{self.path}: metadata key '{key}' has unknown value type {vtype}")
        if vtype == 8:
            return self.string()
        if vtype == 9:
            return self.array(key)
        return self.scalar(VALUE_TYPES[vtype][1])

    def array(self, key: str) -> list:
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in _NUMPY_OF:
            # numeric arrays (e.g. token types, per-layer values) in one go
            width = np.dtype(_NUMPY_OF[etype]).itemsize
            start = self.take(n * width)
            arr = np.frombuffer(self.buf, dtype=_NUMPY_OF[etype], count=n, offset=start)
            return [bool(x) for x in arr] if etype == 7 else arr.tolist()
        if etype == 8:
            return self.strings(n)
        return [self.value(etype, key) for _ in range(n)]

    def strings(self, n: int) -> list[str]:
        """n strings in a row (a vocabulary, merges): the loop of `string` with its lookups hoisted."""
        buf, pos, size, unpack, out = self.buf, self.pos, len(self.buf), _U64.unpack_from, []
        for _ in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.take(8)  # raises: truncated
            (k,) = unpack(buf, pos)
            pos += 8
            if pos + k > size:
                self.pos = pos
                self.take(k)  # raises: truncated
            try:
                out.append(str(buf[pos : pos + k], "utf-8"))
            except UnicodeDecodeError:
                self._decode(pos, k)  # raises, naming the byte
            pos += k
        self.pos = pos
        return out

    def release(self) -> None:
        """Let go of the memoryview, so the map can be closed."""
        self.buf.release()

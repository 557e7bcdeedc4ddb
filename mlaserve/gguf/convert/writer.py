"""GGUF v3 writer (streaming) and the float -> ggml quantizers: F32, F16, BF16, Q8_0, I32 (integer ids) (and Q4_0, for
quantize-at-load).

Notation: the file written is
    magic "GGUF" | u32 version=3 | u64 n_tensors | u64 n_kv | n_kv x (key, u32 type, value)
    | n_tensors x (name, u32 n_dims, n_dims x u64 ne, u32 ggml_type, u64 offset)
    | zero padding to `alignment` | tensor data, each tensor padded to `alignment`
(little-endian; strings are u64 length + UTF-8; arrays are u32 element type + u64 count +
elements).  ``shape`` is torch order (outermost first), ``ne`` = reversed(shape) is ggml's;
a *row* is the last torch dim (ne[0]) and quantization blocks never cross rows.  Offsets are
relative to the start of the data section.  Like llama.cpp's gguf-py writer we pad after the
last tensor too, and write ``general.alignment`` only when it is not the default 32.

Streaming: all tensor infos (name, shape, type) are declared first, so every offset is known
before any data exists; then `GGUFWriter.write` asks for each tensor's data as an iterator of
float chunks (whole rows each), quantizes a chunk, writes it and drops it.  Peak memory is one
chunk, never the model.  The file appears under its name only when complete (written to
``<name>.part``, then renamed).

MXFP4 (RAW_TYPES) is not quantized here: its chunks are uint8 rows already in ggml's block layout (DeepSeek-V4's
FP4 experts repacked by gguf/convert/deepseek_v4.py) and are written as they are.

The quantizers reproduce gguf-py's ``gguf.quants.quantize`` bit for bit (which in turn matches
ggml's C reference); they must keep its float32 operation order -- see `quantize_q8_0`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES, tensor_nbytes
from mlaserve.gguf.read.header import DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS

GGUF_VERSION = 3
F32, F16, BF16, Q8_0, Q4_0, I32, MXFP4 = (
    GGML_TYPE_IDS[n] for n in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "I32", "MXFP4")
)
RAW_TYPES = (MXFP4,)  # written from blocks made elsewhere (DeepSeek-V4's FP4 experts repacked): chunks are bytes

# GGUF metadata value type ids
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FMT = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}
_NUMPY_OF = {
    UINT8: "<u1",
    INT8: "<i1",
    UINT16: "<u2",
    INT16: "<i2",
    UINT32: "<u4",
    INT32: "<i4",
    FLOAT32: "<f4",
    BOOL: "<u1",
    UINT64: "<u8",
    INT64: "<i8",
    FLOAT64: "<f8",
}


class GGUFWriteError(ValueError):
    """Something that cannot be written as (valid) GGUF; the message names the key or tensor."""


# =============================================================================================
# metadata values


@dataclass(frozen=True)
class MetaValue:
    """A metadata value with its GGUF type (``subtype`` = element type of an ARRAY)."""

    value: Any
    vtype: int
    subtype: int | None = None


def u32(x: int) -> MetaValue:
    return MetaValue(int(x), UINT32)


def i32(x: int) -> MetaValue:
    return MetaValue(int(x), INT32)


def f32(x: float) -> MetaValue:
    return MetaValue(float(x), FLOAT32)


def boolean(x: bool) -> MetaValue:
    return MetaValue(bool(x), BOOL)


def string(x: str) -> MetaValue:
    return MetaValue(str(x), STRING)


def array(values: Sequence[Any], subtype: int) -> MetaValue:
    return MetaValue(list(values), ARRAY, subtype)


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pack_scalar(x: Any, vtype: int, key: str) -> bytes:
    try:
        return struct.pack(_SCALAR_FMT[vtype], x)
    except (struct.error, KeyError) as e:
        raise GGUFWriteError(f"metadata key '{key}': cannot store {x!r} as GGUF type {vtype}: {e}") from None


def _pack_array(values: list, subtype: int, key: str) -> bytes:
    if not values:  # llama.cpp rejects empty arrays (gguf-py refuses to write them)
        raise GGUFWriteError(f"metadata key '{key}': empty array")
    head = struct.pack("<IQ", subtype, len(values))
    if subtype == STRING:
        return head + b"".join(_pack_string(v) for v in values)
    if subtype in _NUMPY_OF:  # token types of a 150k vocabulary: one numpy call, not 150k packs
        arr = np.asarray(values)
        out = arr.astype(_NUMPY_OF[subtype])
        if not np.array_equal(out.astype(arr.dtype), arr):
            raise GGUFWriteError(f"metadata key '{key}': values do not fit GGUF type {subtype}")
        return head + out.tobytes()
    raise GGUFWriteError(f"metadata key '{key}': arrays of type {subtype} are not supported")


def pack_value(key: str, v: MetaValue) -> bytes:
    """The bytes of one KV pair: key, u32 type, value."""
    out = _pack_string(key) + struct.pack("<I", v.vtype)
    if v.vtype == STRING:
        return out + _pack_string(v.value)
    if v.vtype == ARRAY:
        return out + _pack_array(v.value, v.subtype, key)
    return out + _pack_scalar(v.value, v.vtype, key)


# =============================================================================================
# quantizers: float tensor (rows = last dim) -> uint8 bytes in ggml layout


def quantize_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.uint8)


def quantize_f16(x: torch.Tensor) -> torch.Tensor:
    """numpy's astype(float16) and torch's cast both round to nearest even (overflow -> inf);
    they differ only for NaN, where numpy keeps the payload's top bits without quieting."""
    x = x.to(torch.float32).contiguous()
    h = x.to(torch.float16).view(torch.int16)
    nan = torch.isnan(x)
    if bool(nan.any()):
        bits = x.view(torch.int32)
        ret = 0x7C00 + ((bits & 0x7FFFFF) >> 13)
        ret = torch.where(ret == 0x7C00, ret + 1, ret) | ((bits >> 16) & 0x8000)
        h = torch.where(nan, (ret - ((ret >> 15) << 16)).to(torch.int16), h)  # as signed 16-bit
    return h.view(torch.uint8)


def quantize_bf16(x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16: NaN -> quiet NaN, else round the top 16 bits to nearest even.

    Done on the bits rather than with torch's cast, so NaN payloads match gguf-py too.  int32
    arithmetic is enough: after quieting NaNs, adding at most 0x8000 never wraps past 2**32, and
    the arithmetic shift leaves exactly the 16 bits wanted in int16 range.
    """
    n = x.to(torch.float32).contiguous().view(torch.int32)
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(is_nan, (n & -65536) | (64 << 16), n)  # -65536 == 0xFFFF0000
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n.to(torch.int16).view(torch.uint8)


def quantize_i32(x: torch.Tensor) -> torch.Tensor:
    """Integers (DeepSeek-V4's tid2eid expert ids) as little-endian int32; a float or out-of-range value is refused
    rather than truncated."""
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise GGUFWriteError(f"I32: integer values expected, got {x.dtype}")
    if x.numel() and (int(x.min()) < -(2**31) or int(x.max()) >= 2**31):
        raise GGUFWriteError("I32: a value does not fit in 32 bits")
    return x.to(torch.int32).contiguous().view(torch.uint8)


def _roundf_(v: torch.Tensor) -> torch.Tensor:
    """C roundf (half away from zero) as gguf-py's np_roundf computes it in float32:
    sign(v) * (floor(|v|) + floor(2 * (|v| - floor(|v|)))).  In place where possible (speed)."""
    a = v.abs()
    floored = torch.floor(a)
    a.sub_(floored).mul_(2).floor_().add_(floored)
    return a.mul_(torch.sign(v))


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: d = max|x|/127 stored as fp16, then 32 int8 q = roundf(x * (1/d)).

    Same float32 operations in the same order as gguf-py (divide by 127, reciprocal, multiply,
    round): ``x / d`` instead of ``x * (1/d)`` would differ in the last bit for some values.
    Non-finite input is refused: gguf-py's result for it is an undefined float->int8 cast.
    """
    blocks = x.to(torch.float32).reshape(-1, 32)
    if not bool(torch.isfinite(blocks).all()):
        raise GGUFWriteError("Q8_0: the tensor holds NaN or Inf values")
    amax = blocks.abs().amax(dim=1, keepdim=True)
    d = amax / torch.full_like(amax, 127.0)  # elementwise division, as numpy does
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    q = _roundf_(blocks * inv).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8)  # [n, 2] little-endian fp16
    return torch.cat([scale, q.view(torch.uint8)], dim=1).reshape(-1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: d = (the value of largest magnitude) / -8 stored as fp16, then 4-bit
    q = min(15, trunc(x * (1/d) + 8.5)), two per byte (value j low nibble, j + 16 high), as gguf-py.
    1/d is taken of the fp32 d (before its fp16 rounding), as gguf-py and ggml do."""
    blocks = x.to(torch.float32).reshape(-1, 32)
    if not bool(torch.isfinite(blocks).all()):
        raise GGUFWriteError("Q4_0: the tensor holds NaN or Inf values")
    peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))  # first of equal magnitudes
    d = peak / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / d)
    q = torch.trunc(blocks * inv + 8.5).to(torch.uint8).clamp_(0, 15)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([d.to(torch.float16).view(torch.uint8), packed], dim=1).reshape(-1)


QUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: quantize_f32,
    F16: quantize_f16,
    BF16: quantize_bf16,
    Q4_0: quantize_q4_0,
    Q8_0: quantize_q8_0,
    I32: quantize_i32,
}


def can_quantize(ggml_type: int, row_length: int) -> bool:
    """Whether rows of this length are whole blocks of the type (gguf-py's can_quantize)."""
    return ggml_type in QUANTIZERS and row_length % GGML_TYPES[ggml_type].block_size == 0


def quantize(x: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Float tensor -> its bytes in ggml type ``ggml_type`` (uint8, 1-D)."""
    if ggml_type not in QUANTIZERS:
        raise GGUFWriteError(
            f"quantization to {GGML_TYPES[ggml_type].name} is not implemented "
            f"(available: {', '.join(GGML_TYPES[t].name for t in QUANTIZERS)})"
        )
    if x.dim() == 0 or not can_quantize(ggml_type, x.shape[-1]):
        raise GGUFWriteError(
            f"rows of length {x.shape[-1] if x.dim() else 0} are not whole {GGML_TYPES[ggml_type].name} blocks"
        )
    return QUANTIZERS[ggml_type](x).reshape(-1)


# =============================================================================================
# the writer


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    offset: int  # relative to the data section

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.ne)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class GGUFWriter:
    """Collect metadata and tensor declarations, then `write` the file in one streaming pass."""

    def __init__(self, path: str | Path, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFWriteError(f"alignment must be a power of two, got {alignment}")
        self.path, self.alignment = Path(path), alignment
        self.kv: dict[str, MetaValue] = {}
        self.tensors: list[TensorSpec] = []
        self._names: set[str] = set()
        self._data_size = 0
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", u32(alignment))

    def add(self, key: str, value: MetaValue) -> None:
        if key in self.kv:  # llama.cpp's reader rejects files with duplicate keys
            raise GGUFWriteError(f"metadata key '{key}' added twice")
        pack_value(key, value)  # fail here, naming the key, rather than when the header is written
        self.kv[key] = value

    def add_tensor(self, name: str, shape: Sequence[int], ggml_type: int) -> TensorSpec:
        shape = tuple(int(s) for s in shape)
        if name in self._names:
            raise GGUFWriteError(f"tensor '{name}' added twice")
        if not 1 <= len(shape) <= MAX_DIMS:
            raise GGUFWriteError(f"tensor '{name}' has {len(shape)} dimensions (1..{MAX_DIMS} allowed)")
        raw = ggml_type in RAW_TYPES and shape[-1] % GGML_TYPES[ggml_type].block_size == 0
        if not raw and not can_quantize(ggml_type, shape[-1]):
            raise GGUFWriteError(
                f"tensor '{name}': rows of length {shape[-1]} cannot be stored as {GGML_TYPES[ggml_type].name}"
            )
        spec = TensorSpec(name, shape, ggml_type, self._data_size)
        self._data_size = _pad(self._data_size + spec.nbytes, self.alignment)
        self.tensors.append(spec)
        self._names.add(name)
        return spec

    def header(self) -> bytes:
        """Everything before the data section, padding included."""
        out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv)))
        for key, value in self.kv.items():
            out += pack_value(key, value)
        for t in self.tensors:
            out += _pack_string(t.name) + struct.pack("<I", len(t.ne))
            out += struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.ggml_type, t.offset)
        out += bytes(_pad(len(out), self.alignment) - len(out))
        return bytes(out)

    def write(self, chunks_of: Callable[[TensorSpec], Iterable[torch.Tensor]]) -> Path:
        """Write the file; ``chunks_of(spec)`` yields the tensor's values as float tensors of whole
        rows, in storage order (outermost index slowest)."""
        part = self.path.with_name(self.path.name + ".part")
        try:
            with open(part, "wb") as f:
                f.write(self.header())
                for spec in self.tensors:
                    self._write_tensor(f, spec, chunks_of(spec))
            os.replace(part, self.path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        return self.path

    def _write_tensor(self, f, spec: TensorSpec, chunks: Iterable[torch.Tensor]) -> None:
        written, row = 0, spec.shape[-1]
        if spec.ggml_type in RAW_TYPES:  # uint8 rows of blocks, already in the type's layout
            row = tensor_nbytes(spec.ggml_type, (row,))
        for chunk in chunks:
            if spec.ggml_type in RAW_TYPES:
                data = chunk.contiguous().view(torch.uint8).reshape(-1)
                if chunk.dtype != torch.uint8 or data.numel() % row:
                    raise GGUFWriteError(f"tensor '{spec.name}': {chunk.dtype} chunk is not whole rows of {row} bytes")
                written += data.numel()
                if written > spec.nbytes:
                    break
                f.write(data.numpy())
                continue
            if chunk.numel() % row:
                raise GGUFWriteError(
                    f"tensor '{spec.name}': a chunk of {chunk.numel()} values is not whole rows of {row}"
                )
            try:
                data = quantize(chunk.reshape(-1, row), spec.ggml_type)
            except GGUFWriteError as e:
                raise GGUFWriteError(f"tensor '{spec.name}': {e}") from None
            written += data.numel()
            if written > spec.nbytes:
                break
            f.write(data.numpy())  # buffer protocol: no copy
        if written != spec.nbytes:
            raise GGUFWriteError(
                f"tensor '{spec.name}': got {written} bytes of data, its shape "
                f"{list(spec.shape)} as {GGML_TYPES[spec.ggml_type].name} needs {spec.nbytes}"
            )
        f.write(bytes(_pad(spec.nbytes, self.alignment) - spec.nbytes))

"""A state kept in 8 bits (kv_cache_dtype int8 / fp8_e4m3): codes, block scales, kept values; or in 16 bits
(kv_cache_dtype float16 / bfloat16): every value of the row as one 16-bit float, no scales, nothing kept.

Notation (one layer's state; the format is config/row_format.py's RowFormat)
  L the leading dims: (S + 1,) for a paged state of S rows and the zero pad row; (N + 1, W) for a request
  state of W rows per slot (DeepSeek-V4's window ring, N slots and the pad slot) or its page snapshots (P + 1, W)
  q = fmt.quantized values as codes, nb = q / fmt.block scales, k = fmt.kept
  codes  [*L, q]   uint8 bytes: int8 codes, or FP8 e4m3 bit patterns (viewed as float8_e4m3fn to decode)
  scales [*L, nb]  one per block of fmt.block codes: fp32 ("amax"), or uint8 e8m0 exponents ("ue8m0": a
                   power-of-two scale held exactly in one byte, encode_scales / decode_scales)
  kept   [*L, k]   the compute dtype (the latent row's k_pe, V4's rope part); absent when k = 0 (index keys)
  a row = [dequantize(codes, scales) (q) | kept (k)], as the full cache's row [c_kv | k_pe] or [key]
  16-bit (fmt.half): codes [*L, width] float16 / bfloat16 (torch's round-to-nearest-even cast of the row), scales
  and kept absent; a row = codes in the compute dtype (exact: every 16-bit value is an fp32 value)
Quantized once, at the cache write (`index_copy_` / `index_put_`, the signatures of the tensor it replaces, so
the layers' writes are the same line); every reader gathers rows through `rows(slots)` / `index_select` and gets
them dequantized in the compute dtype: the backends' row gathers (attention/backends/blocks.gather_rows, the
reference's gather) ask for it, and nothing else reads the codes. Zero codes and scales read as zeros (the pad
row, a reset slot). Moving rows between two 8-bit states (a prefix hit's snapshot into a slot, a rollback's saved
slot back) copies the parts as they are (`take`, then `index_copy_` of a QuantizedRows): no second quantization.

The quantizer and the dequantizer below are the only ones; tests/unit/test_quantized_rows.py holds them
bit-exact to a plain reference written there.
"""

from __future__ import annotations

import math

import torch

from mlaserve.config.row_format import AMAX_FLOOR, HALF_CODES, QMAX, RowFormat

FP8 = torch.float8_e4m3fn
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # config/row_format.py HALF_CODES as torch dtypes


def quantize(x: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, q] (any float dtype) -> (codes [N, q] uint8, scales [N, nb] fp32). Per block: scale =
    max(amax, AMAX_FLOOR) / QMAX, code = round(x / scale) (int8: to nearest, ties to even, clamped to +-127;
    e4m3: torch's round-to-nearest-even cast after a clamp to +-448, since e4m3fn has no infinity and a value
    past 448 would not saturate). A non-finite value makes its block's scale non-finite, so it reads back
    non-finite (a NaN row stays NaN: tests/identities/test_nan_isolation.py)."""
    n = x.shape[0]
    blocks = x.float().reshape(n, fmt.scales, fmt.block)
    qmax = QMAX[fmt.codes]
    scales = block_scales(blocks.abs().amax(dim=-1).clamp(min=AMAX_FLOOR), fmt)  # clamp keeps NaN
    y = blocks / scales[..., None]
    if fmt.codes == "int8":
        codes = y.round().clamp(-qmax, qmax).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp(-qmax, qmax).to(FP8).view(torch.uint8)
    return codes.reshape(n, fmt.quantized), scales


def block_scales(amax: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """amax [...] (already floored at AMAX_FLOOR) -> scales [...] fp32. "amax": amax / QMAX. "ue8m0": the
    power of two 2^ceil(log2(amax * (1/QMAX))), as DeepSeek's act_quant with scale_fmt ue8m0 (its kernel
    multiplies by the fp32 reciprocal, then reads the exponent bits: + 1 unless the mantissa is zero); x / scale
    and code * scale are then exact. A non-finite amax keeps a non-finite scale."""
    qmax = QMAX[fmt.codes]
    if fmt.scale == "amax":
        return amax / qmax
    ratio = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    up = exponent - (mantissa == 0.5).to(exponent.dtype)  # ceil(log2(ratio)): an exact power keeps its own
    return torch.where(ratio.isfinite(), torch.ldexp(torch.ones_like(ratio), up), ratio)


def encode_scales(scales: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """fp32 scales [...] -> what the cache stores: fp32 as they are ("amax"), or ("ue8m0") the e8m0 byte, the
    fp32 exponent field of the power of two (2^e -> e + 127; exact for every scale quantize makes: the amax floor
    keeps them above 2^-126). A non-finite scale (NaN or inf) becomes 255, which decodes as NaN."""
    if fmt.scale_bytes == 4:
        return scales
    return ((scales.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def decode_scales(stored: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """The stored scales [...] -> fp32: an e8m0 byte b is 2^(b - 127) (the exponent field put back), 255 NaN,
    0 the zero of a never-written row (its codes are zero too)."""
    if fmt.scale_bytes == 4:
        return stored
    e = stored.to(torch.int32)
    scales = (e << 23).view(torch.float32)
    return torch.where(e == 255, torch.full_like(scales, float("nan")), scales)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """codes [..., q] uint8, scales [..., nb] -> values [..., q] fp32 (code * scale, one rounding)."""
    typed = codes.view(torch.int8) if fmt.codes == "int8" else codes.view(FP8)
    blocks = typed.float().unflatten(-1, (fmt.scales, fmt.block))
    return (blocks * scales[..., None]).flatten(-2)


def error_bound(codes: torch.Tensor, scales: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Per value, a bound on |x - dequantize(code)| for the x that was quantized, from what the cache holds:
    int8 scale / 2; e4m3 scale * max(|code| / 16, 2^-10) (half a step of 3 mantissa bits, or of the
    subnormal step 2^-9); plus 2^-22 |x~| for the two fp32 roundings (x / scale, code * scale).
    -> [..., q] fp32. The 8-bit-vs-full bounds (attention/cache_error.py) start here."""
    typed = codes.view(torch.int8) if fmt.codes == "int8" else codes.view(FP8)
    y = typed.float().unflatten(-1, (fmt.scales, fmt.block))
    s = scales[..., None]
    half = torch.full_like(y, 0.5) if fmt.codes == "int8" else (y.abs() / 16).clamp(min=2.0**-10)
    return (half * s + (y * s).abs() * 2.0**-22).flatten(-2)


def half_error_bound(stored: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Per value, a bound on |x - x~| for the x whose 16-bit rounding x~ the cache holds (config/row_format.py):
    u / (1 - u) |x~| + the subnormal half-step; inf where x~ is not finite (float16's overflow). -> fp32."""
    u, tiny = HALF_CODES[fmt.codes]
    y = stored.float()
    return torch.where(y.isfinite(), y.abs() * (u / (1.0 - u)) + tiny, torch.full_like(y, float("inf")))


class QuantizedRows:
    """One state's 8-bit (or 16-bit: fmt.half) rows. Duck-types the parts of a [*L, width] cache tensor its users touch along dim 0:
    `shape`, `dtype` (the compute dtype rows are read in), `device`, `element_size()` (bytes of a read value,
    which sizes the readers' temporaries), `index_copy_(0, slots, rows)` (the write), `index_select(0, slots)`
    (the read), `index_fill_(0, slots, 0)`, `zero_()`; with two leading dims (a request state) also `[slot]` (the
    slot's rows, a view: its writes land here) and `index_put_((slots, rows), values)` (the ring's writes)."""

    def __init__(
        self, fmt: RowFormat, rows: int | tuple[int, ...], dtype: torch.dtype, device: str | torch.device, zeros
    ) -> None:
        """rows: the leading dims L (an int: one); zeros(rows, width, dtype, device): the cache's allocator
        (model_cache._zeros: zero pages mapped on the CPU), called with prod(L) rows."""
        lead = (rows,) if isinstance(rows, int) else tuple(rows)
        n = math.prod(lead)
        self.fmt, self.dtype, self.device = fmt, dtype, torch.device(device)
        self.shape = torch.Size((*lead, fmt.width))
        if fmt.half:  # the rows alone, in 16 bits
            self.codes = zeros(n, fmt.quantized, HALF[fmt.codes], device).view(*lead, fmt.quantized)
            self.scales = self.kept = None
            return
        scale_dtype = torch.float32 if fmt.scale_bytes == 4 else torch.uint8
        self.codes = zeros(n, fmt.quantized, torch.uint8, device).view(*lead, fmt.quantized)
        self.scales = zeros(n, fmt.scales, scale_dtype, device).view(*lead, fmt.scales)
        self.kept = zeros(n, fmt.kept, dtype, device).view(*lead, fmt.kept) if fmt.kept else None

    @classmethod
    def _over(cls, fmt: RowFormat, dtype: torch.dtype, parts: tuple[torch.Tensor, ...]) -> QuantizedRows:
        """Rows over existing parts (codes, scales[, kept]; 16-bit: codes alone): views of another's (a slot) or a
        copy (`take`)."""
        out = cls.__new__(cls)
        out.fmt, out.dtype, out.device = fmt, dtype, parts[0].device
        out.codes = parts[0]
        out.scales = parts[1] if len(parts) > 1 else None
        out.kept = parts[2] if len(parts) > 2 else None
        out.shape = torch.Size((*parts[0].shape[:-1], fmt.width))
        return out

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def row_bytes(self) -> int:
        """Bytes one row holds (codes + scales + kept values): the page pool's truthful count."""
        return self.fmt.bytes_per_row(self.element_size())

    def nbytes(self) -> int:
        """Bytes every part holds (allocated)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored parts: (codes, scales[, kept]), or 16-bit rows' (codes,)."""
        return tuple(t for t in (self.codes, self.scales, self.kept) if t is not None)

    def __getitem__(self, i: int) -> QuantizedRows:
        """The rows under leading index i (a request state's slot [W, width]): views, so writes land here."""
        if not isinstance(i, int):
            raise TypeError(f"8-bit rows are indexed by one slot number, not {type(i).__name__}")
        return self._over(self.fmt, self.dtype, tuple(t[i] for t in self.tensors()))

    def zero_(self) -> QuantizedRows:
        for t in self.tensors():
            t.zero_()
        return self

    def index_fill_(self, dim: int, slots: torch.Tensor, value: float) -> QuantizedRows:
        """Rows at slots [T] back to the fresh cache's zeros (codes, scales and kept values 0, which read as 0):
        DeepSeek-V4's rollback drops the pool rows of rejected drafts with it. Only 0: a filled row of another
        value would have to be quantized."""
        if dim != 0 or value != 0:
            raise ValueError(f"cache rows are cleared along dim 0 to 0, not dim {dim} to {value}")
        for t in self.tensors():
            t.index_fill_(0, slots, 0)
        return self

    def _encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rows [..., width] -> the parts [..., q], [..., nb], [..., k] as stored (quantized once)."""
        fmt, lead = self.fmt, rows.shape[:-1]
        if fmt.half:  # one rounding to nearest (ties to even), as llama.cpp's F16 cache write
            return (rows.to(HALF[fmt.codes]),)
        codes, scales = quantize(rows[..., : fmt.quantized].reshape(-1, fmt.quantized), fmt)
        parts = (codes.view(*lead, fmt.quantized), encode_scales(scales, fmt).view(*lead, fmt.scales))
        if self.kept is not None:
            parts += (rows[..., fmt.quantized :].to(self.dtype),)
        return parts

    def index_copy_(self, dim: int, slots: torch.Tensor, rows: torch.Tensor | QuantizedRows) -> QuantizedRows:
        """The cache write: rows [T, *L[1:], width] quantized once and stored at slots [T]; or rows of the same
        format (a QuantizedRows: a snapshot, a saved slot) copied part by part as they are."""
        if dim != 0:
            raise ValueError(f"cache rows are written along dim 0, not {dim}")
        if isinstance(rows, QuantizedRows):
            if rows.fmt != self.fmt:
                raise ValueError(f"8-bit rows of {rows.fmt.label()} cannot be copied into {self.fmt.label()}")
            parts = rows.tensors()
        else:
            parts = self._encode(rows)
        for t, part in zip(self.tensors(), parts):
            t.index_copy_(0, slots, part)
        return self

    def index_put_(self, indices: tuple[torch.Tensor, ...], values: torch.Tensor) -> QuantizedRows:
        """values [n, width] quantized once and stored at the leading indices (slots [n], rows [n]): the ring's
        scattered writes (models/deepseek_v4/step_update.py apply_ring)."""
        for t, part in zip(self.tensors(), self._encode(values)):
            t.index_put_(indices, part)
        return self

    def copy_(self, src: torch.Tensor | QuantizedRows) -> QuantizedRows:
        """All rows from src (a slot's rows into a snapshot row: models/deepseek_v4/state.py Snapshots.save): 8-bit
        rows of the same format copied part by part as stored, full rows quantized once."""
        if isinstance(src, QuantizedRows):
            if src.fmt != self.fmt:
                raise ValueError(f"8-bit rows of {src.fmt.label()} cannot be copied into {self.fmt.label()}")
            parts = src.tensors()
        else:
            parts = self._encode(src)
        for t, part in zip(self.tensors(), parts):
            t.copy_(part)
        return self

    def take(self, slots: torch.Tensor) -> QuantizedRows:
        """A copy of the rows at slots [T] as they are stored (codes, scales, kept values): [T, *L[1:], width]."""
        return self._over(self.fmt, self.dtype, tuple(torch.index_select(t, 0, slots) for t in self.tensors()))

    def error(self, slots: torch.Tensor) -> torch.Tensor:
        """error_bound of the quantized values at slots [...] -> [..., *L[1:], quantized] fp32 (kept values are
        exact)."""
        flat = slots.reshape(-1)
        codes = torch.index_select(self.codes, 0, flat)
        if self.fmt.half:
            return half_error_bound(codes, self.fmt).view(*slots.shape, *self.shape[1:-1], self.fmt.quantized)
        scales = decode_scales(torch.index_select(self.scales, 0, flat), self.fmt)
        return error_bound(codes, scales, self.fmt).view(*slots.shape, *self.shape[1:-1], self.fmt.quantized)

    @classmethod
    def of(cls, rows: torch.Tensor, fmt: RowFormat) -> QuantizedRows:
        """A standalone copy of full rows [S, width] in 8 bits (tests, `mlaserve verify`: the same rows both ways)."""
        out = cls(fmt, rows.shape[0], rows.dtype, rows.device, plain_zeros)
        return out.index_copy_(0, torch.arange(rows.shape[0], device=rows.device), rows)

    def index_select(self, dim: int, slots: torch.Tensor) -> torch.Tensor:
        """The read of a [*L, width] tensor's rows (DeepSeek-V4's paged pools gather with it,
        models/deepseek_v4/state.py StepRows; its ring reads its old rows with it): rows(slots), dequantized
        in the compute dtype."""
        if dim != 0:
            raise ValueError(f"cache rows are read along dim 0, not {dim}")
        return self.rows(slots)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows at slots [...] -> [..., *L[1:], width] in the compute dtype (dequantized codes, then kept
        values)."""
        flat = slots.reshape(-1)
        codes = torch.index_select(self.codes, 0, flat)
        if self.fmt.half:
            return codes.to(self.dtype).view(*slots.shape, *self.shape[1:])
        scales = decode_scales(torch.index_select(self.scales, 0, flat), self.fmt)
        values = dequantize(codes, scales, self.fmt).to(self.dtype)
        if self.kept is not None:
            values = torch.cat([values, torch.index_select(self.kept, 0, flat)], dim=-1)
        return values.view(*slots.shape, *self.shape[1:])


def plain_zeros(rows: int, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=dtype, device=device)

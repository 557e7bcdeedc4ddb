"""A paged state kept in 8 bits (kv_cache_dtype int8 / fp8_e4m3): codes, fp32 block scales, kept values.

Notation (one layer's state; the format is config/kv_cache.py's RowFormat)
  S rows (+ the zero pad row), q = fmt.quantized values as codes, nb = q / fmt.block scales, k = fmt.kept
  codes  [S + 1, q]   uint8 bytes: int8 codes, or FP8 e4m3 bit patterns (viewed as float8_e4m3fn to decode)
  scales [S + 1, nb]  fp32, one per block of fmt.block codes
  kept   [S + 1, k]   the compute dtype (the latent row's k_pe); absent when k = 0 (index keys)
  a row = [dequantize(codes, scales) (q) | kept (k)], as the full cache's row [c_kv | k_pe] or [key]
Quantized once, at the cache write (`index_copy_`, the signature of the tensor it replaces, so the layers'
writes are the same line); every reader gathers rows through `rows(slots)` and gets them dequantized in the
compute dtype: the backends' row gathers (attention/backends/blocks.gather_rows, the reference's gather) ask
for it, and nothing else reads the codes. The pad row's codes and scales are zero, so it reads as zeros.

The quantizer and the dequantizer below are the only ones; tests/unit/test_quantized_rows.py holds them
bit-exact to a plain reference written there.
"""

from __future__ import annotations

import torch

from mlaserve.config.row_format import AMAX_FLOOR, QMAX, RowFormat

FP8 = torch.float8_e4m3fn


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


class QuantizedRows:
    """One paged state's 8-bit rows. Duck-types the parts of a [rows, width] cache tensor its users touch:
    `shape`, `dtype` (the compute dtype rows are read in), `device`, `element_size()` (bytes of a read value,
    which sizes the readers' temporaries), `index_copy_(0, slots, rows)` (the write), `index_fill_(0, slots, 0)` and `zero_()`."""

    def __init__(self, fmt: RowFormat, rows: int, dtype: torch.dtype, device: str | torch.device, zeros) -> None:
        """zeros(rows, width, dtype, device): the cache's allocator (model_cache._zeros: calloc'd on the CPU)."""
        self.fmt, self.dtype, self.device = fmt, dtype, torch.device(device)
        self.codes = zeros(rows, fmt.quantized, torch.uint8, device)
        self.scales = zeros(rows, fmt.scales, torch.float32, device)
        self.kept = zeros(rows, fmt.kept, dtype, device) if fmt.kept else None
        self.shape = torch.Size((rows, fmt.width))

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def row_bytes(self) -> int:
        """Bytes one row holds (codes + scales + kept values): the page pool's truthful count."""
        return self.fmt.bytes_per_row(self.element_size())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales) + ((self.kept,) if self.kept is not None else ())

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

    def index_copy_(self, dim: int, slots: torch.Tensor, rows: torch.Tensor) -> QuantizedRows:
        """The cache write: rows [T, width] quantized once and stored at slots [T]."""
        if dim != 0:
            raise ValueError(f"cache rows are written along dim 0, not {dim}")
        fmt = self.fmt
        codes, scales = quantize(rows[:, : fmt.quantized], fmt)
        self.codes.index_copy_(0, slots, codes)
        self.scales.index_copy_(0, slots, scales)
        if self.kept is not None:
            self.kept.index_copy_(0, slots, rows[:, fmt.quantized :].to(self.dtype))
        return self

    def error(self, slots: torch.Tensor) -> torch.Tensor:
        """error_bound of the quantized values at slots [...] -> [..., quantized] fp32 (kept values are exact)."""
        flat = slots.reshape(-1)
        codes, scales = torch.index_select(self.codes, 0, flat), torch.index_select(self.scales, 0, flat)
        return error_bound(codes, scales, self.fmt).view(*slots.shape, self.fmt.quantized)

    @classmethod
    def of(cls, rows: torch.Tensor, fmt: RowFormat) -> QuantizedRows:
        """A standalone copy of full rows [S, width] in 8 bits (tests, `mlaserve verify`: the same rows both ways)."""
        out = cls(fmt, rows.shape[0], rows.dtype, rows.device, _plain_zeros)
        return out.index_copy_(0, torch.arange(rows.shape[0], device=rows.device), rows)

    def index_select(self, dim: int, slots: torch.Tensor) -> torch.Tensor:
        """The read of a [rows, width] tensor's rows (DeepSeek-V4's paged pools gather with it,
        models/deepseek_v4/state.py StepRows): rows(slots), dequantized in the compute dtype."""
        if dim != 0:
            raise ValueError(f"cache rows are read along dim 0, not {dim}")
        return self.rows(slots)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows at slots [...] -> [..., width] in the compute dtype (dequantized codes, then kept values)."""
        flat = slots.reshape(-1)
        codes = torch.index_select(self.codes, 0, flat)
        scales = torch.index_select(self.scales, 0, flat)
        values = dequantize(codes, scales, self.fmt).to(self.dtype)
        if self.kept is not None:
            values = torch.cat([values, torch.index_select(self.kept, 0, flat)], dim=-1)
        return values.view(*slots.shape, self.fmt.width)


def _plain_zeros(rows: int, width: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    return torch.zeros(rows, width, dtype=dtype, device=device)

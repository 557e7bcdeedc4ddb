"""ggml tensor types and their dequantization to float32, in torch.

Notation: a ggml tensor is stored as *blocks*; ``block_size`` values are packed into ``type_size``
bytes.  ``d``/``dmin`` are fp16 block scales (MXFP4: ``e``, an e8m0 byte), ``qs``/``ql`` low bits, ``qh`` high bits,
``sc``/``m`` the 6-bit sub-block scales/mins of the K-quants (256-value super-blocks of
16 or 8 sub-blocks); the i-quants' and ternary types' dequantizers are ``iquants.py``'s (their codes index the
published grids of ``iq_grids.py``).  Shapes are torch order (outermost first); a row (the last torch dim,
ggml's ne[0]) is always a whole number of blocks.

Every dequantizer below is vectorized over all blocks at once and performs exactly the same
float32 operations, in the same order, as ``gguf.quants.dequantize`` (gguf-py) -- e.g.
``(d * sc) * q - dmin * m`` for Q4_K -- so the results agree bit for bit.  Do not "simplify"
the arithmetic (no fused multiply-add, no reassociation): that would break the exactness the
tests check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mlaserve.gguf import iquants
from mlaserve.gguf.block_bits import QK_K
from mlaserve.gguf.block_bits import bits32 as _bits32
from mlaserve.gguf.block_bits import f16_cols as _f16
from mlaserve.gguf.block_bits import nibbles as _nibbles
from mlaserve.gguf.block_bits import shifted as _shifted


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int
    type_size: int


# Every type id ggml knows (so any file's tensor table can be parsed and sized); only some of
# them can be dequantized (see DEQUANTIZERS).
_TYPES = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
]
GGML_TYPES: dict[int, GGMLType] = {t[0]: GGMLType(*t) for t in _TYPES}
GGML_TYPE_IDS: dict[str, int] = {t.name: t.id for t in GGML_TYPES.values()}


def tensor_nbytes(ggml_type: int, ne: Sequence[int]) -> int:
    """Bytes taken by a tensor of ggml dims ``ne`` (ne[0] = row length, must be whole blocks)."""
    t = GGML_TYPES[ggml_type]
    n = 1
    for x in ne:
        n *= int(x)
    return n // t.block_size * t.type_size


# ---------------------------------------------------------------------------------------------
# per-type block dequantizers: [n, type_size] uint8 -> [n, block_size] float32


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = (_nibbles(b[:, 2:]) - 8).to(torch.float32)
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:]).to(torch.float32)
    return (d * q) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return d * (q - 16).to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = (_nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)).to(torch.float32)
    return (d * q) + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16].to(torch.int32), b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # 2-bit planes: [n, 2 halves, 4 shifts, 32] -> 16 sub-blocks of 16 values
    q = (_shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), (4, 1)) & 3).reshape(n, 16, 16)
    return (dl * q.to(torch.float32) - ml).reshape(n, QK_K)


def _q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales (low 4 bits from bytes 0-7, high 2 from bytes 8-11)."""
    n = scales.shape[0]
    lo = _shifted(scales[:, :8], (0, 4), (2, 1)).reshape(n, 16)
    hi = _shifted(scales[:, 8:12], (0, 2, 4, 6), (4, 1)).reshape(n, 16)
    sc = (lo & 0x0F) | ((hi & 0x03) << 4)
    return (sc - 32).to(torch.float32)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    dl = (d * _q3_k_scales(scales)).reshape(n, 16, 1)
    ql = (_shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), (4, 1)) & 3).reshape(n, 16, 16)
    qh = (_shifted(hmask.reshape(n, 1, 32), range(8), (8, 1)) & 1).reshape(n, 16, 16)
    q = ql - ((qh ^ 1) << 2)  # the high bit *clear* means "subtract 4"
    return (dl * q.to(torch.float32)).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    s = scales.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _k_d_dm(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dd, dm = _k_d_dm(b)
    q = (_shifted(b[:, 16:].reshape(n, 4, 32), (0, 4), (2, 1)) & 0x0F).reshape(n, 8, 32)
    return (dd * q.to(torch.float32) - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dd, dm = _k_d_dm(b)
    ql = (_shifted(b[:, 48:].reshape(n, 4, 32), (0, 4), (2, 1)) & 0x0F).reshape(n, 8, 32)
    qh = (_shifted(b[:, 16:48].reshape(n, 1, 32), range(8), (8, 1)) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dd * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    dd = (_f16(b[:, 208:210]) * sc).reshape(n, 16, 1)
    lo = (_shifted(ql.reshape(n, 2, 64), (0, 4), (2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = (_shifted(qh.reshape(n, 2, 32), (0, 2, 4, 6), (4, 1)) & 3).reshape(n, 8, 32)
    q = ((lo | (hi << 4)) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dd * q).reshape(n, QK_K)


# MXFP4 (OCP microscaling): a block is one e8m0 scale byte e, then 16 bytes of 32 e2m1 codes (values 0..15 in the
# low nibbles, 16..31 in the high ones, as Q4_0). ggml keeps the e2m1 values doubled (exact small integers) and
# halves the scale instead: value = KVALUES[code] * 2^(e - 128), d built from its bits as ggml_e8m0_to_fp32_half
# (e < 2: the fp32 subnormals 2^-128, 2^-127; e = 255 is 2^127, not NaN), then one product per value.
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes [...] -> fp32 2^(e - 128), exactly ggml's ggml_e8m0_to_fp32_half (bits, no arithmetic)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)  # on e's device
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, :1])
    table = torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=b.device)
    return d * table[_nibbles(b[:, 1:])]


_BLOCK_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    10: _q2_k,
    11: _q3_k,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
    39: _mxfp4,
    **iquants.BLOCK_DEQUANT,
}


def sub_block_scales(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The scales of an i-quant or ternary tensor's raw bytes -> float32 [sub-blocks], one per run of values that
    share it, in the values' order (values per scale: the tensor's values / this length);
    observability/weight_error.py reads each value's grid step off it."""
    t = GGML_TYPES[ggml_type]
    if ggml_type not in iquants.BLOCK_SCALES:
        raise NotImplementedError(f"no sub-block scales for ggml type {t.name}")
    return iquants.BLOCK_SCALES[ggml_type](raw.reshape(-1, t.type_size)).reshape(-1)


def _plain(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    if ggml_type == 0:
        return raw.view(torch.float32)
    if ggml_type == 1:
        return raw.view(torch.float16).to(torch.float32)
    # BF16: the 16 stored bits are the top half of a float32
    return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


DEQUANTIZABLE: frozenset[int] = frozenset({0, 1, 30, *_BLOCK_DEQUANT})


def dequantize(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> torch.Tensor:
    """Raw tensor bytes (uint8, any shape, contiguous) -> float32 tensor of torch ``shape``.

    F32 input comes back as a *view* of ``raw`` (no copy); everything else is a new tensor.
    """
    if ggml_type not in DEQUANTIZABLE:
        name = GGML_TYPES[ggml_type].name if ggml_type in GGML_TYPES else f"id {ggml_type}"
        raise NotImplementedError(f"dequantization of ggml type {name} is not implemented")
    t = GGML_TYPES[ggml_type]
    raw = raw.reshape(-1)
    n_values = 1
    for x in shape:
        n_values *= int(x)
    if raw.numel() != n_values // t.block_size * t.type_size or n_values % t.block_size:
        raise ValueError(f"{raw.numel()} bytes do not hold a {t.name} tensor of shape {list(shape)}")
    if ggml_type in (0, 1, 30):
        return _plain(raw, ggml_type).reshape(tuple(shape))
    blocks = raw.reshape(-1, t.type_size)
    return _BLOCK_DEQUANT[ggml_type](blocks).reshape(tuple(shape))

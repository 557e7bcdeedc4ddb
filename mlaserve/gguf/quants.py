"""ggml tensor types and their dequantization to float32, in torch.

Notation: a ggml tensor is stored as *blocks*; ``block_size`` values are packed into ``type_size``
bytes.  ``d``/``dmin`` are fp16 block scales (MXFP4: ``e``, an e8m0 byte), ``qs``/``ql`` low bits, ``qh`` high bits,
``sc``/``m`` the 6-bit sub-block scales/mins of the K-quants (256-value super-blocks of
16 or 8 sub-blocks); the i-quants' codes index published grids (``iq_grids.py``, notation at their
dequantizers).  Shapes are torch order (outermost first); a row (the last torch dim,
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

from mlaserve.gguf import iq_grids
from mlaserve.gguf.iq_grids import IQ4NL_VALUES

QK_K = 256  # values per K-quant super-block


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
# helpers on a [n_blocks, type_size] uint8 tensor


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32 (exact)."""
    return cols.contiguous().view(torch.float16).to(torch.float32)


def _shifted(x: torch.Tensor, shifts: Sequence[int], axis_shape: tuple[int, ...]) -> torch.Tensor:
    """x[..., None, :] >> shifts, shifts laid out along a new axis (the ggml bit-plane order)."""
    s = torch.tensor(list(shifts), dtype=torch.int32, device=x.device).reshape(axis_shape)
    return x.to(torch.int32).unsqueeze(-2) >> s


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] ints: low nibbles of all bytes, then high nibbles."""
    n = qs.shape[0]
    return (_shifted(qs.reshape(n, -1, 16), (0, 4), (2, 1)) & 0x0F).reshape(n, -1)


def _bits32(qh4: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes holding one little-endian uint32 -> [n, 32] of its bits (bit j = value j)."""
    q = qh4.to(torch.int64)
    word = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    return ((word.unsqueeze(1) >> torch.arange(32, dtype=torch.int64, device=q.device)) & 1).to(torch.int32)


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


# ---------------------------------------------------------------------------------------------
# i-quants (ggml-common.h block layouts, byte offsets in brackets). Codes index published tables (gguf/iq_grids.py):
# IQ4_NL / IQ4_XS a 16-value non-linear table, the IQ2/IQ3 types grids of 8 or 4 magnitudes per index with a sign
# bit per value (IQ2_XXS, IQ2_XS, IQ3_XXS: 7 stored bits per 8 values, the 8th the parity, table KSIGNS), IQ1_S /
# IQ1_M grids of -1 / 0 / 1 shifted by +-IQ1_DELTA. Sub-block scales are small integers times the fp16 d; every
# product below is in gguf-py's order ((d * s) first, then the value; grid value, then sign).
IQ1_DELTA = 0.125


def _grid(name: str) -> torch.Tensor:
    """A grid of gguf/iq_grids.py as [entries, width] float32 (its values are small integers: exact)."""
    shape = getattr(iq_grids, f"{name}_GRID_SHAPE")
    raw = bytes.fromhex("".join(getattr(iq_grids, f"{name}_GRID_HEX")))
    return torch.frombuffer(bytearray(raw), dtype=torch.int8).to(torch.float32).reshape(shape)


_GRIDS: dict[str, torch.Tensor] = {}


def _grid_on(name: str, device: torch.device) -> torch.Tensor:
    if name not in _GRIDS:  # built once per process (the tables are constants), then moved per call where needed
        _GRIDS[name] = _grid(name)
    return _GRIDS[name].to(device)


def _ksigns() -> torch.Tensor:
    """ggml's ksigns_iq2xs as bits: [128, 8] of +1 / -1; entry i is the 7 bits of i plus their parity as bit 7."""
    i = torch.arange(128, dtype=torch.int32)
    bits = (i.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
    bits[:, 7] = bits[:, :7].sum(1) & 1  # an even number of minus signs
    return torch.where(bits == 0, 1.0, -1.0)


def _sign_bits(b: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, m, 8] of +1 (bit clear) / -1 (bit set), bit j for value j."""
    bits = (b.to(torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32, device=b.device)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[n, 4m] bytes -> [n, m] little-endian uint32 values in int64."""
    q = b.to(torch.int64).reshape(b.shape[0], -1, 4)
    return q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    q = b.to(torch.int64).reshape(b.shape[0], -1, 2)
    return q[..., 0] | (q[..., 1] << 8)


def _iq4_nl_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 1]: d
    return _f16(b[:, :2])


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # d qs[16]
    table = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=b.device)
    return _iq4_nl_scales(b) * table[_nibbles(b[:, 2:])]


def _iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 8]: d (ls - 32) per 32 values
    n = b.shape[0]
    lo = (_shifted(b[:, 4:8], (0, 4), (2, 1)).transpose(1, 2).reshape(n, 8)) & 0x0F  # sub-block j: byte j/2, nibble
    hi = (_u16(b[:, 2:4]) >> torch.arange(0, 16, 2, device=b.device)) & 3
    return _f16(b[:, :2]) * ((lo | (hi << 4)) - 32).to(torch.float32)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:  # d scales_h[2] scales_l[4] qs[128]: 8 sub-blocks of 32
    n = b.shape[0]
    dl = _iq4_xs_scales(b).reshape(n, 8, 1)
    table = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=b.device)
    q = _nibbles(b[:, 8:].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * table[q]).reshape(n, QK_K)


def _iq2_xxs_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 8]: db per 32 values
    aux = _u32(b[:, 2:]).reshape(b.shape[0], 8, 2)[..., 1]
    return _f16(b[:, :2]) * (0.5 + (aux >> 28).to(torch.float32)) * 0.25


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:  # d qs[64]: per 32 values 4 grid bytes, then a uint32 of signs/scale
    n = b.shape[0]
    aux = _u32(b[:, 2:]).reshape(n, 8, 2)[..., 1]
    db = _iq2_xxs_scales(b).reshape(n, 8, 1, 1)
    idx = b[:, 2:].reshape(n, 8, 8)[..., :4].to(torch.int64)  # the first word's bytes
    signs = _ksigns().to(b.device)[(aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F]
    return (db * _grid_on("IQ2XXS", b.device)[idx] * signs).reshape(n, QK_K)


def _half_scales(b: torch.Tensor, at: int) -> torch.Tensor:  # [n, 16]: IQ2_XS / IQ2_S db per 16 values
    sc = (_shifted(b[:, at : at + 8], (0, 4), (2, 1)).transpose(1, 2).reshape(b.shape[0], 16)) & 0x0F
    return _f16(b[:, :2]) * (0.5 + sc.to(torch.float32)) * 0.25


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:  # d qs[32 x uint16: 9-bit grid index, 7 sign bits] scales[8]
    n = b.shape[0]
    qs = _u16(b[:, 2:66])
    db = _half_scales(b, 66).reshape(n, 16, 1, 1)
    signs = _ksigns().to(b.device)[qs >> 9].reshape(n, 16, 2, 8)
    grid = _grid_on("IQ2XS", b.device)[qs & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:  # d qs[32] signs[32] qh[8] scales[8]
    n = b.shape[0]
    db = _half_scales(b, 74).reshape(n, 16, 1, 1)
    signs = _sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)
    qh = (_shifted(b[:, 66:74], (0, 2, 4, 6), (4, 1)).transpose(1, 2).reshape(n, 32)) & 3
    idx = b[:, 2:34].to(torch.int64) | (qh.to(torch.int64) << 8)
    grid = _grid_on("IQ2S", b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 8]: db per 32 values
    return _f16(b[:, :2]) * (0.5 + (_u32(b[:, 66:98]) >> 28).to(torch.float32)) * 0.5


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:  # d qs[64] (grid bytes) scales[32] (8 uint32: 4 x 7 sign bits, scale)
    n = b.shape[0]
    aux = _u32(b[:, 66:98])
    db = _iq3_xxs_scales(b).reshape(n, 8, 1, 1)
    signs = _ksigns().to(b.device)[(aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F]
    grid = _grid_on("IQ3XXS", b.device)[b[:, 2:66].to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 8]: db per 32 values
    sc = (_shifted(b[:, 106:110], (0, 4), (2, 1)).transpose(1, 2).reshape(b.shape[0], 8)) & 0x0F
    return _f16(b[:, :2]) * (1 + 2 * sc).to(torch.float32)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:  # d qs[64] qh[8] signs[32] scales[4]
    n = b.shape[0]
    db = _iq3_s_scales(b).reshape(n, 8, 1, 1)
    signs = _sign_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
    qh = (_shifted(b[:, 66:74], range(8), (8, 1)).transpose(1, 2).reshape(n, 64)) & 1
    idx = b[:, 2:66].to(torch.int64) | (qh.to(torch.int64) << 8)
    grid = _grid_on("IQ3S", b.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq1_s_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 8]: dl per 32 values
    return _f16(b[:, :2]) * (2 * ((_u16(b[:, 34:50]) >> 12) & 7) + 1).to(torch.float32)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:  # d qs[32] qh[8 x uint16: 4 x 3 index bits, 3 scale bits, delta sign]
    n = b.shape[0]
    qh = _u16(b[:, 34:50])
    dl = _iq1_s_scales(b).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 1, 1)
    hi = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    idx = b[:, 2:34].to(torch.int64) | (hi.reshape(n, 32) << 8)
    grid = _grid_on("IQ1S", b.device)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq1_m_scales(b: torch.Tensor) -> torch.Tensor:  # [n, 16]: dl per 16 values
    n = b.shape[0]
    s = _u16(b[:, 48:56])
    bits = ((s & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(1)  # disjoint nibbles: sum == or
    d = _f16(torch.stack([bits & 0xFF, bits >> 8], dim=1).to(torch.uint8))
    sc = ((s.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7).reshape(n, 16)
    return d * (2 * sc + 1).to(torch.float32)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:  # qs[32] qh[16] scales[8]: 4 uint16 of 3-bit scales, d in their tops
    n = b.shape[0]
    dl = _iq1_m_scales(b).reshape(n, 8, 2, 1, 1)
    nib = (_shifted(b[:, 32:48], (0, 4), (2, 1)).transpose(1, 2).reshape(n, 32)) & 0x0F
    idx = b[:, :32].to(torch.int64) | ((nib & 7).to(torch.int64) << 8)
    delta = torch.where((nib & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    grid = _grid_on("IQ1S", b.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _tq1_0(b: torch.Tensor) -> torch.Tensor:  # qs[48] qh[4] d: base-3 digits, 5 per byte (4 in qh), fixed point
    n = b.shape[0]
    pow5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=b.device)
    q0 = (b[:, :32].reshape(n, 1, 32) * pow5.reshape(5, 1)).reshape(n, 160)  # uint8 products wrap, as ggml's
    q1 = (b[:, 32:48].reshape(n, 1, 16) * pow5.reshape(5, 1)).reshape(n, 80)
    q2 = (b[:, 48:52].reshape(n, 1, 4) * pow5[:4].reshape(4, 1)).reshape(n, 16)
    q = torch.cat([q0, q1, q2], dim=1).to(torch.int32)
    return _f16(b[:, 52:54]) * (((q * 3) >> 8) - 1).to(torch.float32)


def _tq2_0(b: torch.Tensor) -> torch.Tensor:  # qs[64] d: 2-bit codes 0..2 for -1, 0, 1
    n = b.shape[0]
    q = (_shifted(b[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), (4, 1)) & 3).reshape(n, QK_K)
    return _f16(b[:, 64:66]) * (q - 1).to(torch.float32)


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
    16: _iq2_xxs,
    17: _iq2_xs,
    18: _iq3_xxs,
    19: _iq1_s,
    20: _iq4_nl,
    21: _iq3_s,
    22: _iq2_s,
    23: _iq4_xs,
    29: _iq1_m,
    34: _tq1_0,
    35: _tq2_0,
}


# the i-quants' and ternary types' scales: [n_blocks, sub-blocks], each the factor of sub-block's values (its grid
# or table value, signs and IQ1's delta are the other factor), formed as the dequantizers form them
_BLOCK_SCALES: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    16: _iq2_xxs_scales,
    17: lambda b: _half_scales(b, 66),
    18: _iq3_xxs_scales,
    19: _iq1_s_scales,
    20: _iq4_nl_scales,
    21: _iq3_s_scales,
    22: lambda b: _half_scales(b, 74),
    23: _iq4_xs_scales,
    29: _iq1_m_scales,
    34: lambda b: _f16(b[:, 52:54]),
    35: lambda b: _f16(b[:, 64:66]),
}


def sub_block_scales(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The scales of an i-quant or ternary tensor's raw bytes -> float32 [sub-blocks], one per run of values that
    share it, in the values' order (values per scale: the tensor's values / this length);
    observability/weight_error.py reads each value's grid step off it."""
    t = GGML_TYPES[ggml_type]
    if ggml_type not in _BLOCK_SCALES:
        raise NotImplementedError(f"no sub-block scales for ggml type {t.name}")
    return _BLOCK_SCALES[ggml_type](raw.reshape(-1, t.type_size)).reshape(-1)


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

"""The i-quants' and ternary types' block dequantizers (IQ1_S .. IQ4_XS, TQ1_0, TQ2_0), in torch, bit for bit
gguf-py's (gguf/quants.py's rule: the same float32 operations in the same order; do not reassociate), and their
sub-block scales (BLOCK_SCALES: observability/weight_error.py reads each value's grid step off them). gguf/quants.py
dispatches to BLOCK_DEQUANT.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaserve.gguf import iq_grids
from mlaserve.gguf.block_bits import QK_K
from mlaserve.gguf.block_bits import f16_cols as _f16
from mlaserve.gguf.block_bits import nibbles as _nibbles
from mlaserve.gguf.block_bits import shifted as _shifted
from mlaserve.gguf.iq_grids import IQ4NL_VALUES

# i-quants (ggml-common.h block layouts, byte offsets in brackets). Codes index published tables (gguf/iq_grids.py):
# IQ4_NL / IQ4_XS a 16-value non-linear table, the IQ2/IQ3 types grids of 8 or 4 magnitudes per index with a sign
# bit per value (IQ2_XXS, IQ2_XS, IQ3_XXS: 7 stored bits per 8 values, the 8th the parity, table KSIGNS), IQ1_S /
# IQ1_M grids of -1 / 0 / 1 shifted by +-IQ1_DELTA. Sub-block scales are small integers times the fp16 d; every
# product below is in gguf-py's order ((d * s) first, then the value; grid value, then sign).
IQ1_DELTA = 0.125


def grid(name: str) -> torch.Tensor:
    """A grid of gguf/iq_grids.py as [entries, width] float32 (its values are small integers: exact)."""
    shape = getattr(iq_grids, f"{name}_GRID_SHAPE")
    raw = bytes.fromhex("".join(getattr(iq_grids, f"{name}_GRID_HEX")))
    return torch.frombuffer(bytearray(raw), dtype=torch.int8).to(torch.float32).reshape(shape)


_GRIDS: dict[str, torch.Tensor] = {}


def _grid_on(name: str, device: torch.device) -> torch.Tensor:
    if name not in _GRIDS:  # built once per process (the tables are constants), then moved per call where needed
        _GRIDS[name] = grid(name)
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


# the types this module decodes: ggml type id -> [n, type_size] uint8 -> [n, block_size] float32
BLOCK_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
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
BLOCK_SCALES: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
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

"""The AMX-INT8 tiles for the super-block types with one integer scale per 32 or 16 values (csrc/x86/amx_units.c:
IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S, Q5_K; per 16: IQ2_XS, IQ2_S, IQ1_M), against the independent numpy references of their int8 tests
(test_int8_more: IQ4_XS; test_int8_iq_grids: the grids, codes from gguf-py's dequantizer over the scale fields;
test_int8_kquants: Q5_K from ggml's layout; activations: llama.cpp's q8_K quantizer) and against the VNNI row
kernels of the same sources built without AMX.

The tiles sum each unit's integer products exactly (int32), scale them by the unit's integer multiplier in int32 and apply the VNNI kernel's float operations in the same order per row, so every product must equal the
reference bit for bit at every row count: 16..64 rows (the tiles), odd counts (a partly empty last tile of
activation rows), 37 weight rows (the last 16-row weight tile holds 5), several super-blocks per row. Below 16 rows
the VNNI rows run; the same rows give the same bits either way (a row's result does not depend on its batch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import (
    assert_grouped_tiles,
    assert_tile_rows,
    grid_blocks,
    needs_tiles,
    super_block_sums,
    tiles_here,
    with_build,
)
from test_int8_iq_grids import FACTOR
from test_int8_iq_grids import codes_of as grid_codes
from test_int8_iq_grids import reference as grid_reference
from test_int8_kquants import _blocks as kquant_blocks
from test_int8_kquants import _special_x, int8_product_reference, kquant_codes, q8k_reference
from test_int8_more import blocks as iq4_blocks
from test_int8_more import codes_of as iq4_codes
from test_int8_more import iq4_xs_reference

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native

TILES = tiles_here()
UNITS = ["IQ4_XS", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ1_S", "Q5_K", "IQ2_XS", "IQ2_S", "IQ1_M"]
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")
F32 = np.float32


def blocks(name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    if name == "Q5_K":
        return kquant_blocks(name, rows, k, seed)
    if name == "IQ4_XS":
        return iq4_blocks(name, rows, k, seed)
    return grid_blocks(name, rows, k, seed)


def integer_sums(raw: np.ndarray, name: str, q: np.ndarray, bsum: np.ndarray):
    """-> (S [M, N, nb] int64: sum over sub-blocks of scale * the codes' products, d [N, nb] fp32, and for Q5_K the
    mins' sums M [M, N, nb] and dmin [N, nb]; else None, None), from each type's own reference reader."""
    m, k = q.shape
    nb = k // 256
    if name == "Q5_K":
        codes, sc, mn, d, dmin = kquant_codes(raw, name)
        n = d.shape[0]
        sub = np.einsum("nbgl,mbgl->mnbg", codes.reshape(n, nb, 8, 32), q.astype(np.int64).reshape(m, nb, 8, 32))
        return (sub * sc[None]).sum(-1), d, (mn[None] * bsum.reshape(m, 1, nb, 8)).sum(-1), dmin
    if name == "IQ4_XS":
        codes, dw, ls = iq4_codes(raw, name)
        n = codes.shape[0]
        sub = np.einsum("nbil,mbil->mnbi", codes.reshape(n, nb, 8, 32), q.astype(np.int64).reshape(m, nb, 8, 32))
        return (sub * ls.reshape(n, nb, 8)[None]).sum(-1), dw.reshape(n, nb, 8)[..., 0], None, None
    codes, d, ls = grid_codes(raw, name)
    n = codes.shape[0]
    halves = np.einsum("nbhj,mbhj->mnbh", codes.reshape(n, nb, 16, 16), q.astype(np.int64).reshape(m, nb, 16, 16))
    return (halves * ls[None]).sum(-1), d, None, None


def reference(raw: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """The types' scalar references' operations with the (row, weight row) loop as numpy float32 array operations
    (each an IEEE fp32 operation per element, as the scalar loop's): acc += (d_w d_x) S (Q5_K: acc -= (dmin d_x) M)
    per super-block in order, then the grids' power of two (y = factor * acc)."""
    q, dx, bsum = q8k_reference(x.numpy())
    s, d, mins, dmin = integer_sums(raw.numpy(), name, q, bsum)
    y = super_block_sums(s, d, dx, mins, dmin)
    if name not in ("Q5_K", "IQ4_XS"):
        y = (y * F32(FACTOR.get(name, 0.125))).astype(F32)
    return torch.from_numpy(y)


@pytest.mark.parametrize("name", UNITS)
def test_the_vectorized_reference_is_the_scalar_one(name):
    """The array form above gives each type's scalar reference's bits (so holding the tiles to it holds them to
    those, which hold the VNNI rows in every build)."""
    raw, x = blocks(name, 5, 512, seed=1), _special_x(3, 512, seed=2)
    if name == "Q5_K":
        want = int8_product_reference(raw, name, x)
    elif name == "IQ4_XS":
        want = iq4_xs_reference(raw, x)
    else:
        want = grid_reference(raw, name, x)
    assert torch.equal(reference(raw, name, x), want)


@needs_tiles
@pytest.mark.parametrize("name", UNITS)
def test_tile_products_equal_the_reference_and_the_vnni_rows_bit_for_bit(name, monkeypatch):
    """gemm at 1..64 rows (below 16 the VNNI rows, from 16 the tiles), 37 weight rows, 3 super-blocks: every result
    equal to the reference's bits, and to the VNNI rows' (the same sources without AMX) at the tiles' counts."""
    t, k = GGML_TYPE_IDS[name], 768
    raw, x = blocks(name, 37, k, seed=3), _special_x(64, k, seed=4)
    want = reference(raw, name, x)
    assert_tile_rows(name, raw, x, want)
    with_build(monkeypatch, NO_AMX)
    assert native.int8_tiles() == f"no amx-int8 tiles: {native.NO_TILES_IN_BUILD}"
    for rows in (16, 33, 64):
        assert torch.equal(native.gemm(t, x[:rows].contiguous(), raw, k, int8=True), want[:rows]), (name, rows)


@needs_tiles
@pytest.mark.parametrize("name", UNITS)
def test_grouped_tile_products_equal_the_reference(name):
    """The grouped gemm with groups above and below 16 rows (tiles and VNNI rows in one call), experts out of order."""
    assert_grouped_tiles(name, blocks, reference, _special_x(50, 512, seed=8))


@needs_tiles
def test_the_plan_names_the_new_tile_types():
    """native.INT8_TILE_TYPES mirrors the C table: every type listed takes the tiles (the plan's words name it)."""
    for name in UNITS:
        assert name in native.INT8_TILE_TYPES.values()
        assert name in TILES

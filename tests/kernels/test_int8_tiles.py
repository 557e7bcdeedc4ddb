"""The AMX-INT8 tiles (csrc/x86/amx.c's driver, x86/amx_planes.c's hook) for the K-quants' int8 products of many
rows, against the numpy reference of tests/kernels/test_int8_kquants.py (llama.cpp's q8_K quantizer, the weight
codes read from the ggml layout and checked against gguf-py there, exact integer sums, then each documented fp32
operation once).

The tiles sum the same integer products exactly and apply the same float operations in the same order per row, so
their products must equal the reference bit for bit at every row count: 8..64 rows (the tiles), odd counts (a
partly empty last tile of activation rows), weight-row counts that leave the last 16-row tile partly empty, and
several super-blocks per row (the tiles' K steps). Below 8 rows the VNNI row kernels run; the same rows give the
same bits either way (batch independence across the switch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import (
    assert_grouped_tiles,
    assert_tile_rows,
    needs_tiles,
    super_block_sums,
    tiles_here,
    with_build,
)
from test_int8_kquants import _blocks, _special_x, kquant_codes, q8k_reference

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native
from mlaserve.quant.ggml_linear import int8_detail

TILES = tiles_here()


def reference(raw: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """test_int8_kquants.int8_product_reference with the (row, weight row) loop as numpy float32 array operations
    (each an IEEE fp32 operation per element, as the scalar loop's): fast enough for 64 rows."""
    q, dx, bsum = q8k_reference(x.numpy())
    codes, sc, mn, d, dmin = kquant_codes(raw.numpy(), name)
    n, nb = d.shape
    m = q.shape[0]
    group = 16 if name == "Q6_K" else 32
    qb = q.astype(np.int64).reshape(m, nb, 256 // group, group)
    cb = codes.reshape(n, nb, 256 // group, group)
    s_int = (np.einsum("nbgl,mbgl->mnbg", cb, qb) * sc[None]).sum(-1)  # [M, N, nb], exact
    m_int = (mn[None] * bsum.reshape(m, 1, nb, 8)).sum(-1) if name != "Q6_K" else None
    y = super_block_sums(s_int, d, dx, m_int, dmin)
    return torch.from_numpy(y)


def test_the_vectorized_reference_is_the_scalar_one():
    """The array form above gives the scalar reference's bits (so holding the tiles to it holds them to that)."""
    from test_int8_kquants import int8_product_reference

    for name in ("Q4_K", "Q6_K"):
        raw = _blocks(name, 5, 512, seed=1)
        x = _special_x(3, 512, seed=2)
        assert torch.equal(reference(raw, name, x), int8_product_reference(raw, name, x))


@needs_tiles
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_tile_products_equal_the_reference_bit_for_bit(name):
    """gemm at 1..64 rows (below 8 the VNNI rows, then the tiles), 37 weight rows (the last 16-row tile holds 5),
    3 super-blocks: every result equal to the reference's bits."""
    raw, x = _blocks(name, 37, 768, seed=3), _special_x(64, 768, seed=4)
    assert_tile_rows(name, raw, x, reference(raw, name, x))


@needs_tiles
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_grouped_tile_products_equal_the_reference(name):
    """The grouped gemm with groups above and below 16 rows (tiles and VNNI rows in one call), experts out of order."""
    assert_grouped_tiles(name, _blocks, reference, _special_x(50, 512, seed=8))


@needs_tiles
def test_the_plan_names_the_tiles():
    """The kernel plan's words: which types, from how many rows (the C library's amx_min_rows: every type from 8), on
    a holder whose weights take them, not on one whose weights do not (Q8_0)."""
    assert TILES == f"amx-int8 tiles for {', '.join(native.INT8_TILE_TYPES.values())} at >= 8 rows"
    q4k, q6k, q8 = (GGML_TYPE_IDS[n] for n in ("Q4_K", "Q6_K", "Q8_0"))
    assert [native.tile_rows(t) for t in (q4k, q6k, q8)] == [8, 8, 0]
    assert int8_detail((q4k, q6k), 6) == (
        f"int8 activations for Q4_K, Q6_K ({native.int8_isa()}), amx-int8 tiles for Q4_K, Q6_K at >= 8 rows"
    )
    assert (
        int8_detail((q4k, q8), True)
        == f"int8 activations for Q4_K, Q8_0 ({native.int8_isa()}), amx-int8 tiles for Q4_K at >= 8 rows"
    )
    assert int8_detail((q8,), True) == f"int8 activations for Q8_0 ({native.int8_isa()})"


@needs_tiles
def test_a_build_without_tiles_runs_the_vnni_rows_with_the_same_bits(monkeypatch):
    """The plain path kept: the same sources built without AMX (-mno-amx-*) run the VNNI rows at 16+ rows, give the
    reference's bits, and the plan then says nothing of tiles."""
    with_build(monkeypatch, ("-mno-amx-tile", "-mno-amx-int8"))
    assert native.int8_tiles() == f"no amx-int8 tiles: {native.NO_TILES_IN_BUILD}"
    t, k = GGML_TYPE_IDS["Q4_K"], 512
    raw, x = _blocks("Q4_K", 19, k, seed=9), _special_x(33, k, seed=10)
    assert torch.equal(native.gemm(t, x, raw, k, int8=True), reference(raw, "Q4_K", x))
    assert int8_detail((t,), 6) == f"int8 activations for Q4_K ({native.int8_isa()})"


@needs_tiles
def test_q6_k_planes_by_table_and_by_multiply_have_the_same_bits(monkeypatch):
    """Q6_K's plane bytes come from a byte-permute table where the build has AVX512-VBMI (x86/amx_planes.c
    amx_q6_unpack_block) and from int16 multiplies where not (-mno-avx512vbmi): both give the reference's bits."""
    raw, x = _blocks("Q6_K", 37, 768, seed=13), _special_x(40, 768, seed=14)
    want = reference(raw, "Q6_K", x)
    assert_tile_rows("Q6_K", raw, x, want)
    with_build(monkeypatch, ("-mno-avx512vbmi",))
    assert_tile_rows("Q6_K", raw, x, want)

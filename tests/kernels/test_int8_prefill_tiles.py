"""Prefill products on the AMX-INT8 tiles (prefill_matmul "int8": kernels/ggml.py TILE_ROWS, native.takes_tiles).

A product of up to TILE_ROWS rows per weight (per active expert, on average, for a grouped call) of a weight whose
int8 products have a tile kernel stays on the int8 call, which runs the tiles from 16 rows. The reference is the
VNNI row kernels (x86/avx2.c, held to llama.cpp's definitions in test_int8_kquants.py / test_int8_more.py) run on
the same rows in chunks of fewer than 16 (below the tiles' threshold): every activation row is quantized on its own
and the tiles sum the same integers and apply the same float operations per row (test_int8_tiles.py), so the
route's products must equal those chunks bit for bit, at every row count up to TILE_ROWS, for dense and grouped
products alike. Above TILE_ROWS the route hands the product to decode-then-GEMM (bf16 there), which is another
computation (not equal). The weight types come from native.INT8_TILE_TYPES, so a type given a tile kernel is
tested here without a change.
"""

from __future__ import annotations

import pytest
import torch
from int8_reference import assert_grouped_route, assert_linear_keeps_int8_prefill, chunked_int8
from test_kernels import SCALE_BYTES, random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import bf16_prefill, ggml, native
from mlaserve.quant.ggml_linear import tiles_detail

STATUS = native.status()
GRANTED = STATUS.available and native.tiles_granted()
needs_tiles = pytest.mark.skipif(not GRANTED, reason="no AMX-INT8 tiles in this process (build or kernel)")
TILE_NAMES = [n for n in native.INT8_TILE_TYPES.values() if n in SCALE_BYTES]
VNNI_CHUNK = 7  # rows per call that the tiles never take (they start at 8: native.tile_rows)


def vnni_rows(t: int, x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: the int8 product in chunks of fewer than 8 rows (the VNNI row kernels)."""
    return chunked_int8(t, x, w, k, VNNI_CHUNK)


@needs_tiles
@pytest.mark.parametrize("name", TILE_NAMES)
def test_dense_route_equals_the_vnni_rows_up_to_tile_rows(name):
    """linear_native with tiles: 17..TILE_ROWS rows bit for bit the VNNI chunks' products; TILE_ROWS + 1 rows the
    bf16 decode-then-GEMM (another computation); without tiles 17+ rows never the int8 products."""
    t, k, n = GGML_TYPE_IDS[name], 512, 40
    g = torch.Generator().manual_seed(11)
    w = random_blocks(name, n, k, g)
    top = ggml.tile_rows(t)
    x = torch.randn(top + 1, k, generator=g) * 3
    want = vnni_rows(t, x, w, k)
    for rows in (17, 33, 48, top):
        got = ggml.linear_native(x[:rows], w, t, k, int8=6, bf16=True, tiles=True)
        assert torch.equal(got, want[:rows]), (name, rows, (got - want[:rows]).abs().max().item())
    above = ggml.linear_native(x, w, t, k, int8=6, bf16=True, tiles=True)
    assert torch.equal(above, bf16_prefill.linear(x, native.dequantize_bf16(t, w, k)))
    assert not torch.equal(above, want)
    assert not torch.equal(ggml.linear_native(x[:33], w, t, k, int8=6, bf16=True), want[:33])


@needs_tiles
@pytest.mark.parametrize("name", TILE_NAMES)
def test_grouped_route_equals_per_group_vnni_products(name):
    """expert_linear_native with tiles, gate and up as two stacks, groups of 40 / 3 / 70 / 17 rows (mean 32.5 <=
    TILE_ROWS: one int8 call per part, the tiles taking the groups of 16+ rows): each group's rows bit for bit that
    expert's VNNI-chunk product; with the mean above TILE_ROWS the decoded grouped GEMMs run instead."""
    above = ggml.tile_rows(GGML_TYPE_IDS[name]) + 1
    assert_grouped_route(name, random_blocks, [40, 3, 70, 17], 12, size=VNNI_CHUNK, above=above)


@needs_tiles
def test_holders_take_the_tiles_by_the_plan_and_say_so():
    """set_prefill_tiles after the int8 setting: a tile type under int8_6bit takes them, Q8_0 (exact under int8_6bit,
    no tile kernel) and any type under float activations do not; the plan's words name the types and the rows."""
    from mlaserve.quant.ggml_linear import GGUFExperts

    tile_id, q8 = GGML_TYPE_IDS[TILE_NAMES[0]], GGML_TYPE_IDS["Q8_0"]
    assert_linear_keeps_int8_prefill(tile_id)
    ex = GGUFExperts(256, 4, 256, tile_id, q8, "cpu")
    ex.int8 = 6
    ex.set_prefill_tiles()
    assert ex.tiles_gate_up and not ex.tiles_down
    want = (
        f"int8 prefill on amx-int8 tiles for {TILE_NAMES[0]} up to {ggml.tile_rows(tile_id)} rows per product "
        "(measured crossover with bf16 decode-then-GEMM: kernels/ggml.tile_rows), decode-then-GEMM above"
    )
    assert tiles_detail((tile_id, q8), (True, False)) == want and want in ex.native_detail()
    assert tiles_detail((tile_id,), (False,)) is None
    # the grid i-quants' tiles run further (their decoders are table lookups): each type named with its rows
    q4k, iq2 = GGML_TYPE_IDS["Q4_K"], GGML_TYPE_IDS["IQ2_XXS"]
    assert ggml.tile_rows(q4k) == ggml.TILE_ROWS < ggml.tile_rows(iq2) == ggml.GRID_TILE_ROWS
    assert tiles_detail((iq2, q4k), (True, True)).startswith(
        f"int8 prefill on amx-int8 tiles for Q4_K up to {ggml.TILE_ROWS} rows and IQ2_XXS up to "
        f"{ggml.GRID_TILE_ROWS} rows per product"
    )

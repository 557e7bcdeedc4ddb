"""Int8 products of many rows on unpacked weight panels where the process has no AMX-INT8 tiles: AVX512-VNNI's 16-row
panels (csrc/x86/vnni_panels.c: Q4_K, Q5_K, Q6_K and the i-quants from native.panel_rows activation rows, 12 or 16)
and, without AVX512-VNNI, AVX2's 8-row panels (x86/avx2_panels.c: Q4_K, Q5_K, Q6_K from 8 rows); the row kernels
below.

The panels sum the row kernels' integers exactly (the weight rows in the lanes of a vector; vpdpbusd per 4 values, or
vpmaddubsw pair sums added in int16 and one vpmaddwd by the scale; the sub-block scales on the int32 sums; Q6_K's -32
on the activations' sums per 16 values) and apply the same float steps in the same order per (activation row, weight
row), so their products must equal the numpy reference of test_int8_tiles.py (llama.cpp's q8_K quantizer and the
weight codes from ggml's layout, checked against gguf-py in test_int8_kquants.py) bit for bit: at row counts on both
sides of the switch, odd tails of the activation tiles, a last panel holding 5 rows, 3 super-blocks. Each test runs
on every panel build of this CPU: the process's own, and on an AVX-512 CPU the same sources built for AVX2 (its 8-row
panels). Then the route (prefill_matmul "int8" without tiles): a weight whose type runs on the panels stays int8 at
every row count, dense and routed, and the plan says so.
"""

from __future__ import annotations

import pytest
import torch
from int8_reference import assert_grouped_tiles, assert_linear_keeps_int8_prefill, chunked_int8, grid_blocks, with_build
from test_int8_kquants import _blocks, _special_x
from test_int8_tiles import reference

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native
from mlaserve.quant.ggml_linear import GGUFExperts, tiles_detail

STATUS = native.status()
PANELS = STATUS.available and native.panel_rows(GGML_TYPE_IDS["Q4_K"]) > 0
needs_panels = pytest.mark.skipif(
    not PANELS,
    reason=f"no int8 panels in this process (no AVX2 in the build, or AMX-INT8 tiles take these products): "
    f"{STATUS.detail}",
)
# the same sources for an AVX2 CPU (no AVX-512, no AMX: the tiles would take the products)
AVX2 = ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8")
BUILDS = {
    "process": pytest.param((), marks=needs_panels),
    "avx2": pytest.param(
        AVX2,
        marks=pytest.mark.skipif(
            not STATUS.available or "avx512f" not in cpu_flags(),
            reason="an AVX2-only CPU: the process's own build is the AVX2 one",
        ),
    ),
}
NAMES = ["Q4_K", "Q5_K", "Q6_K"]
IQ_NAMES = [n for n in native.INT8_PANEL_TYPES.values() if n.startswith("IQ")]
ROWS = (1, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 23, 31, 33, 48, 64)  # both sides of 8, 12, 16; tails of the tiles


@pytest.fixture(params=list(BUILDS.values()), ids=list(BUILDS))
def panel_build(request, monkeypatch):
    """A build with int8 panels for Q4_K: its panels' instructions ("avx512-vnni", "avx2")."""
    if request.param:
        with_build(monkeypatch, request.param)
    assert native.panel_rows(GGML_TYPE_IDS["Q4_K"]) > 0, native.status().detail
    return native.panels_isa()


@pytest.mark.parametrize("name", NAMES)
def test_panel_products_equal_the_reference_bit_for_bit(name, panel_build):
    """gemm at 1..64 rows, 37 weight rows (the last panel holds 5), 3 super-blocks: the reference's bits at every
    count; rows 5..40 inside another batch the same (a row's result does not depend on its batch or tile)."""
    t, k = GGML_TYPE_IDS[name], 768
    raw, x = _blocks(name, 37, k, seed=21), _special_x(64, k, seed=22)
    want = reference(raw, name, x)
    assert native.panel_rows(t) in ((12, 16) if panel_build == "avx512-vnni" else (8,))
    for rows in ROWS:
        got = native.gemm(t, x[:rows].contiguous(), raw, k, int8=True)
        assert torch.equal(got, want[:rows]), (name, rows, (got - want[:rows]).abs().max().item())
    assert torch.equal(native.gemm(t, x[5:41].contiguous(), raw, k, int8=True), want[5:41])


@pytest.mark.parametrize("name", NAMES)
def test_grouped_panel_products_equal_the_reference(name, panel_build):
    """The grouped gemm with groups of 19 / 5 / 26 rows (panels and row kernels in one call), experts out of order."""
    assert_grouped_tiles(name, _blocks, reference, _special_x(50, 512, seed=23))


@pytest.mark.parametrize("name", IQ_NAMES)
def test_i_quant_panels_equal_the_row_kernels_bit_for_bit(name, panel_build):
    """The i-quants (signed codes: plus an offset on AVX512-VNNI, |w| and w's signs on AVX2; their scales per 16
    values): gemm at 8..64 rows equal to the int8 product in chunks of 7 rows (the row kernels, held to the i-quants' references in test_int8_iq_grids.py and
    test_int8_more.py), 37 weight rows, 3 super-blocks; and in a grouped call with a group below the threshold."""
    t, k = GGML_TYPE_IDS[name], 768
    raw, x = grid_blocks(name, 37, k, seed=33), _special_x(64, k, seed=34) * 0.5
    want = chunked_int8(t, x, raw, k, 7)
    assert native.panel_rows(t) == (16 if panel_build == "avx512-vnni" else 8)
    for rows in (8, 9, 16, 17, 23, 33, 64):
        got = native.gemm(t, x[:rows].contiguous(), raw, k, int8=True)
        assert torch.equal(got, want[:rows]), (name, rows, (got - want[:rows]).abs().max().item())
    stacked = torch.stack([grid_blocks(name, 37, k, seed=s) for s in (35, 36)])
    ys = native.grouped_gemm(
        t, x[:40].contiguous(), stacked, k, torch.tensor([1, 0]), torch.tensor([0, 5, 40]), int8=True
    )
    assert torch.equal(ys[:5], chunked_int8(t, x[:5], stacked[1], k, 7))
    assert torch.equal(ys[5:], chunked_int8(t, x[5:40], stacked[0], k, 7))


def test_a_nan_row_stays_its_own(panel_build):
    """A row holding NaN gets NaN outputs (its super-block scale is NaN, as on the row kernels) and leaves the other
    rows of its panel and tile their bits."""
    t, k = GGML_TYPE_IDS["Q4_K"], 512
    raw, x = _blocks("Q4_K", 20, k, seed=24), _special_x(20, k, seed=25)
    want = reference(raw, "Q4_K", x)
    x[6, 300] = float("nan")
    got = native.gemm(t, x, raw, k, int8=True)
    assert torch.isnan(got[6]).all()
    keep = torch.arange(20) != 6
    assert torch.equal(got[keep], want[keep])


@needs_panels
def test_a_build_without_panels_runs_the_row_kernels_with_the_same_bits(monkeypatch):
    """The plain path kept: the same sources built without the panels (-DMLS_NO_INT8_PANELS, benchmarks/int8_tiles.py's
    control) run the row kernels at every row count (panel_rows 0) and give the same bits."""
    t, k = GGML_TYPE_IDS["Q6_K"], 512
    raw, x = _blocks("Q6_K", 19, k, seed=26), _special_x(33, k, seed=27)
    want = reference(raw, "Q6_K", x)
    with_build(monkeypatch, ("-DMLS_NO_INT8_PANELS",))
    assert native.panel_rows(t) == 0 and native.int8_panels() == ""
    assert torch.equal(native.gemm(t, x, raw, k, int8=True), want)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_route_stays_int8_at_every_row_count(name, panel_build, monkeypatch):
    """Without tiles, a panel type flagged for int8 prefill stays on the int8 call far above ROW_KERNEL_ROWS: dense
    200 rows and routed experts at 150 rows per expert give the chunked int8 products' bits (the bf16 GEMMs would
    not)."""
    monkeypatch.setattr(native, "tiles_granted", lambda: False)
    t, k = GGML_TYPE_IDS[name], 512
    assert ggml.tile_rows(t) == ggml.expert_int8_rows(t) == ggml.PANEL_INT8_ROWS
    raw, x = _blocks(name, 24, k, seed=28), _special_x(200, k, seed=29)
    got = ggml.linear_native(x, raw, t, k, int8=6, bf16=True, tiles=True)
    assert torch.equal(got, chunked_int8(t, x, raw, k, 7))
    stacks = torch.stack([_blocks(name, 24, k, seed=s) for s in (30, 31)])
    experts, offs = torch.tensor([1, 0]), torch.tensor([150, 300], dtype=torch.int32)
    xs = _special_x(300, k, seed=32)
    ys = ggml.expert_linear_native(xs, stacks, t, k, experts, offs, int8=6, bf16=True, tiles=True)
    assert torch.equal(ys[:150], chunked_int8(t, xs[:150], stacks[1], k, 7))
    assert torch.equal(ys[150:], chunked_int8(t, xs[150:], stacks[0], k, 7))


def test_holders_take_the_panels_by_the_plan_and_say_so(panel_build, monkeypatch):
    """set_prefill_tiles without tiles: a dense Q4_K weight under int8_6bit takes the panels (before them only routed
    experts stayed int8), under float activations not; the plan names the panels with their instructions and rows,
    and an expert type without panels the row kernels up to ROW_KERNEL_ROWS."""
    monkeypatch.setattr(native, "tiles_granted", lambda: False)
    q4k, q6k, iq4 = GGML_TYPE_IDS["Q4_K"], GGML_TYPE_IDS["Q6_K"], GGML_TYPE_IDS["IQ4_XS"]
    assert_linear_keeps_int8_prefill(q4k)
    vnni = panel_build == "avx512-vnni"
    assert native.int8_panels() == (
        f"avx512-vnni panels for Q4_K, Q5_K at >= 12 rows; {', '.join(['Q6_K', *IQ_NAMES])} at >= 16 rows"
        if vnni
        else f"avx2 panels for {', '.join(['Q4_K', 'Q5_K', 'Q6_K', *IQ_NAMES])} at >= 8 rows"
    )
    said = tiles_detail((q4k, q6k), (True, True))
    assert said.startswith(
        "int8 prefill at every row count for Q4_K, Q6_K (avx512-vnni panels for Q4_K at >= 12 rows; Q6_K at >= 16 "
        "rows, the row kernels below;"
        if vnni
        else "int8 prefill at every row count for Q4_K, Q6_K (avx2 panels for Q4_K, Q6_K at >= 8 rows, the row kernels "
        "below;"
    ), said
    ex = GGUFExperts(256, 4, 256, iq4, q4k, "cpu")
    ex.int8 = 6
    ex.set_prefill_tiles()
    assert (ex.tiles_gate_up, ex.tiles_down) == (True, True)
    assert "int8 prefill at every row count for IQ4_XS, Q4_K (" in ex.native_detail()
    # a routed-expert type with row kernels but no panels keeps the row kernels' rows
    monkeypatch.setattr(native, "panel_rows", lambda type_id: 0 if type_id == iq4 else 12)
    said = tiles_detail((iq4, q4k), (True, True))
    assert "int8 prefill at every row count for Q4_K (" in said
    assert f"int8 prefill on the row kernels for IQ4_XS up to {ggml.ROW_KERNEL_ROWS} rows per active expert" in said

"""Prefill products of routed experts kept int8 on the row kernels where the process has no AMX-INT8 tiles
(prefill_matmul "int8": native.takes_expert_int8, kernels/ggml.py ROW_KERNEL_ROWS).

Without tiles the grouped int8 call runs every group on the VNNI row kernels, 4 activation rows per pass over a
weight row; each activation row is quantized on its own and its products are the same integers and float operations
whatever rows share the pass (test_int8_kquants.py), so up to ROW_KERNEL_ROWS rows per active expert (on average)
each group's rows must equal that expert's product in chunks of any size, bit for bit; above it the experts are
decoded for the bf16 GEMM instead (another computation). The tests stand the process's tiles and int8 panels down
(native.tiles_granted -> False, native.panel_rows -> 0), so they run on every machine; where the build has them the C
call may still take groups of 8+ (8+, 12+) rows there, which give the same bits (test_int8_prefill_tiles.py,
test_int8_panels.py).
"""

from __future__ import annotations

import pytest
import torch
from int8_reference import assert_grouped_route
from test_kernels import random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native
from mlaserve.quant.ggml_linear import GGUFExperts, tiles_detail

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
NAMES = ["Q4_K", "Q6_K", "Q5_K"]


@pytest.fixture()
def no_tiles(monkeypatch):
    """Neither the AMX tiles nor the int8 panels (test_int8_panels.py) in the route's view: the C call may still
    run groups on them, with the same bits."""
    monkeypatch.setattr(native, "tiles_granted", lambda: False)
    monkeypatch.setattr(native, "panel_rows", lambda type_id: 0)


@needs_native
@pytest.mark.parametrize("name", NAMES)
def test_grouped_rows_stay_int8_up_to_row_kernel_rows(name, no_tiles):
    """groups of 40 / 3 / 150 / 17 rows (mean 52.5): each group's rows bit for bit its expert's chunked int8
    product (gate and up as two stacks, side by side); with the mean above ROW_KERNEL_ROWS the decoded bf16 GEMMs."""
    assert ggml.expert_int8_rows(GGML_TYPE_IDS[name]) == ggml.ROW_KERNEL_ROWS
    ys, bf16 = assert_grouped_route(name, random_blocks, [40, 3, 150, 17], 21, size=5, above=ggml.ROW_KERNEL_ROWS + 1)
    assert not torch.equal(ys, bf16)  # the int8 products, not the bf16 GEMMs'


@needs_native
def test_experts_take_the_row_kernels_by_the_plan_and_say_so(no_tiles):
    """set_prefill_tiles without tiles: a super-block int8 type under int8_6bit keeps its products int8, Q8_0 (exact
    under int8_6bit), Q4_0 (its row kernels measured slower than bf16 there) and every type under float activations
    do not; the plan's words say where and up to how many rows."""
    q4k, q8 = GGML_TYPE_IDS["Q4_K"], GGML_TYPE_IDS["Q8_0"]
    ex = GGUFExperts(256, 4, 256, q4k, q8, "cpu")
    ex.int8 = 6
    ex.set_prefill_tiles()
    assert (ex.tiles_gate_up, ex.tiles_down) == (True, False)
    said = tiles_detail((q4k, q8), (ex.tiles_gate_up, ex.tiles_down))
    assert said.startswith(f"int8 prefill on the row kernels for Q4_K up to {ggml.ROW_KERNEL_ROWS} rows per active")
    ex.int8 = 0
    ex.set_prefill_tiles()
    assert (ex.tiles_gate_up, ex.tiles_down) == (False, False)
    q40 = GGUFExperts(256, 4, 256, GGML_TYPE_IDS["Q4_0"], q4k, "cpu")  # a 32-value block type: measured slower there
    q40.int8 = 6
    q40.set_prefill_tiles()
    assert (q40.tiles_gate_up, q40.tiles_down) == (False, True)

"""A SwiGLU's long steps in row parts (models/layers.py SwiGLU.row_part, the KernelPlan's mlp_rows op): taken only
where every projection reads its weight's blocks in place at the part's rows (a GGUFLinear on the int8 tiles /
VNNI panels, int16 products, Q8_0's bf16 pairs or the fp32 decoded panels: kernels/ggml.py IN_PLACE_PATHS), and then each row's output is the whole step's, bit
for bit; elsewhere (nn.Linear, the torch kernels, a weight decoded per call) the plan keeps whole steps and says
why."""

from __future__ import annotations

import pytest
import torch
from test_kernels import random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import bf16_prefill, native, registry
from mlaserve.models import layers
from mlaserve.models.layers import SwiGLU
from mlaserve.quant.ggml_linear import GGUFLinear

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
D, INTER = 256, 512


def gguf_swiglu(types: tuple[str, str, str], seed: int = 0) -> SwiGLU:
    mlp = SwiGLU(D, INTER)
    g = torch.Generator().manual_seed(seed)
    for attr, name, (n, k) in zip(("gate_proj", "up_proj", "down_proj"), types, ((INTER, D), (INTER, D), (D, INTER))):
        lin = GGUFLinear(k, n, GGML_TYPE_IDS[name], False, torch.float32, "cpu")
        with torch.no_grad():
            lin.weight.copy_(random_blocks(name, n, k, g))
        setattr(mlp, attr, lin)
    return mlp


def choice(mlp: SwiGLU, ctx: registry.KernelContext) -> registry.KernelChoice:
    plan = registry.plan_kernels(mlp, ctx)
    return plan.of("", "mlp_rows")


@needs_native
@pytest.mark.parametrize("rows,part", [(16, 8), (16, 5), (13, 4)])
def test_parts_equal_the_whole_step(rows, part):
    """Decode-sized parts and wholes (every build reads the blocks in place up to GEMV_ROWS rows): each part's rows
    are the whole step's, bit for bit, in order, with uneven splits; int8 and float activations."""
    mlp = gguf_swiglu(("Q4_K", "Q4_K", "Q6_K"))
    for int8 in (0, 6):
        registry.plan_kernels(mlp, registry.KernelContext("native", int8))
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(1))
        mlp.row_part = None
        whole = mlp(x)
        mlp.row_part = part
        calls, whole_call = [], mlp._whole
        mlp._whole = lambda t, calls=calls, whole_call=whole_call: (calls.append(t.shape[0]), whole_call(t))[1]
        got = mlp(x)
        del mlp._whole
        assert torch.equal(got, whole), (int8, rows, part)
        n = -(-rows // part)
        assert sum(calls) == rows and len(calls) == n and max(calls) - min(calls) <= 1 and max(calls) <= part, calls
        assert torch.equal(mlp(x.view(1, rows, D)), whole.view(1, rows, D))  # a leading dimension kept


@needs_native
@pytest.mark.parametrize(
    "types, ctx",
    [
        (("Q4_K", "Q4_K", "Q6_K"), registry.KernelContext("native", 6, tiles=True)),
        # prefill_matmul auto's cap for a Q8_0 file: Q8_0's bf16 pairs on AMX-BF16 tiles, int16 on AVX512-VNNI
        (("Q8_0", "Q8_0", "Q8_0"), registry.KernelContext("native", 6, bf16=6, tiles=True)),
    ],
    ids=["q4_k-int8", "q8_0-pairs-or-int16"],
)
def test_plan_takes_parts_only_where_the_blocks_are_read_in_place(monkeypatch, types, ctx):
    """Under prefill_matmul "int8" the Q4_K / Q6_K projections are in place wherever this machine has the tiles or
    VNNI panels, and Q8_0's many-rows products (bf16 pairs on the AMX-BF16 tiles, int16 on AVX512-VNNI) wherever
    they run: then parts of ROW_PART_MIN rows (the cap made small) and a 700-row step equal to the whole step;
    without, and with the torch kernels or nn.Linear projections, whole steps with the reason named."""
    monkeypatch.setattr(layers, "ROW_PART_BYTES", 1)
    mlp = gguf_swiglu(types, seed=2)
    c = choice(mlp, ctx)
    in_place = all(
        getattr(mlp, n).prefill_reads_in_place(layers.ROW_PART_MIN) is None
        for n in ("gate_proj", "up_proj", "down_proj")
    )
    if types[0] == "Q8_0":  # the pairs and the int16 products convert a panel at a time: in place; fp32 is not
        assert in_place == (mlp.gate_proj.bf16 in (bf16_prefill.BF16_PAIRS, bf16_prefill.INT16)), mlp.gate_proj.bf16
    if in_place:
        assert c.impl == "row_parts" and mlp.row_part == layers.ROW_PART_MIN, c
        x = torch.randn(700, D, generator=torch.Generator().manual_seed(3))  # parts of 234, 233, 233
        got = mlp(x)
        mlp.row_part = None
        assert torch.equal(got, mlp(x))
    else:
        assert c.impl == "whole" and mlp.row_part is None and "decoded per call" in c.reason, c
    # float activations at 256 rows: decode-then-GEMM, every build
    c = choice(gguf_swiglu(("Q4_K", "Q4_K", "Q6_K")), registry.KernelContext("native", 0))
    assert c.impl == "whole" and "decoded (the whole weight decoded per call)" in c.reason, c
    c = choice(gguf_swiglu(("Q4_K", "Q4_K", "Q6_K")), registry.KernelContext("torch", 0))
    assert c.impl == "whole" and "kernel torch" in c.reason, c
    c = choice(SwiGLU(D, INTER), registry.KernelContext("native", 0))
    assert c.impl == "whole" and "gate_proj: Linear" in c.reason, c


@needs_native
def test_every_path_that_reads_blocks_in_place_says_so():
    """Each linear_native path is in place or not by what it does per call, not by its name: fp32 products of up to
    PANEL_ROWS rows on the decoded panels (a panel at a time into a thread's buffer) are; decode-then-GEMM (the whole
    weight decoded) is not."""
    from mlaserve.kernels import ggml, panels

    q8 = GGUFLinear(D, INTER, GGML_TYPE_IDS["Q8_0"], False, torch.float32, "cpu")
    registry.plan_kernels(q8, registry.KernelContext("native", 0))  # float activations, fp32 prefill
    assert ggml.linear_path(ggml.PANEL_ROWS + 1, q8.ggml_type) == "decoded"
    assert q8.prefill_reads_in_place(ggml.PANEL_ROWS + 1) == "decoded (the whole weight decoded per call)"
    if panels.available():
        assert ggml.linear_path(ggml.PANEL_ROWS, q8.ggml_type) == "panels"
        assert q8.prefill_reads_in_place(ggml.PANEL_ROWS) is None


@needs_native
def test_hooked_projections_see_whole_steps():
    """A forward hook on a projection sees the step's whole tensor: a hooked SwiGLU runs whole."""
    mlp = gguf_swiglu(("Q4_K", "Q4_K", "Q6_K"))
    registry.plan_kernels(mlp, registry.KernelContext("native", 6))
    mlp.row_part = 4
    seen = []
    mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    mlp(torch.randn(10, D))
    assert seen == [10]

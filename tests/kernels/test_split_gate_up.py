"""A MoE layer's gate and up stacks read at their own addresses (mls_moe_block_t.gate / .up, mls_moe_experts'
gate / up, kernels.ggml's two-part weights): two separately allocated stacks give, bit for bit, what one
fused [E, 2I, R] stack (gate rows first, the layout the kernels read before) gives, on every path of
GGUFExperts and the MoE block: the same bytes from other addresses, the same operations.

The fused reference here is one tensor whose halves are the holder's stacks; the split case copies them into
two allocations with the other stack in between (so a kernel that found the up rows at the fused offset from
the gate rows would read another expert's gate rows: the break check of every test below).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import random_blocks
from test_moe_block import INTER, D, make_moe, routing

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native
from mlaserve.quant.ggml_linear import BLOCK_TOKENS
from mlaserve.quant.ggml_moe_block import GGUFMoEBlock

pytestmark = pytest.mark.skipif(not native.status().available, reason="native kernels unavailable")
TYPES = ["Q8_0", "Q4_K", "Q6_K", "Q5_0"]  # the kept types of Q8_0 / Q4_K_M files, and one more


def _split(fused: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up copied out of the fused stack into two allocations, up first in memory."""
    space = torch.empty(2, *fused[:, :inter].shape, dtype=torch.uint8)
    space[0].copy_(fused[:, inter:])
    space[1].copy_(fused[:, :inter])
    return space[1], space[0]


@pytest.mark.parametrize("rows", [2, 40])  # per expert: the grouped decode-and-dot; decode-then-GEMM (> 16)
@pytest.mark.parametrize("name", TYPES)
def test_expert_products_of_two_stacks_equal_the_fused_stack(name, rows):
    g = torch.Generator().manual_seed(3)
    t, e, inter = GGML_TYPE_IDS[name], 5, 256
    fused = random_blocks(name, 2 * inter, D, g, lead=(e,))
    gate, up = _split(fused, inter)
    experts = torch.tensor([0, 2, 4])
    offs = torch.tensor([rows, 2 * rows, 3 * rows], dtype=torch.int32)
    xs = torch.randn(3 * rows, D, generator=g)
    for product in (ggml.expert_linear_native, ggml.expert_linear_torch):
        want = product(xs, fused, t, D, experts, offs)
        got = product(xs, (gate, up), t, D, experts, offs)
        assert torch.equal(got, want), product.__name__


def test_decoded_experts_land_in_the_halves_of_one_buffer():
    """dequantize_experts' out stride: gate and up decoded into one [A, 2I, K] buffer equal the fused decode."""
    g = torch.Generator().manual_seed(4)
    t, inter = GGML_TYPE_IDS["Q4_K"], 256
    fused = random_blocks("Q4_K", 2 * inter, D, g, lead=(4,))
    gate, up = _split(fused, inter)
    experts = torch.tensor([3, 1])
    out = torch.full((2, 2 * inter, D), float("nan"))
    native.dequantize_experts(t, gate, experts, D, out=out[:, :inter])
    native.dequantize_experts(t, up, experts, D, out=out[:, inter:])
    assert torch.equal(out, native.dequantize_experts(t, fused, experts, D))
    with pytest.raises(ValueError, match="out"):
        native.dequantize_experts(t, gate, experts, D, out=out)  # [2, 2I, K] is not [2, I, K]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_pairwise_experts_call_of_two_stacks_equals_the_fused_stack(name, int8):
    g = torch.Generator().manual_seed(5)
    t, e, inter, k = GGML_TYPE_IDS[name], 6, 128, 4
    fused = random_blocks(name, 2 * inter, D, g, lead=(e,))
    down = random_blocks(name, D, inter, g, lead=(e,))
    gate, up = _split(fused, inter)
    x = torch.randn(2, D, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(2)])
    w = torch.rand(2, k, generator=g)
    want = ggml.moe_experts(x, w, idx, fused[:, :inter], fused[:, inter:], t, down, t, int8=int8)
    assert torch.equal(ggml.moe_experts(x, w, idx, gate, up, t, down, t, int8=int8), want)
    with pytest.raises(ValueError, match="layout"):
        ggml.moe_experts(x, w, idx, gate, up[:, :64], t, down, t)


@pytest.mark.parametrize("tokens", [1, 5, BLOCK_TOKENS])
@pytest.mark.parametrize("types", ["q8_0", "q4_k-q5_0-q8_0"])
def test_moe_block_of_two_stacks_equals_the_fused_stack(types, tokens):
    """The one-call MoE block (mls_moe_block_t.gate / .up) and GGUFExperts' per-op path."""
    moe = make_moe("v3", types)
    ex = moe.experts
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    fused = torch.cat((ex.gate_proj, ex.up_proj), dim=1)
    with torch.no_grad():
        ex.gate_proj.data, ex.up_proj.data = fused[:, :INTER], fused[:, INTER:]
    want_block, w, idx = routing(GGUFMoEBlock(moe), x)
    want_experts = ex(x, w, idx)
    with torch.no_grad():
        ex.gate_proj.data, ex.up_proj.data = _split(fused, INTER)
    got_block, w2, idx2 = routing(GGUFMoEBlock(moe), x)
    assert torch.equal(w2, w) and torch.equal(idx2, idx)
    assert torch.equal(got_block, want_block)
    assert torch.equal(ex(x, w, idx), want_experts)

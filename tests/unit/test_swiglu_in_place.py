"""SwiGLU computes silu(gate) * up in gate's memory where nothing else can hold gate (models/layers.py
swiglu_into): the same values as out of place, plain and clamped, and a forward hook on a projection still sees its
output as it was (the in-place path steps aside)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.models.layers import SwiGLU


@pytest.mark.parametrize("limit", [None, 0.5])
def test_in_place_product_equals_out_of_place(limit):
    torch.manual_seed(0)
    mlp = SwiGLU(32, 48, limit)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = mlp.down_proj(mlp.act(mlp.gate_proj(x), mlp.up_proj(x)))
        got = mlp(x)
    assert torch.equal(got, want)


def test_a_hook_on_a_projection_keeps_its_output():
    torch.manual_seed(1)
    mlp = SwiGLU(32, 48)
    x = torch.randn(5, 32)
    kept = []
    handle = mlp.gate_proj.register_forward_hook(lambda m, args, out: kept.append(out))
    with torch.no_grad():
        mlp(x)
        want = mlp.gate_proj.weight @ x.T
    handle.remove()
    assert torch.allclose(kept[0], want.T, atol=1e-6)  # the projection's output, not silu(gate) * up

"""SwiGLU computes silu(gate) * up in gate's memory where nothing else can hold gate (models/layers.py
swiglu_into): the same values as out of place, plain and clamped, and a forward hook on a projection still sees its
output as it was (the in-place path steps aside)."""

from __future__ import annotations

import weakref

import pytest
import torch

from mlaserve.config.model_parts import MoEConfig
from mlaserve.models.layers import SwiGLU
from mlaserve.models.moe import Experts


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


class _Recorded(torch.nn.Module):
    """Wraps a projection without a hook (a hook would change SwiGLU's path): keeps a weak reference to each output."""

    def __init__(self, inner: torch.nn.Module, refs: list) -> None:
        super().__init__()
        self.inner, self.refs = inner, refs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        self.refs.append(weakref.ref(out))
        return out


class _Checked(torch.nn.Module):
    """The down projection, noting which recorded outputs are still alive when it runs."""

    def __init__(self, inner: torch.nn.Module, refs: list, alive: list) -> None:
        super().__init__()
        self.inner, self.refs, self.alive = inner, refs, alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive.append([r() is not None for r in self.refs])
        return self.inner(x)


@pytest.mark.parametrize("hooked", [False, True])
def test_the_projections_outputs_are_freed_before_the_down_projection(hooked):
    """up's [T, I] (and gate's, where the product is a new tensor) is not held while the down projection runs: at a
    1,024-token step of a 10,944-wide dense MLP that is 42 MiB beside the down projection's own temporaries. In place,
    gate's memory is the product (the down projection's input), so only up must be gone."""
    torch.manual_seed(2)
    mlp = SwiGLU(32, 48)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = mlp(x)
    refs, alive = [], []
    mlp.gate_proj, mlp.up_proj = _Recorded(mlp.gate_proj, refs), _Recorded(mlp.up_proj, refs)
    mlp.down_proj = _Checked(mlp.down_proj, refs, alive)
    if hooked:  # a hook on a projection takes the out-of-place product: then neither output is needed any more
        mlp.gate_proj.register_forward_hook(lambda m, args, out: None)
    with torch.no_grad():
        got = mlp(x)
    assert torch.equal(got, want)
    assert alive == [[False, False]] if hooked else alive == [[True, False]]


def test_grouped_experts_free_the_gate_up_product_before_the_down_product(monkeypatch):
    """models/moe.py Experts (grouped): the pairs' [P, 2I] gate / up product is freed before the down product runs."""
    torch.manual_seed(3)
    cfg = MoEConfig(
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=0, moe_intermediate_size=8,
        scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )  # fmt: skip
    experts = Experts(16, cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x, idx = torch.randn(6, 16), torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2], [1, 3]])
    w = torch.rand(6, 2)
    with torch.no_grad():
        want = experts._forward_loop(x, w, idx)
    grouped, refs, alive = torch._grouped_mm, [], []

    def recorded(a, b, offs):
        alive.append([r() is not None for r in refs])
        out = grouped(a, b, offs=offs)
        refs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "_grouped_mm", recorded)
    with torch.no_grad():
        got = experts._forward_grouped(x, w, idx)
    assert torch.allclose(got, want, atol=1e-5)
    assert alive == [[], [False]]  # at the down product, the gate / up product is gone

"""The KDA forget gate with GLM-5.3-Flash's lower bound (KDAConfig.lower_bound, read from linear_lower_bound)
against transformers 5.24's Glm5NextTextForgetGate on the same weights, and Kimi-Linear's unbounded gate kept.

Bound: 1e-6 max abs on gates in [-5, 0]: both sides compute b sigmoid(exp(A_log) (f + dt_bias)) in fp32 from the
same fp32 projections (measured 0: the same ops in the same order; the bound leaves room for another summation
order). exp(A_log) moved outside the sigmoid was off by 2.57 (broken on purpose).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mlaserve.config.model import KDAConfig
from mlaserve.models.kda.layer import KimiDeltaAttention

BOUND = 1e-6


def _layer(bound: float | None, heads: int = 5, d: int = 8, hidden: int = 48) -> KimiDeltaAttention:
    kda = KDAConfig(layers=(0,), num_heads=heads, head_dim=d, conv_kernel=4, lower_bound=bound)
    layer = KimiDeltaAttention(SimpleNamespace(kda=kda, hidden_size=hidden, rms_norm_eps=1e-5), 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layer


@pytest.mark.parametrize("bound", [-5.0, -2.5])
def test_the_bounded_gate_equals_transformers(bound):
    tf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers import Glm5NextTextConfig

    heads, d, hidden = 5, 8, 48
    ours = _layer(bound, heads, d, hidden)
    cfg = Glm5NextTextConfig(
        hidden_size=hidden, linear_num_heads=heads, linear_head_dim=d, linear_lower_bound=bound, q_lora_rank=16
    )
    ref = tf.Glm5NextTextForgetGate(cfg)
    with torch.no_grad():
        ref.f_a_proj.weight.copy_(ours.f_a_proj.weight)
        ref.f_b_proj.weight.copy_(ours.f_b_proj.weight)
        ref.dt_bias.copy_(ours.dt_bias)
        ref.A_log.copy_(ours.A_log.view(heads))  # the checkpoint's [H]
    x = torch.randn(1, 37, hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours.forget_gate(x[0]), ref(x)[0]
    assert got.shape == want.shape == (37, heads, d)
    err = (got - want).abs().max().item()
    assert err <= BOUND, f"max abs {err:.3g}"
    assert got.min() >= bound and got.max() <= 0  # the safe gate's range (sigmoid saturates to 1 in fp32)


def test_without_a_bound_the_gate_is_kimi_linears_softplus():
    ours = _layer(None)
    x = torch.randn(11, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        f = (ours.f_b_proj(ours.f_a_proj(x)) + ours.dt_bias).unflatten(-1, (5, 8))
        want = -ours.A_log.view(5, 1).exp() * torch.nn.functional.softplus(f)
        got = ours.forget_gate(x)
    assert (got - want).abs().max().item() <= BOUND

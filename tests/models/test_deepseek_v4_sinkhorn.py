"""mHC's Sinkhorn on CPU (numpy, models/deepseek_v4/hyper.sinkhorn) against the plain torch path
(sinkhorn_reference): the same fp32 operations in the same order, so equal bit for bit, at decode (S = 1) and
prefill row counts, for the N = 4 streams of V4 and GLM-5.3 and another N."""

import pytest
import torch

from mlaserve.models.deepseek_v4.hyper import HyperConnection, sinkhorn, sinkhorn_reference


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("s", [1, 2, 16, 129])
def test_sinkhorn_equals_reference_bitwise(s, n):
    g = torch.Generator().manual_seed(s * 10 + n)
    for scale in (0.1, 1.0, 8.0):  # near-uniform to nearly one-hot rows
        comb = torch.softmax(torch.randn(s, n, n, generator=g) * scale, dim=-1) + 1e-6
        before = comb.clone()
        got, want = sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6)
        assert got.dtype == torch.float32 and got.shape == (s, n, n)
        assert torch.equal(got, want), (s, n, scale, (got - want).abs().max().item())
        assert torch.equal(comb, before)  # the input is not written


def test_sinkhorn_one_iteration_and_autograd_take_the_reference_math():
    comb = torch.softmax(torch.randn(3, 4, 4), dim=-1) + 1e-6
    assert torch.equal(sinkhorn(comb, 1, 1e-6), sinkhorn_reference(comb, 1, 1e-6))
    leaf = comb.clone().requires_grad_(True)
    out = sinkhorn(leaf, 20, 1e-6)
    assert out.requires_grad and torch.equal(out.detach(), sinkhorn_reference(comb, 20, 1e-6))


def test_hyper_connection_under_inference_mode(monkeypatch):
    """The module's path as the engine runs it (inference mode, fp32 parameters): its outputs equal those with
    the reference Sinkhorn in its place, bit for bit."""
    from mlaserve.config.deepseek_v4_parts import V4HyperConnections
    from mlaserve.models.deepseek_v4 import hyper

    torch.manual_seed(0)
    m = HyperConnection(32, V4HyperConnections(hc_mult=4, sinkhorn_iters=20, eps=1e-6), 1e-6)
    with torch.no_grad():
        m.fn.normal_(0, 0.5)
        m.base.normal_()
    h = torch.randn(5, 4, 32)
    with torch.inference_mode():
        got = m(h)
        monkeypatch.setattr(hyper, "sinkhorn", sinkhorn_reference)
        want = m(h)
    for a, b in zip(got, want):
        assert torch.equal(a, b)

"""The native mHC mixing (csrc/hyper.c mls_hc_pre: HyperConnection's mixing weights and sublayer input in one call)
against the torch path computed in float64, at stream counts 1-4 and 7, hidden sizes that are and are not
multiples of the vector width, one token (decode) and enough tokens to share out over threads, Sinkhorn passes 1
and 20, random weights, biases and scales (the softmax rows and the Sinkhorn sums far from uniform).

Bound: post, comb and the sublayer input within 1e-6 x max(1, the largest |value|) of float64 (values up to ~7: the
sigmoid's 2x, the streams' weighted sum of N unit-variance rows); measured: 2.5e-6 at a largest value of 6.5 (3.9e-7
relative; N = 4, D = 1024: the mixing weights are dot products of 4096 values, summed in other lanes than BLAS's),
the fp32 torch path 7.6e-7. A defect moves them by 1e-3 .. 1 (a Sinkhorn pass in the wrong order, a bias on the
wrong weight, the norm's eps left out).
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.config.deepseek_v4_parts import V4HyperConnections
from mlaserve.kernels import native
from mlaserve.models.deepseek_v4.hyper import HyperConnection

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
BOUND = 1e-6  # times max(1, the largest |value| of the output)


def _module(n: int, d: int, iters: int, seed: int) -> HyperConnection:
    hc = HyperConnection(d, V4HyperConnections(n, iters, 1e-6), 1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * (n * d) ** -0.5 * 3)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(1 + 0.3 * torch.randn(3, generator=g))
    return hc


def _float64(hc: HyperConnection, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch path in float64 (its Sinkhorn then the plain reference: numpy's is for fp32)."""
    ref = _module(hc.n, hc.fn.shape[1] // hc.n, hc.iters, 0).double()
    ref.load_state_dict(hc.state_dict())
    return ref._mix_torch(h.double())


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,d", [(1, 16), (2, 37), (3, 64), (4, 1024), (7, 48)])
@pytest.mark.parametrize("s", [1, 19])
@pytest.mark.parametrize("iters", [1, 20])
def test_native_mixing_equals_float64(threads, n, d, s, iters):
    hc = _module(n, d, iters, seed=n * 100 + d + iters)
    h = torch.randn(s, n, d, generator=torch.Generator().manual_seed(s))
    want = _float64(hc, h)
    hc.kernel = "native"
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = hc.mix(h)
    finally:
        torch.set_num_threads(prev)
    for name, a, b in zip(("post", "comb", "x"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        err = (a.double() - b).abs().max().item()
        assert err <= BOUND * max(1.0, b.abs().max().item()), (name, err)
    # the plan's binding: forward calls what `kernel` bound
    assert hc.mix.__func__.__name__ == "_mix_native"


@needs_native
def test_more_streams_than_the_c_call_takes_stay_on_torch():
    hc = _module(17, 8, 2, seed=1)
    assert hc.native_unfit() == "17 streams (the C call takes up to 16)"


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,d", [(1, 16), (4, 1024), (7, 48)])
@pytest.mark.parametrize("s", [1, 19])
def test_native_new_streams_equal_float64(threads, n, d, s):
    """expand's native form (csrc/hyper.c mls_hc_post): post_k y + sum_j comb[j, k] h_j within fp32's bound of
    float64, (n + 2) u (|post y| + sum_j |comb h_j|) a value (n + 1 roundings of the sum, one of the product); the
    fp32 torch form within the same. A defect (comb not transposed, post on the wrong stream) moves it by ~1."""
    g = torch.Generator().manual_seed(n * 10 + s)
    post, comb = torch.rand(s, n, generator=g) * 2, torch.rand(s, n, n, generator=g)
    y, h = torch.randn(s, d, generator=g), torch.randn(s, n, d, generator=g)
    hc = _module(n, d, 1, seed=1)
    want = hc._expand_torch(*(t.double() for t in (post, comb, y, h)))
    mag = post.double()[..., None] * y.double()[:, None].abs() + comb.double().transpose(-1, -2) @ h.double().abs()
    bound = (n + 2) * 2.0**-24 * mag
    hc.kernel = "native"
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = hc.expand(post, comb, y, h)
    finally:
        torch.set_num_threads(prev)
    assert hc.expand.__name__ == "_expand_native"
    assert ((got.double() - want).abs() <= bound).all()
    assert ((hc._expand_torch(post, comb, y, h).double() - want).abs() <= bound).all()

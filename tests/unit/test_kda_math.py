"""KDA's math (models/kda): the chunked form and the batched decode step against the plain token-by-token
reference, the reference against transformers' own functions, and the short conv's state across chunks.

Inputs: 5 heads of width 16 (not powers of two), per-channel log decays -a softplus(N(0,1)) with a per head in
[0.05, 1] (some channels keep the state across a 64-token chunk, some forget within a few tokens), beta in (0, 1),
a non-zero starting state (a chunk continuing its sequence). Outputs and states are of magnitude ~1.

Bounds (measured on these inputs, lengths 1 .. 197):
- reference == transformers' recurrent_kimi_delta_attention: bit for bit (measured 0: the same ops in the same
  order), so torch.equal.
- chunked (chunks 1, 5, 64, 100) vs reference: measured up to 1.7e-6 (chunk 64), 2.4e-7 (chunks 1, 5); transformers'
  chunk_kimi_delta_attention is 1.7e-6 from the same reference on the same inputs, so this is the chunked form's
  fp32 rounding (sums over up to 64 decayed products), not ours. Bound 5e-6, 3x the largest; a wrong decay, a lost
  state across a chunk edge or a missing (I + L)^-1 moves them by 1e-2 .. 1.
- batched step vs reference: the same per-token arithmetic over a batch dimension, measured <= 2.4e-7; bound 1e-6.
- the conv: in pieces through its state vs one pass vs transformers' zero-padded conv1d vs the batched step: the
  same K products summed in other orders (measured 1.5e-8, 6e-8, 3.6e-7 on values of magnitude ~1); bound 1e-6.
  The state itself is the last K - 1 inputs, copied: torch.equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.models.kda import conv, recurrence

H, D = 5, 16
LENGTHS = (1, 5, 63, 64, 65, 128, 129, 197)


def _inputs(n: int, seed: int, batch: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, *batch, n, H, D, generator=g).unbind(0)
    a = torch.empty(H, 1).uniform_(0.05, 1.0, generator=g)
    gate = -a * F.softplus(torch.randn(*batch, n, H, D, generator=g))
    beta = torch.rand(*batch, n, H, generator=g)
    s0 = torch.randn(*batch, H, D, D, generator=g) * 0.5
    return q, k, v, gate, beta, s0


def _err(a: tuple, b: tuple) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("chunk", [1, 5, 64, 100])
def test_chunked_equals_the_recurrent_reference(n, chunk):
    q, k, v, g, beta, s0 = _inputs(n, seed=n)
    q, k = recurrence.prepare(q, k)
    ref = recurrence.recurrent_reference(q, k, v, g, beta, s0)
    got = recurrence.chunked(q, k, v, g, beta, s0, chunk)
    assert _err(got, ref) <= 5e-6, f"n={n} chunk={chunk}: {_err(got, ref):.3g}"


@pytest.mark.parametrize("n", [1, 65, 197])
def test_the_reference_is_transformers_recurrence_and_chunk_form(n):
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, s0 = _inputs(n, seed=100 + n)
    qp, kp = recurrence.prepare(q, k)
    ref = recurrence.recurrent_reference(qp, kp, v, g, beta, s0)
    args = (q[None], k[None], v[None], g[None], beta[None])
    kw = dict(initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = kl.recurrent_kimi_delta_attention(*args, **kw)
    assert torch.equal(o[0], ref[0]) and torch.equal(s[0], ref[1])
    o, s = kl.chunk_kimi_delta_attention(*args, **kw)  # its chunk form, 64, zero-padded: ours without padding
    assert _err((o[0], s[0]), recurrence.chunked(qp, kp, v, g, beta, s0)) <= 5e-6


def test_the_batched_step_equals_the_reference_per_sequence():
    """Four sequences, each with its own state, advanced 9 tokens by the one-token batched step == each through the
    reference alone."""
    b, n = 4, 9
    q, k, v, g, beta, s0 = _inputs(n, seed=7, batch=(b,))
    q, k = recurrence.prepare(q, k)
    state, outs = s0.clone(), []
    for t in range(n):
        o, state = recurrence.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    got = torch.stack(outs, dim=1)
    for i in range(b):
        ref = recurrence.recurrent_reference(q[i], k[i], v[i], g[i], beta[i], s0[i])
        assert _err((got[i], state[i]), ref) <= 1e-6, f"sequence {i}"


@pytest.mark.parametrize("cuts", [(1, 2, 3), (2, 9), (5,), (1, 13)])
def test_the_conv_continues_a_sequence_through_its_state(cuts):
    """A 17-token sequence convolved in pieces (pieces shorter than K - 1 included) == in one pass; the state after
    it is its last K - 1 inputs; one token at a time through the batched step == the one pass too."""
    g = torch.Generator().manual_seed(3)
    c, kw, n = 12, 4, 17
    x, w = torch.randn(n, c, generator=g), torch.randn(c, kw, generator=g) * 0.5
    zero = torch.zeros(kw - 1, c)
    whole, last = conv.prefill(x, zero, w)
    assert torch.equal(last, x[-(kw - 1) :])
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=kw - 1, groups=c)[0, :, :n].t())  # transformers' form
    assert (whole - ref).abs().max() <= 1e-6
    state, pieces, bounds = zero, [], (0, *cuts, n)
    for lo, hi in zip(bounds, bounds[1:]):
        y, state = conv.prefill(x[lo:hi], state, w)
        pieces.append(y)
    assert (torch.cat(pieces) - whole).abs().max() <= 1e-6 and torch.equal(state, last)
    states, steps = zero[None].repeat(2, 1, 1), []
    for t in range(n):  # two sequences at once: the same tokens, so both rows must agree with the one pass
        y, states = conv.step(x[t][None].repeat(2, 1), states, w)
        steps.append(y)
    got = torch.stack(steps, dim=1)
    assert (got - whole).abs().max() <= 1e-6 and torch.equal(states[0], last)


@pytest.mark.parametrize("strength", [30.0, 200.0])
def test_strong_decay_neither_overflows_nor_loses_the_state(strength):
    """Log decays of -30 .. -200 per token and channel (a cumulative sum of ~-12800 over a 64-token chunk): the
    chunked form's factors exp(G_i - G_e), exp(G_e - G_j) stay <= 1 (pair_scores), so nothing overflows, and the
    result is the reference's: the state forgets all but the last token."""
    q, k, v, g, beta, s0 = _inputs(130, seed=11)
    q, k = recurrence.prepare(q, k)
    g = g * strength
    ref = recurrence.recurrent_reference(q, k, v, g, beta, s0)
    got = recurrence.chunked(q, k, v, g, beta, s0)
    assert all(torch.isfinite(t).all() for t in got)
    assert _err(got, ref) <= 5e-6

"""The native attention with sinks (csrc/attention.c mls_sink_mqa, DeepSeek-V4's padded softmax: one shared K=V
row per key, a per-head sink logit in the softmax's sum) against a float64 softmax over [logits | sink] with the
sink column dropped, at head counts that exercise the register blocks and their remainders (1, 5, 8, 16, 20),
widths 64 and 512 (V4's head), one or two threads (by heads and, with one query, by tiles), key counts past one
tile of rows, masked keys, a query with no allowed key (zeros: all weight on its sink), sinks far above and far
below the logits. The queries come as a step's rows read and written where they lie (q_index: the rows in a
shuffled order, pad slots -1 with a random mask, which must be neither read nor written). Then the module:
V4Attention's native and torch forms of the padded call and of the step's call.

Bound: the fp32 result within 2e-6 of the float64 one (outputs are averages of O(1) rows; measured <= 6e-7). A
defect moves them by 1e-2 .. 1 (the sink left out of the sum, a head's sink taken for another's, a masked key read).
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import native, native_v4
from mlaserve.models.deepseek_v4.step_keys import StepQueries

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
BOUND = 2e-6


def reference(q, keys, mask, sinks, scale):
    """q [B, S, H, D], keys [B, K, D], mask [B, S, K], sinks [H] -> [B, S, H, D] in float64."""
    s = torch.einsum("bshd,bkd->bshk", q.double(), keys.double()) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    sink = sinks.double().view(1, 1, -1, 1).expand(*s.shape[:3], 1)
    p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bshk,bkd->bshd", p, keys.double())


def _case(b, s, h, d, k, seed, sink_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g)
    keys = torch.randn(b, k, d, generator=g)
    mask = torch.rand(b, s, k, generator=g) < 0.6
    sinks = torch.randn(h, generator=g) + sink_shift
    return q, keys, mask, sinks


def _step_layout(qp, seed):
    """The padded queries qp [B, S, H, D] as a step's rows: every slot but the last of sequence 0 (when S > 1) is
    a row, in a shuffled order -> (q [T, H, D], q_index [B, S] with -1 on the pad slot, the real slots' mask)."""
    b, s = qp.shape[:2]
    real = torch.ones(b, s, dtype=torch.bool)
    if s > 1:
        real[0, -1] = False
    t = int(real.sum())
    index = torch.full((b, s), -1, dtype=torch.int64)
    index[real] = torch.randperm(t, generator=torch.Generator().manual_seed(seed))
    q = torch.empty(t, *qp.shape[2:])
    q[index[real]] = qp[real]
    return q, index, real


def _run(threads, qp, keys, mask, sinks, scale, seed=0):
    """The kernel on qp's step layout -> the padded result [B, S, H, D] (NaN on the pad slot) and q_index."""
    q, index, real = _step_layout(qp, seed)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native_v4.sink_mqa(q, index, keys, mask, sinks, scale)
    finally:
        torch.set_num_threads(prev)
    padded = torch.full_like(qp, float("nan"))
    padded[real] = out[index[real]]
    return padded, real


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h", [1, 5, 8, 16, 20])
@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("b,s,k", [(2, 3, 37), (1, 1, 300), (3, 4, 300)])  # (1, 1): one query, by tiles
def test_native_sink_attention_equals_float64(threads, h, d, b, s, k):
    q, keys, mask, sinks = _case(b, s, h, d, k, seed=h * 1000 + d + k)
    mask[-1, -1] = False  # a query with no allowed key
    if b * s > 1:
        mask[0, 0, :] = False
        mask[0, 0, k - 1] = True  # one allowed key, the last: its row alone against the sink
    scale = d**-0.5
    got, real = _run(threads, q, keys, mask, sinks, scale)
    want = reference(q, keys, mask, sinks, scale)
    assert (got[-1, -1] == 0).all()  # no key: the sink takes all the weight
    err = (got[real].double() - want[real]).abs().max().item()
    assert err <= BOUND, err
    again, _ = _run(3 - threads, q, keys, mask, sinks, scale, seed=1)  # other threads, rows in another order
    assert torch.equal(got[real], again[real])


@needs_native
@pytest.mark.parametrize("shift", [-60.0, 60.0])  # the sink far below (a plain softmax) or far above the logits
def test_sinks_far_from_the_logits(shift):
    q, keys, mask, sinks = _case(2, 3, 8, 64, 50, seed=7, sink_shift=shift)
    got, real = _run(2, q, keys, mask, sinks, 0.125)
    want = reference(q, keys, mask, sinks, 0.125)
    assert (got[real].double() - want[real]).abs().max().item() <= BOUND
    if shift > 0:  # exp(sink - m) ~ e^60: the rows' weights vanish, no inf or NaN on the way
        assert got[real].isfinite().all() and got[real].abs().max().item() < 1e-20


@needs_native
def test_v4_attention_native_and_torch_forms_agree():
    """V4Attention's two bindings (the KernelPlan's choice) of sink_softmax on one padded call and of attend_step on
    the step's rows, in a CSA layer of a model read from transformers' (its sinks random): within the bound, a pad
    query row (no allowed key) zero in both padded forms."""
    pytest.importorskip("transformers")
    from v4_models import build_hf_v4, ours_from_hf

    model = ours_from_hf(build_hf_v4("all_kinds", seed=3))
    attn = next(layer.self_attn for layer in model.model.layers if layer.self_attn.kind == "csa")
    assert attn.sinks.abs().min().item() > 0  # random sinks, not the zeros of a fresh module
    h, d = attn.heads, attn.head_dim
    q, keys, mask, _ = _case(2, 4, h, d, 23, seed=11)
    mask[1, 3] = False  # a pad row
    rows, index, real = _step_layout(q, seed=5)
    seq, slot = real.nonzero(as_tuple=True)
    queries = StepQueries(seq, slot, index[real], torch.where(real, 0, -1), index)
    mask[~real] = False  # the step's masks: a pad slot (position -1) sees no key
    attn.kernel = "torch"
    want, want_step = attn.sink_softmax(q, keys, mask), attn.attend_step(rows, keys, mask, queries)
    attn.kernel = "native"
    got, got_step = attn.sink_softmax(q, keys, mask), attn.attend_step(rows, keys, mask, queries)
    assert (got - want).abs().max().item() <= BOUND
    assert (got[1, 3] == 0).all() and (want[1, 3] == 0).all()
    assert (got_step - want_step).abs().max().item() <= BOUND
    assert (got_step[index[real]] - want[real]).abs().max().item() <= BOUND


def _as_parts(keys: torch.Tensor, seed: int) -> native_v4.KeyParts:
    """keys [B, K, D] scattered over three matrices (rows shuffled, extra rows no key names) -> KeyParts naming
    each key where it now lies."""
    b, k, d = keys.shape
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, 3, (b * k,), generator=g)
    parts, direct = [], torch.empty(b * k, 2, dtype=torch.int64)
    for p in range(3):
        mine = (owner == p).nonzero().flatten()
        rows = torch.randn(mine.numel() + 5, d, generator=g)  # 5 rows no key names
        at = torch.randperm(rows.shape[0], generator=g)[: mine.numel()]
        rows[at] = keys.reshape(-1, d)[mine]
        parts.append(rows)
        direct[mine, 0], direct[mine, 1] = p, at
    return native_v4.KeyParts(tuple(parts), direct.view(b, k, 2))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b,s,k", [(2, 3, 37), (1, 1, 300)])
def test_keys_read_where_they_lie_give_the_gathered_keys_result_bit_for_bit(threads, b, s, k):
    """mls_sink_mqa_parts (DeepSeek-V4's keys named by (part, row), LayerKeys.direct) against mls_sink_mqa over the
    same keys gathered into [B, K, D]: the same rows in the same order, so the same bits; a pair outside the parts
    is refused, nothing read."""
    qp, keys, mask, sinks = _case(b, s, 8, 64, k, seed=k + s)
    q, index, _ = _step_layout(qp, seed=2)
    parts = _as_parts(keys, seed=k)
    assert torch.equal(parts.gather(), keys)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = native_v4.sink_mqa(q, index, keys, mask, sinks, 0.125)
        got = native_v4.sink_mqa_parts(q, index, parts, mask, sinks, 0.125)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(got, want)
    for bad, what in (((3, 0), "part"), ((0, 10**6), "row"), ((0, -1), "row")):
        direct = parts.direct.clone()
        direct[0, 0] = torch.tensor(bad)
        with pytest.raises(RuntimeError, match=f"a {what} outside"):
            native_v4.sink_mqa_parts(q, index, native_v4.KeyParts(parts.parts, direct), mask, sinks, 0.125)

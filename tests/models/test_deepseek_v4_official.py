"""DeepSeek-V4 with DeepSeek's own inference code's numerics (config/v4_numerics.py) against an independent
computation of them: transformers' DeepseekV4ForCausalLM with the official roundings attached by hooks, each
re-derived in plain torch in tests/official_v4.py (FP8 by float8_e4m3fn casts with float64 power-of-two scales,
the Hadamard matrix by Sylvester's construction, FP4 by the nearest value of the e2m1 table).

Bound: 1e-5 max abs on logits of magnitude ~4 (fp32), the bound of every V4 test against transformers.
Measured here: 0 .. 2.2e-6, the same fp32 rounding as without the options (tests/models/test_deepseek_v4.py:
0.7e-6 .. 3e-6): the roundings themselves agree bit for bit (test_the_row_maps_equal_the_rederived_ones),
so only the surrounding fp32 sums differ. Each option moves the logits away from transformers' by 0.1 .. 1.9
(measured), so a rounding left out, applied to the wrong rows or with the wrong scale fails by orders of
magnitude; test_each_option_changes_the_logits holds that margin (> 1e-2).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from official_v4 import OFFICIAL_SHAPES, fp8_rows, hadamard_fp4, official_hooks, sylvester  # noqa: E402
from v4_models import SPECS, build_hf_v4, hf_v4_logits, ours_from_hf  # noqa: E402

from mlaserve.config.model_parts import ConfigError  # noqa: E402
from mlaserve.config.v4_numerics import V4Numerics  # noqa: E402
from mlaserve.models.deepseek_v4.official import FP8KVRows, HadamardFP4Rows, fp4_round, hadamard  # noqa: E402

BOUND = 1e-5
OPTIONS = {
    "fp8_kv": (True, False, V4Numerics("fp8_ue8m0", "exact")),
    "hadamard_fp4": (False, True, V4Numerics("none", "hadamard_fp4")),
    "both": (True, True, V4Numerics("fp8_ue8m0", "hadamard_fp4")),
}


@pytest.fixture(scope="module", params=list(SPECS))
def pair(request):
    hf = build_hf_v4(request.param, seed=1, **OFFICIAL_SHAPES)
    return request.param, hf, ours_from_hf(hf)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _official(hf, ids: list[int], kv: bool, indexer: bool) -> torch.Tensor:
    handles = official_hooks(hf, kv, indexer)
    try:
        return hf_v4_logits(hf, ids)
    finally:
        for h in handles:
            h.remove()


def _ours(model, ids: list[int], numerics: V4Numerics, chunk: int, calls: dict | None = None) -> torch.Tensor:
    """Logits of every position, fed in chunks; calls: filled with every FP8 row map's calls (_spy)."""
    model.set_numerics(numerics)
    if calls is not None:
        calls.update(_spy(model))
    try:
        state, out = model.new_state(len(ids)), []
        with torch.no_grad():
            for i in range(0, len(ids), chunk):
                out.append(model(torch.tensor(ids[i : i + chunk]), state))
        return torch.cat(out)
    finally:
        model.set_numerics(V4Numerics())


def test_the_row_maps_equal_the_rederived_ones():
    """The maps themselves, bit for bit, on rows spanning many magnitudes (scales from 2^-20 to 2^6), with ties of
    the e2m1 grid and exact powers of two among the block maxima."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 136, generator=g) * torch.logspace(-6, 2, 64)[:, None]
    rows[0, :128] = 0  # an all-zero row: the amax floor
    rows[-1, 5] = 448.0 * 2  # a block maximum at an exact power of two times 448 (its neighbours ~100)
    # a pow2 scale moves normal codes' rounding not at all; it shows where values fall subnormal (< 2^-6 s)
    rows[-1, 6] = 0.05
    assert torch.equal(FP8KVRows(128, 8)(rows), fp8_rows(rows, 128))
    assert torch.equal(FP8KVRows(128, 8)(rows)[:, 128:], rows[:, 128:])  # the rope part untouched
    q = torch.randn(40, 3, 64, generator=g) * torch.logspace(-4, 2, 40)[:, None, None]
    assert torch.allclose(hadamard(q), (q.double() @ sylvester(64) / 8).float(), rtol=0, atol=1e-5 * 100)
    assert torch.equal(HadamardFP4Rows()(q), hadamard_fp4(q))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0] + [0.0] * 21 + [6.0])
    assert fp4_round(ties).tolist()[:10] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 6.0]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_logits_equal_the_independent_official_computation(pair, option):
    """One pass == transformers with the official roundings, at every position of a prompt with CSA rows past
    index_topk."""
    kind, hf, ours = pair
    kv, indexer, numerics = OPTIONS[option]
    ids = _ids(41, hf.config.vocab_size, 0)
    ref = _official(hf, ids, kv, indexer)
    got = _ours(ours, ids, numerics, len(ids))
    err = (got - ref).abs().max().item()
    assert err <= BOUND, f"{kind} {option}: max abs {err:.3g} > {BOUND}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{kind} {option}: top-1 differs"


def _spy(model) -> dict[str, list]:
    """Every FP8 row map's (input, output) per call, by module name (a layer's window rows, its compressor's)."""
    calls: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8KVRows):
            calls[name] = []
            m.register_forward_hook(lambda m, args, out, name=name: calls[name].append((args[0], out)))
    return calls


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 3, 4, 7])  # 1: token by token
def test_chunked_continues_the_rounded_state(pair, option, chunk):
    """Chunks of 1, 3, 4, 7 (windows closed across chunk edges, carries continued) == transformers with the
    official roundings, at every position. Why not always within BOUND: a rounding to FP8 is discontinuous, and a
    chunked prefill computes a row's pre-rounding values in another grouping (GEMMs over other row counts, a window
    pooled across chunks) than one pass, so fp32 noise of ~1e-7 can move a value across a rounding midpoint: one
    value then moves by one e4m3 step (at most 1/8 of its magnitude) and the logits by more than fp32 rounding
    (measured: all_kinds, chunks of 3: 12 values' codes apart out of ~10^4, logits 2.7e-5 apart). So the test
    checks the cause, not a looser bound: every rounded row is compared with one pass's; where no code differs, the
    logits are held to BOUND; where some do, each differing value's input is within fp32 noise of one pass's
    (1e-5 of its row's largest value) and its output one e4m3 step or less away (<= 1/8 of its magnitude, or the
    subnormal step), and top-1 is equal."""
    kind, hf, ours = pair
    kv, indexer, numerics = OPTIONS[option]
    ids = _ids(41, hf.config.vocab_size, 0)
    ref = _official(hf, ids, kv, indexer)
    one_calls, calls = {}, {}
    one = _ours(ours, ids, numerics, len(ids), one_calls)
    got = _ours(ours, ids, numerics, chunk, calls)
    flips = 0
    for name, pairs in calls.items():
        if not one_calls[name]:
            assert not pairs, f"{name}: rows rounded chunked, none in one pass"
            continue
        x, y = (torch.cat([c[i].reshape(-1, c[i].shape[-1]) for c in pairs]) for i in (0, 1))
        x1, y1 = (torch.cat([c[i].reshape(-1, c[i].shape[-1]) for c in one_calls[name]]) for i in (0, 1))
        assert x.shape == x1.shape, f"{name}: {x.shape[0]} rows rounded chunked, {x1.shape[0]} in one pass"
        moved = y != y1
        flips += int(moved.sum())
        if moved.any():  # noise relative to the row's largest value (its RMS norm's scale), as fp32 rounding is
            amax = x1.abs().amax(-1, keepdim=True).expand_as(x1)
            assert ((x - x1).abs() <= 1e-5 * amax).all(), f"{name}: inputs differ beyond fp32 noise"
            # one e4m3 step: 1/8 of a normal code's magnitude, or the subnormal step s 2^-9 <= 2 amax / 448 2^-9
            step = y1.abs() / 8 + 1e-5 * amax
            assert ((y - y1).abs()[moved] <= step[moved]).all(), f"{name}: a value moved more than one step"
    err = (got - ref).abs().max().item()
    if flips == 0:
        assert err <= BOUND, f"{kind} {option} chunk {chunk}: max abs {err:.3g} > {BOUND}, no code apart"
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{kind} {option} chunk {chunk}: top-1 differs"
    assert (one - ref).abs().max() <= BOUND


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_changes_the_logits(pair, option):
    """The option is not a no-op on these weights: its logits stand far from transformers' (and from ours
    without it), so the equality above is a test of the roundings, not of the identity."""
    kind, hf, ours = pair
    _, _, numerics = OPTIONS[option]
    ids = _ids(41, hf.config.vocab_size, 0)
    plain = hf_v4_logits(hf, ids)
    assert (_ours(ours, ids, V4Numerics(), len(ids)) - plain).abs().max() <= BOUND
    moved = (_ours(ours, ids, numerics, len(ids)) - plain).abs().max().item()
    assert moved > 1e-2, f"{kind} {option}: the option moved the logits by {moved:.3g} only"


def test_shapes_the_roundings_cannot_take_are_refused():
    hf = build_hf_v4("all_kinds", seed=1)  # head_dim 24 - rope 8 = 16 non-rope values, index_head_dim 16
    ours = ours_from_hf(hf)
    with pytest.raises(ConfigError, match="16 non-rope values .* blocks of 64"):
        ours.set_numerics(V4Numerics("fp8_ue8m0", "exact"))
    with pytest.raises(ConfigError, match="index_head_dim=16"):
        ours.set_numerics(V4Numerics("none", "hadamard_fp4"))

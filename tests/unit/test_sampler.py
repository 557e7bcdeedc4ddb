"""Tests for mlaserve.sampling.params and mlaserve.sampling.sampler (CPU, a few seconds)."""

import math
from collections import Counter

import pytest
import torch

from mlaserve.engine.greedy_pick import argmax_finite
from mlaserve.sampling.params import SamplingParams
from mlaserve.sampling.sampler import (
    SamplingBatch,
    _apply_penalties,
    gather_logprobs,
    make_generator,
    plain_greedy,
    sample,
)


def build(params, V, prompt_ids=None, output_ids=None, generators=None, **kw):
    B = len(params)
    return SamplingBatch.build(
        params,
        prompt_ids if prompt_ids is not None else [[] for _ in range(B)],
        output_ids if output_ids is not None else [[] for _ in range(B)],
        generators if generators is not None else [None] * B,
        V,
        **kw,
    )


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
        (dict(temperature=float("nan")), "temperature must be finite, got nan"),
        (dict(top_k=-2), "top_k must be -1, 0 (off) or >= 1, got -2"),
        (dict(top_k=2.5), "top_k must be an int, got 2.5"),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0, got 0"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
        (dict(n=0), "n must be >= 1, got 0"),
        (dict(n=True), "n must be an int, got True"),
        (dict(seed=1.5), "seed must be an int, got 1.5"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens must be <= max_tokens (10), got 20"),
        (dict(stop=[""]), "stop must contain only non-empty strings, got ['']"),
        (dict(stop=5), "stop must be a str, a list of str or None, got 5"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must contain only non-negative ints, got [-1]"),
        (dict(logprobs=-1), "logprobs must be >= 0, got -1"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0, got -1"),
        (dict(ignore_eos="yes"), "ignore_eos must be a bool, got 'yes'"),
        (dict(temperature="hot"), "temperature must be a number, got 'hot'"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert p.logprobs is None and p.skip_special_tokens and not p.greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert g.greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    hash(SamplingParams(stop=["x"]))  # frozen and hashable
    with pytest.raises(AttributeError):
        p.temperature = 0.5
    assert SamplingParams(stop_token_ids=[7]).all_stop_token_ids(2) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids(2) == {7}


# --------------------------------------------------------------------------- greedy


def test_greedy_rows_equal_argmax_in_mixed_batch():
    torch.manual_seed(0)
    B, V = 12, 1000
    logits = torch.randn(B, V) * 3
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # tie: argmax picks the first
    params = [
        SamplingParams(temperature=0.0)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i)
        for i in range(B)
    ]
    params[3] = SamplingParams(temperature=0.0)
    gens = [make_generator(i) for i in range(B)]
    before = logits.clone()
    out = sample(logits, build(params, V, generators=gens))
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])
    assert out.token_ids[3] == 5
    assert torch.equal(logits, before)  # input untouched

    all_greedy = [SamplingParams(temperature=0.0)] * B
    assert torch.equal(sample(logits, build(all_greedy, V)).token_ids, logits.argmax(-1))
    assert sample(logits, build(all_greedy, V)).logprobs is None


# --------------------------------------------------------------------------- seeds


def _run_seeded(target, position, others, steps, target_logits, other_seed):
    """Decode `steps` tokens for `target` placed at row `position` among `others`.

    The target row sees the same logits every run; the other rows get fresh random
    logits (from `other_seed`), their own params and fresh generators.
    """
    V = target_logits.shape[1]
    rng = torch.Generator().manual_seed(other_seed)
    params = list(others)
    params.insert(position, target)
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    outputs = [[] for _ in params]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=rng) * 2
        logits[position] = target_logits[step]
        batch = build(params, V, prompt_ids=[[1, 2, 3]] * len(params), output_ids=outputs, generators=gens)
        ids = sample(logits, batch).token_ids.tolist()
        for row, t in enumerate(ids):
            outputs[row] = outputs[row] + [t]
        tokens.append(ids[position])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=1234),  # no filter: goes through "off" stages in mixed batches
        SamplingParams(
            seed=1234, temperature=0.7, top_k=30, top_p=0.9, min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.3
        ),
    ],
    ids=["plain", "filtered"],
)
def test_seeded_request_is_reproducible_across_batches(target):
    torch.manual_seed(1)
    steps, V = 12, 64
    target_logits = torch.randn(steps, V)  # flat enough that tokens vary
    others_a = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(seed=7, top_p=0.5),
        SamplingParams(presence_penalty=1.0, min_p=0.2),
    ]
    others_b = [SamplingParams(seed=99, temperature=1.5), SamplingParams(repetition_penalty=2.0)]

    alone = _run_seeded(target, 0, [], steps, target_logits, other_seed=0)
    assert len(set(alone)) > 3
    assert _run_seeded(target, 3, others_a, steps, target_logits, other_seed=1) == alone
    assert _run_seeded(target, 0, others_a, steps, target_logits, other_seed=2) == alone
    assert _run_seeded(target, 2, others_b, steps, target_logits, other_seed=3) == alone
    torch.manual_seed(12345)  # the global RNG (unseeded rows) must not matter either
    assert _run_seeded(target, 1, others_b, steps, target_logits, other_seed=4) == alone

    other_seed = SamplingParams(**{**target.__dict__, "seed": 4321})
    assert _run_seeded(other_seed, 0, [], steps, target_logits, other_seed=0) != alone


def test_unseeded_rows_follow_global_rng():
    V = 32
    logits = torch.randn(8, V)
    batch = build([SamplingParams()] * 8, V)
    torch.manual_seed(5)
    a = sample(logits, batch).token_ids
    torch.manual_seed(5)
    b = sample(logits, batch).token_ids
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- filters (statistical)

# A fixed distribution with clear gaps, permuted so that token order != probability order.
_PROBS = [0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.05, 0.03, 0.02, 0.01]
_PERM = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]  # token id of the i-th entry of _PROBS


def _reference_distribution(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward per-token reference: dict token -> probability after the filters."""
    logit = {tok: math.log(p) / temperature for tok, p in zip(_PERM, _PROBS)}
    z = sum(math.exp(v) for v in logit.values())
    probs = {t: math.exp(v) / z for t, v in logit.items()}
    ranked = sorted(probs, key=probs.get, reverse=True)
    if top_k:
        ranked = ranked[:top_k]
    mass = sum(probs[t] for t in ranked)
    probs = {t: probs[t] / mass for t in ranked}
    if top_p < 1.0:
        kept, acc = [], 0.0
        for t in ranked:
            kept.append(t)
            acc += probs[t]
            if acc >= top_p:
                break
        mass = sum(probs[t] for t in kept)
        probs = {t: probs[t] / mass for t in kept}
    if min_p > 0:
        top = max(probs.values())
        kept = [t for t in probs if probs[t] >= min_p * top]
        mass = sum(probs[t] for t in kept)
        probs = {t: probs[t] / mass for t in kept}
    return probs


_FILTER_CASES = [
    dict(temperature=0.5),
    dict(top_k=3),
    dict(top_p=0.6),  # mass 0.30, 0.50, 0.65 -> 3 tokens
    dict(min_p=0.3),  # p >= 0.09 -> 4 tokens
    dict(temperature=1.5, top_k=6, top_p=0.8, min_p=0.2),
    dict(top_k=1),
]


def test_filters_support_and_frequencies():
    torch.manual_seed(2024)
    V, draws = len(_PROBS), 3000
    row_logits = torch.full((V,), float("-inf"))
    row_logits[_PERM] = torch.tensor(_PROBS).log()
    row_logits += 1.7  # logits are only defined up to a constant
    # All cases in one batch: per-row parameters in one set of tensor ops.
    params = [SamplingParams(**case) for case in _FILTER_CASES for _ in range(draws)]
    tokens = sample(row_logits.expand(len(params), V).contiguous(), build(params, V)).token_ids

    for i, case in enumerate(_FILTER_CASES):
        expected = _reference_distribution(**case)
        counts = Counter(tokens[i * draws : (i + 1) * draws].tolist())
        assert set(counts) <= set(expected), (case, counts, expected)  # never an excluded token
        # Pearson chi-square over the allowed tokens; df <= 9, and 40 is far beyond the
        # 1e-5 quantile (~37 for df=9); the draw is seeded, so the test is deterministic.
        chi2 = sum((counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in expected.items())
        assert chi2 < 40, (case, chi2, counts, expected)


def test_top_p_always_keeps_one_token():
    V = 5
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0]]).expand(200, V).contiguous()
    out = sample(logits, build([SamplingParams(top_p=0.01)] * 200, V))
    assert (out.token_ids == 0).all()


# --------------------------------------------------------------------------- penalties


def _reference_penalties(logits, prompt, output, rep, pres, freq):
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, c in Counter(output).items():
        out[t] -= freq * c + pres
    return out


def test_penalties_match_reference():
    torch.manual_seed(3)
    V = 40
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, temperature=0.0),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=1.3, presence_penalty=-1.0, frequency_penalty=0.8),
    ]
    B = len(params)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (0, 5, 9, 3, 7, 12)]
    outputs = [torch.randint(0, V, (n,)).tolist() for n in (4, 0, 6, 8, 5, 10)]
    logits = torch.randn(B, V) * 2
    got = _apply_penalties(logits, build(params, V, prompts, outputs))
    for row, p in enumerate(params):
        want = _reference_penalties(
            logits[row].tolist(),
            prompts[row],
            outputs[row],
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        assert torch.allclose(got[row], torch.tensor(want), atol=1e-5), row
    assert torch.equal(got[0], logits[0])  # no penalty: bit-exact

    # Greedy rows take the argmax of the penalised logits; logprobs stay raw.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=5.0, frequency_penalty=2.0, logprobs=2)] * B
    batch = build(greedy, V, prompts, outputs)
    out = sample(logits, batch)
    assert torch.equal(out.token_ids, _apply_penalties(logits, batch).argmax(-1))
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.token_ids[:, None])[:, 0])


def test_min_tokens_masks_eos_and_stop_ids():
    V, eos = 10, 2
    logits = torch.zeros(4, V)
    logits[:, eos] = 100.0
    logits[:, 7] = 50.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),  # too short: both masked
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),  # eos allowed
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),  # long enough
        SamplingParams(min_tokens=5),  # random row: eos never drawn
    ]
    outputs = [[1], [1], [1, 1], [1]]
    out = sample(logits, build(params, V, output_ids=outputs, eos_token_id=eos))
    assert out.token_ids[0] not in (eos, 7)
    assert out.token_ids[1] == eos
    assert out.token_ids[2] == eos
    assert out.token_ids[3] != eos


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(4)
    V = 100
    params = [
        SamplingParams(),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=3, temperature=0.5, top_k=4),
        SamplingParams(logprobs=5, temperature=0.0, presence_penalty=2.0),
        SamplingParams(logprobs=1, seed=11),
    ]
    logits = torch.randn(len(params), V) * 3
    out = sample(logits, build(params, V, output_ids=[[0, 1]] * 5, generators=[None] * 4 + [make_generator(11)]))
    raw = logits.log_softmax(-1)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (5, 6)  # 1 + max requested
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.token_ids[:, None])[:, 0])
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_values)
    expected_ranks = (raw > raw.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_ranks)

    only_sampled = sample(logits, build(params, V), num_logprobs=0)
    assert only_sampled.logprobs.shape == (5, 1)
    values, ids, ranks = gather_logprobs(raw, torch.tensor([0, 1, 2, 3, 4]), 2)
    assert values.shape == (5, 3) and torch.equal(ids[:, 0], torch.arange(5))


def test_build_rejects_mismatched_lengths_and_sample_checks_shape():
    with pytest.raises(ValueError, match="same length"):
        SamplingBatch.build([SamplingParams()], [[]], [[], []], [None], 10)
    batch = build([SamplingParams()], 10)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(1, 11), batch)


# --------------------------------------------------------------------------- the greedy shortcut


@pytest.mark.parametrize(
    "kwargs, plain",
    [
        (dict(temperature=0), True),
        (dict(temperature=0, top_k=5, top_p=0.5, min_p=0.1), True),  # filters a greedy row never reads
        (dict(temperature=0.7), False),
        (dict(temperature=0, repetition_penalty=1.3), False),
        (dict(temperature=0, presence_penalty=2.0), False),
        (dict(temperature=0, frequency_penalty=2.0), False),
        (dict(temperature=0, logit_bias={3: 5.0}), False),
        (dict(temperature=0, logprobs=2), False),
        (dict(temperature=0, min_tokens=4), False),  # 2 output tokens below: its stop ids are masked
    ],
)
def test_the_greedy_shortcut_takes_exactly_the_rows_whose_token_is_the_raw_argmax(kwargs, plain):
    """plain_greedy rows get the raw argmax (greedy_pick.argmax_finite), which must be sample()'s token; every other
    row may differ from it (a penalty, a bias, a masked stop id, a draw) or asks for more (logprobs), so it must not
    qualify."""
    V = 50
    p = SamplingParams(stop_token_ids=[int(torch.arange(V)[7])], **kwargs)
    assert plain_greedy(p, n_output=2) is plain
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    logits[:, 7] = 10.0  # the stop id, seen, is every row's raw argmax: a penalty or a min_tokens mask moves it
    logits[:, 3] = 9.0  # to token 3, unseen (and logit_bias {3: 5} lifts 3 above it)
    batch = build([p] * 3, V, prompt_ids=[[7]] * 3, output_ids=[[7, 5]] * 3, generators=[make_generator(1)] * 3)
    full = sample(logits, batch).token_ids
    fast = torch.tensor(argmax_finite(logits)[0])
    if plain:
        assert torch.equal(full, fast)
    elif "logprobs" not in kwargs:
        assert not torch.equal(full, fast), "a row the shortcut must refuse samples the raw argmax here"

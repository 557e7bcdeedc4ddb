"""Request fuzzer (hypothesis, derandomized so it is seeded): prompts of every shape and type and
sampling fields of every kind into `generate` and `prompt_logits`. Each call either succeeds or
raises a ValueError; afterwards the engine is idle with every page free and serves a normal
request exactly as before."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlaserve import LLM, SamplingParams

N_EXAMPLES = 120
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROBE = [3, 17, 250, 9, 41]
OUTCOMES: Counter = Counter()

_LLM: dict = {}


def _llm() -> tuple[LLM, list[int]]:
    if not _LLM:
        llm = LLM()
        _LLM["llm"], _LLM["want"] = llm, llm.generate([PROBE], GREEDY)[0].outputs[0].token_ids
    return _LLM["llm"], _LLM["want"]


_weird = st.sampled_from([1.5, 6.0, True, False, "5", None, b"x", [1], math.nan, -(2**70), 2**64])
_token = st.one_of(
    st.integers(-3, 4100),
    st.integers(0, 4095).map(np.int64),
    st.integers(0, 4095).map(np.int32),
    _weird,
)
_prompt = st.one_of(
    st.lists(_token, min_size=0, max_size=12),
    st.lists(st.integers(0, 4095), min_size=0, max_size=12),
    st.integers(505, 514).map(lambda n: [7] * n),  # around max_model_len (512)
    st.text(max_size=20),
    st.sampled_from([None, 5, 3.0]),
)
_field = st.one_of(
    st.integers(0, 3),
    st.floats(0, 1),
    st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([None, True, "1", 2**64, -(2**63) - 1, 10**6, [1], ["x"], ""]),
)
_FIELDS = (
    "n temperature top_p top_k min_p repetition_penalty presence_penalty frequency_penalty seed "
    "max_tokens min_tokens stop stop_token_ids ignore_eos logprobs prompt_logprobs skip_special_tokens"
).split()
_valid = st.fixed_dictionaries(  # in range, so the engine runs them: n, seeds, logprobs, stops, penalties
    {},
    optional=dict(
        n=st.integers(1, 3),
        temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        top_p=st.floats(0.05, 1.0),
        top_k=st.integers(-1, 50),
        min_p=st.floats(0.0, 0.5),
        repetition_penalty=st.floats(0.5, 2.0),
        presence_penalty=st.floats(-2.0, 2.0),
        seed=st.integers(-(2**63), 2**64 - 4),
        min_tokens=st.integers(0, 2),
        stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
        stop_token_ids=st.lists(st.integers(0, 5000), max_size=3),
        ignore_eos=st.booleans(),
        logprobs=st.integers(0, 5),
        prompt_logprobs=st.integers(0, 3),
        skip_special_tokens=st.booleans(),
    ),
)
_params = st.one_of(_valid, st.dictionaries(st.sampled_from(_FIELDS), _field, max_size=3))


def _call(llm: LLM, prompts, kwargs: dict, use_logits: bool) -> str:
    try:
        params = SamplingParams(**{"max_tokens": 4, **kwargs})
    except ValueError:
        return "rejected: SamplingParams"
    if params.max_tokens is None or params.max_tokens > 8:  # keep each example short
        params = SamplingParams(**{**kwargs, "max_tokens": 4, "min_tokens": min(params.min_tokens, 4)})
    try:
        if use_logits:
            logits = llm.prompt_logits(prompts[0] if prompts else prompts)
            assert logits.shape[0] == len(prompts[0]) and bool(logits.isfinite().all())
            return "ok: prompt_logits"
        outs = llm.generate(prompts, params)
    except ValueError:
        return "rejected: call"
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason in ("length", "stop"), c  # "error" would mean the door let it through
    return "ok: generate"


@settings(
    max_examples=N_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(prompts=st.lists(_prompt, min_size=0, max_size=3), kwargs=_params, use_logits=st.booleans())
def test_request_fuzz(prompts, kwargs, use_logits):
    llm, _ = _llm()
    outcome = _call(llm, prompts, kwargs, use_logits)
    OUTCOMES[outcome] += 1
    eng, pool = llm.engine, llm.engine.pool
    assert not eng.has_unfinished() and not eng.requests and not eng._detok
    assert pool.num_free == pool.num_pages and all(r == 0 for r in pool.ref)


@pytest.fixture(scope="module", autouse=True)
def _afterwards():
    yield
    llm, want = _llm()
    assert llm.generate([PROBE], GREEDY)[0].outputs[0].token_ids == want  # still serves correctly
    print(f"\nrequest fuzz, {sum(OUTCOMES.values())} examples (derandomized): {dict(OUTCOMES)}")

"""Nothing silently wrong at run time: requests are checked completely at the door, a failure while
handling one request fails only that request, non-finite logits are caught, preemption does not
duplicate prompt logprobs, and one LLM is safe from several threads. Runs on the embedded model."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from engine_drain import drain

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 17, 250, 9, 41], [100, 7, 7, 300], [12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def alone(llm):
    return [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_idle(llm: LLM) -> None:
    eng, pool = llm.engine, llm.engine.pool
    assert pool.num_free == pool.num_pages and all(r == 0 for r in pool.ref)
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.has_unfinished()
    assert not eng.requests and not eng._detok


# ------------------------------------------------------------------ validation at the door (finding 1, 6)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0, 5, 6.5], "must be an int, got float"),
        ([0, True], "must be an int, got bool"),
        ([0, "5"], "must be an int, got str"),
        ([0, 4096], "outside the vocabulary"),
        ([0, -1], "outside the vocabulary"),
        ([], "empty prompt"),
    ],
)
def test_bad_prompt_rejects_the_call_and_leaves_the_engine_as_it_was(llm, alone, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0], bad], GREEDY)  # the good first prompt must not stay queued
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone


def test_numpy_ids_are_ints(llm, alone):
    assert _tokens(llm.generate([np.array(PROMPTS[0], dtype=np.int64)], GREEDY)) == alone[:1]
    assert _tokens(llm.generate([[np.int32(t) for t in PROMPTS[1]]], GREEDY)) == [alone[1]]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_the_generator_range(seed):
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=seed)
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64 - 2, n=3)  # seed + n - 1 overflows


def test_logprobs_beyond_vocabulary_rejected_at_the_door(llm):
    with pytest.raises(ValueError, match="logprobs must be <= the vocabulary size"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, SamplingParams(logprobs=10**6)])
    _assert_idle(llm)


@pytest.mark.parametrize(
    "bad, match",
    [([], "empty prompt"), ([1, 5000], "outside the vocabulary"), (["a", "b"], "must be an int"), ("abc", "list")],
)
def test_prompt_logits_checks_its_prompt(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.prompt_logits(bad)
    _assert_idle(llm)


def test_one_length_rule_for_generate_and_prompt_logits(llm):
    n = llm.engine.max_model_len
    too_long, longest = [5] * n, [5] * (n - 1)
    for call in (lambda ids: llm.generate([ids], GREEDY), llm.prompt_logits):
        with pytest.raises(ValueError, match=f"does not fit max_model_len {n}"):
            call(too_long)
        _assert_idle(llm)
    assert llm.prompt_logits(longest).shape == (n - 1, llm.config.model.vocab_size)
    out = llm.generate([longest], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    _assert_idle(llm)


def test_context_limit_is_noted_once():
    llm = LLM()
    n = llm.engine.max_model_len
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.generate([[5] * (n - 2), [6] * (n - 2)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    notes = [w for w in caught if "context limit" in str(w.message)]
    assert len(notes) == 1 and f"max_model_len {n}" in str(notes[0].message)


# ------------------------------------------------------------------ failure isolation in a step (finding 1)


def test_output_fault_fails_only_that_request(llm, alone, monkeypatch):
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY, request_id=f"iso-{i}") for i, p in enumerate(PROMPTS)]
    detok = eng._detok[rids[1]]

    def broken(ids):
        raise RuntimeError("injected detokenizer fault")

    monkeypatch.setattr(detok, "add", broken)
    finals = drain(eng)
    bad = finals[rids[1]].outputs[0]
    assert bad.finish_reason == "error" and "injected detokenizer fault" in bad.error and rids[1] in bad.error
    assert [finals[rids[i]].outputs[0].token_ids for i in (0, 2)] == [alone[0], alone[2]]
    assert finals[rids[0]].outputs[0].error is None
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone


def test_forward_fault_fails_the_step_and_the_engine_goes_on(llm, alone, monkeypatch):
    eng, real = llm.engine, llm.runner.execute
    calls = {"n": 0}

    def flaky(chunks, preempted=()):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward fault")
        return real(chunks, preempted)

    monkeypatch.setattr(llm.runner, "execute", flaky)
    rids = [eng.add_request(p, GREEDY, request_id=f"fwd-{i}") for i, p in enumerate(PROMPTS)]
    finals = drain(eng)
    for rid in rids:
        out = finals[rid].outputs[0]
        assert out.finish_reason == "error" and "forward pass failed" in out.error and "injected" in out.error
    _assert_idle(llm)
    monkeypatch.setattr(llm.runner, "execute", real)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone


def test_nonfinite_logits_row_fails_that_request(llm, alone, monkeypatch):
    eng, real = llm.engine, llm.runner.execute
    poisoned = "nan-1"

    def poison(chunks, preempted=()):
        batch, logits = real(chunks, preempted)
        logits = logits.clone()
        for row, (rid, _) in enumerate(batch.logits_owner):
            if rid == poisoned and eng.requests[rid].output_ids:
                logits[row, 7] = float("nan")  # from its second token on
        return batch, logits

    monkeypatch.setattr(llm.runner, "execute", poison)
    rids = [eng.add_request(p, GREEDY, request_id=f"nan-{i}") for i, p in enumerate(PROMPTS)]
    finals = drain(eng)
    bad = finals[poisoned].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == alone[1][:1]
    assert "non-finite logits" in bad.error and poisoned in bad.error and "step" in bad.error
    assert "mlaserve verify --check-tensors" in bad.error
    assert [finals[rids[i]].outputs[0].token_ids for i in (0, 2)] == [alone[0], alone[2]]
    _assert_idle(llm)


# ------------------------------------------------------------------ threads (finding 2)


def test_two_threads_get_their_own_outputs(llm, alone):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            results[k] = [_tokens(llm.generate([PROMPTS[k % 3]], GREEDY))[0] for _ in range(4)]
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    for k in range(3):
        assert results[k] == [alone[k % 3]] * 4
    _assert_idle(llm)


# ------------------------------------------------------------------ preemption and logprobs (finding 3)


def test_prompt_logprobs_not_duplicated_after_preemption(llm):
    prompts = [[(7 * i + j) % 4000 + 5 for j in range(40)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    want = llm.generate(prompts, sp)
    small = LLM(num_pages=8, page_size=16, max_num_batched_tokens=64)  # 3 x 80 tokens need 15 pages
    got = small.generate(prompts, sp)
    assert sum(o.metrics["num_preemptions"] for o in got) > 0
    for w, g, p in zip(want, got, prompts):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(p) and len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        ref = torch.log_softmax(llm.prompt_logits(p), -1)  # independent of the engine's request path
        for pos in range(1, len(p)):
            assert g.prompt_logprobs[pos][p[pos]] == pytest.approx(ref[pos - 1, p[pos]].item(), abs=1e-5)


def test_no_context_note_when_the_whole_context_was_asked_for():
    llm = LLM()
    n = llm.engine.max_model_len
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = llm.generate([[5] * (n - 3)], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 3
    assert not [w for w in caught if "context limit" in str(w.message)]


def test_a_call_interrupted_mid_run_leaves_nothing_queued(llm, alone, monkeypatch):
    real, calls = llm.engine.step, {"n": 0}

    def interrupted():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C in a notebook, between two steps
        return real()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(llm.engine, "step", real)
    _assert_idle(llm)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone


def test_fault_when_finishing_or_aborting_still_frees_the_pages(llm, alone, monkeypatch):
    eng = llm.engine
    rids = [eng.add_request(p, GREEDY, request_id=f"fin-{i}") for i, p in enumerate(PROMPTS)]

    def broken():
        raise RuntimeError("injected finish fault")

    for rid in rids[:2]:
        monkeypatch.setattr(eng._detok[rid], "finish", broken)
    eng.step()
    assert eng.abort(rids[1])
    finals = drain(eng)
    assert (
        finals[rids[0]].outputs[0].finish_reason == "error"
        and "injected finish fault" in finals[rids[0]].outputs[0].error
    )
    assert finals[rids[1]].outputs[0].finish_reason == "abort"
    assert finals[rids[2]].outputs[0].token_ids == alone[2]
    _assert_idle(llm)

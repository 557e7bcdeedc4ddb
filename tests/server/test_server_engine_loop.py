"""The engine loop on its own (no HTTP): concurrent adds batch into shared steps, a rejected add
comes back as the engine's ValueError, and an exception in step() fails only the live requests
while the loop keeps serving."""

from __future__ import annotations

import queue

import pytest

from mlaserve.engine.engine_loop import EngineLoop, StepFailure
from mlaserve.entrypoints.llm import LLM
from mlaserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(trace="memory")


def _collect(q: queue.Queue, n: int) -> dict:
    finals = {}
    while len(finals) < n:
        out = q.get(timeout=60)
        if isinstance(out, StepFailure) or out.finished:
            finals[out.request_id] = out
    return finals


def test_loop_batches_and_equals_generate(llm):
    ids = [llm.encode(t) for t in ("In the beginning", "And God said", "Blessed are")]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    loop = EngineLoop(llm.engine)
    q: queue.Queue = queue.Queue()
    loop.start()
    try:
        futs = [loop.add(p, params, f"r{i}", q.put) for i, p in enumerate(ids)]
        assert [f.result(60) for f in futs] == ["r0", "r1", "r2"]
        finals = _collect(q, 3)
        bad = loop.add([], params, "empty", q.put)
        with pytest.raises(ValueError, match="empty prompt"):
            bad.result(60)
    finally:
        loop.stop()
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    assert max(len(r["requests"]) for r in llm.runner.tracer.records) == 3  # one forward pass for all three
    assert loop.stats.pages_used == 0 and loop.stats.num_live == 0


def _flaky(monkeypatch, obj, name: str):
    """obj.name raises once (an injected fault), then works."""
    real, calls = getattr(obj, name), {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, flaky)


def _run_two(llm, q) -> tuple:
    """One request while the fault strikes, then one after it, through a fresh loop."""
    params = SamplingParams(temperature=0, max_tokens=4)
    loop = EngineLoop(llm.engine)
    loop.start()
    try:
        loop.add(llm.encode("In the beginning"), params, "doomed", q.put).result(60)
        doomed = _collect(q, 1)["doomed"]
        loop.add(llm.encode("In the beginning"), params, "after", q.put).result(60)
        after = _collect(q, 1)["after"]
        assert loop.alive
    finally:
        loop.stop()
    assert after.finished and len(after.outputs[0].token_ids) == 4
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages and not llm.engine.requests
    return doomed, after


def test_forward_failure_is_that_request_error_and_loop_goes_on(llm, monkeypatch):
    _flaky(monkeypatch, llm.runner, "execute")  # the engine isolates it: finish_reason "error"
    doomed, _ = _run_two(llm, queue.Queue())
    assert doomed.outputs[0].finish_reason == "error" and "injected fault" in doomed.outputs[0].error


def test_step_exception_fails_live_requests_and_loop_goes_on(llm, monkeypatch):
    _flaky(monkeypatch, llm.engine, "step")  # step() itself raises: the loop fails its live requests
    doomed, _ = _run_two(llm, queue.Queue())
    assert isinstance(doomed, StepFailure) and "injected fault" in doomed.reason

"""A lifecycle a server can live with: 10,000 short requests with aborts mixed in, through
Engine.add_request / step / abort on a tiny random model. Afterwards the engine's dictionaries, the
scheduler's queues and the page pool are back at their starting sizes; every request got exactly one
final output; every preemption is in the route ledger with its request id and pages freed."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest

from mlaserve import LLM
from mlaserve.embedded.random_model import TINY, write_random_model
from mlaserve.observability.trace import MemoryTracer
from mlaserve.sampling.params import SamplingParams

# The smallest model that still runs every part of a step: one dense layer, two heads, the byte
# tokenizer (vocab 259) so that every request also has a detokenizer.
MICRO = {
    **TINY,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
NUM_REQUESTS = 10_000
# One token per page: every decode needs a new page. Requests come in bursts onto a pool that a
# burst fills; most want 2 tokens, so the decodes of a burst need more pages than its 1-token
# requests give back, and the scheduler preempts (about one request in ten).
PAGE_SIZE, NUM_PAGES, MAX_SEQS, BUDGET = 1, 64, 96, 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("micro")
    write_random_model(folder, MICRO, seed=0)
    llm = LLM(
        str(folder),
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=BUDGET,
        trace=MemoryTracer(maxlen=100_000),
    )
    return llm.engine


def _sizes(engine) -> dict:
    pool = engine.pool
    return {
        "requests": len(engine.requests),
        "detok": len(engine._detok),
        "aborted": len(engine._aborted),
        "waiting": len(engine.scheduler.waiting),
        "running": len(engine.scheduler.running),
        "free_pages": pool.num_free,
        "referenced_pages": sum(r > 0 for r in pool.ref),
    }


@dataclass
class Workload:
    finals: dict = field(default_factory=dict)  # request id -> its final RequestOutput
    wanted: dict = field(default_factory=dict)  # request id -> max_tokens
    aborted: set = field(default_factory=set)
    aborted_while: dict = field(default_factory=lambda: {"waiting": 0, "running": 0})
    peak_detok: int = 0  # the detokenizer dict is in use (the tiny model has a tokenizer)
    seconds: float = 0.0


def _submit_burst(engine, rng: random.Random, w: Workload, live: list[str]) -> None:
    burst = rng.randint(0, 120) if rng.random() < 0.25 else 0
    for _ in range(min(burst, NUM_REQUESTS - len(w.wanted))):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 4))]
        max_tokens = 1 if rng.random() < 0.1 else 2
        params = SamplingParams(temperature=0.8, seed=len(w.wanted), max_tokens=max_tokens, ignore_eos=True)
        live.append(engine.add_request(prompt, params, request_id=f"req-{len(w.wanted)}"))
        w.wanted[live[-1]] = max_tokens
    w.peak_detok = max(w.peak_detok, len(engine._detok))


def _abort_some(engine, rng: random.Random, w: Workload, live: list[str]) -> None:
    for _ in range(rng.randint(0, 3)):  # half of them running requests, the rest any live one
        running = [r.request_id for r in engine.scheduler.running]
        pool = running if running and rng.random() < 0.5 else live
        if pool:
            rid = pool[rng.randrange(len(pool))]
            live.remove(rid)
            status = engine.requests[rid].status.value
            assert engine.abort(rid) and not engine.abort(rid)  # a second abort finds nothing
            w.aborted.add(rid)
            w.aborted_while[status] += 1


def _run(engine, seed: int = 0) -> Workload:
    rng, w, live = random.Random(seed), Workload(), []
    t0 = time.perf_counter()
    while len(w.wanted) < NUM_REQUESTS or engine.has_unfinished():
        _submit_burst(engine, rng, w, live)
        _abort_some(engine, rng, w, live)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in w.finals, f"{out.request_id}: two final outputs"
                w.finals[out.request_id] = out
        live[:] = [rid for rid in live if rid not in w.finals]
    w.seconds = time.perf_counter() - t0
    return w


def test_ten_thousand_short_requests_with_aborts_leave_nothing_behind(engine):
    start = _sizes(engine)
    assert start["free_pages"] == NUM_PAGES and start["referenced_pages"] == 0
    w = _run(engine)
    assert w.peak_detok > 100 and _sizes(engine) == start, (w.peak_detok, _sizes(engine), start)
    assert all(r == 0 for r in engine.pool.ref)
    assert len(w.finals) == NUM_REQUESTS
    reasons = {rid: out.outputs[0].finish_reason for rid, out in w.finals.items()}
    assert {rid for rid, why in reasons.items() if why == "abort"} == w.aborted
    assert min(w.aborted_while.values()) > 50, w.aborted_while  # queued and running requests alike
    for rid, out in w.finals.items():
        n = len(out.outputs[0].token_ids)
        assert n < w.wanted[rid] if rid in w.aborted else (reasons[rid] == "length" and n == w.wanted[rid])
    n_preempted = _check_ledger(engine, w)
    print(f"{NUM_REQUESTS} requests, aborted {w.aborted_while}, {n_preempted} preemptions, ", end="")
    print(f"{engine.runner.step_count} steps in {w.seconds:.1f} s")


def _check_ledger(engine, w: Workload) -> int:
    """Every preemption is in the route ledger, naming the request and the pages it gave back."""
    records = list(engine.runner.tracer.records)
    assert len(records) == engine.runner.step_count  # the ring kept every step
    per_request = {rid: out.metrics["num_preemptions"] for rid, out in w.finals.items()}
    counted: dict[str, int] = {}
    freed = 0
    for rec in records:
        in_batch = {r["id"] for r in rec["requests"]}
        for p in rec["preempted"]:
            assert p["pages_freed"] >= 0, p  # 0 when every page it held is a prefix another request shares
            freed += p["pages_freed"]
            assert p["id"] not in in_batch, p  # a request sent back to the queue is not in that step
            counted[p["id"]] = counted.get(p["id"], 0) + 1
    assert counted == {rid: n for rid, n in per_request.items() if n} and counted
    assert freed >= len(counted)  # most preempted requests give back pages of their own
    return sum(counted.values())

"""The scheduler's bookkeeping on its own: token budget, running requests first, chunked prefill,
max_num_seqs, preemption (newest first, which request, pages freed), finish and abort. Requests are
built directly and "sampled" by appending a token: no model, no tensors."""

from __future__ import annotations

import random

import pytest

from mlaserve.cache.page_pool import PagePool
from mlaserve.engine.request import Request, Status
from mlaserve.engine.scheduler import Preemption, Scheduler
from mlaserve.sampling.params import SamplingParams

PS = 4  # page size


def _req(rid: str, n: int, arrival: float, prompt_logprobs: int | None = None) -> Request:
    ids = [100 + 7 * i + ord(rid[0]) for i in range(n)]  # distinct per request: no accidental prefix hits
    return Request(rid, ids, SamplingParams(prompt_logprobs=prompt_logprobs), arrival=arrival)


def _sched(num_pages=64, budget=64, max_seqs=8, prefix=False) -> Scheduler:
    return Scheduler(PagePool(num_pages, prefix), PS, budget, max_seqs)


def _step(s: Scheduler, log: list | None = None):
    """schedule -> advance -> one sampled token for each request whose prompt is now complete.
    log: gets (request id, start, num_tokens, completes_prompt) per chunk, taken before sampling
    (completes_prompt reads the request's live length, as the engine does before it samples)."""
    plan = s.schedule()
    s.advance(plan)
    done = [c.completes_prompt for c in plan.chunks]
    if log is not None:
        log += [(c.request.request_id, c.start, c.num_tokens, d) for c, d in zip(plan.chunks, done)]
    for c, d in zip(plan.chunks, done):
        if d:
            c.request.output_ids.append(3)
    return plan


def _work(plan) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


@pytest.mark.parametrize(
    "budget,lens,expected,waiting",
    [
        (64, [10, 6, 3], [("a", 0, 10), ("b", 0, 6), ("c", 0, 3)], []),  # all fit
        (16, [10, 10, 3], [("a", 0, 10), ("b", 0, 6)], ["c"]),  # the second is chunked, the third waits
        (10, [10, 5], [("a", 0, 10)], ["b"]),  # budget spent exactly: nothing else admitted
        (4, [10], [("a", 0, 4)], []),  # a long prompt starts with a budget-sized chunk
    ],
)
def test_budget_bounds_the_first_step(budget, lens, expected, waiting):
    s = _sched(budget=budget)
    for i, n in enumerate(lens):
        s.add(_req("abc"[i], n, arrival=i))
    plan = s.schedule()
    assert _work(plan) == expected and not plan.preempted
    assert sum(c.num_tokens for c in plan.chunks) <= budget
    assert [r.request_id for r in s.running] == [rid for rid, _, _ in expected]
    assert [r.request_id for r in s.waiting] == waiting


def test_chunked_prefill_continues_where_it_stopped_and_logits_come_at_the_end():
    s = _sched(budget=8)
    s.add(_req("a", 20, 0))
    log = []
    for _ in range(4):
        _step(s, log)
    # 8 + 8 + 4 prompt tokens, then one decode of the sampled token
    assert log == [("a", 0, 8, False), ("a", 8, 8, False), ("a", 16, 4, True), ("a", 20, 1, True)]
    req = s.running[0]
    assert req.num_computed == 21 and len(req.pages) == -(-21 // PS)


def test_running_requests_go_first_then_waiting_take_the_rest():
    s = _sched(budget=8)
    s.add(_req("a", 3, 0))
    _step(s)  # a prefilled, one token sampled
    s.add(_req("b", 20, 1))
    plan = _step(s)
    assert _work(plan) == [("a", 3, 1), ("b", 0, 7)]  # a's decode first, b gets the remaining 7
    s.add(_req("c", 2, 2))
    plan = _step(s)
    # running in arrival order (a decode, b's next chunk), c waits: the budget is spent
    assert _work(plan) == [("a", 4, 1), ("b", 7, 7)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_decode_steps_are_one_token_each():
    s = _sched()
    for i, n in enumerate([5, 1, 9]):
        s.add(_req("abc"[i], n, i))
    _step(s)
    log = []
    _step(s, log)
    assert log == [("a", 5, 1, True), ("b", 1, 1, True), ("c", 9, 1, True)]


@pytest.mark.parametrize("max_seqs,admitted", [(1, ["a"]), (2, ["a", "b"]), (3, ["a", "b", "c"])])
def test_max_num_seqs_caps_the_running_set(max_seqs, admitted):
    s = _sched(max_seqs=max_seqs)
    for i in range(3):
        s.add(_req("abc"[i], 2, i))
    assert [c.request.request_id for c in _step(s).chunks] == admitted
    # still capped on the next step: the running ones decode, nobody else comes in
    assert [c.request.request_id for c in _step(s).chunks] == admitted
    assert len(s.running) == max_seqs


def test_admission_stops_when_pages_run_out_and_leaves_the_request_whole():
    s = _sched(num_pages=3)
    s.add(_req("a", 8, 0))  # 2 pages
    s.add(_req("b", 8, 1))  # needs 2, 1 left
    s.add(_req("c", 1, 2))  # would fit, but admission is in order
    plan = s.schedule()
    assert _work(plan) == [("a", 0, 8)]
    b = s.waiting[0]
    assert b.request_id == "b" and b.pages == [] and b.num_computed == 0 and b.status is Status.WAITING
    assert s.pool.num_free == 1


def _admit(s: Scheduler, lens: list[int]) -> list[Request]:
    reqs = [_req("abcdefg"[i], n, i) for i, n in enumerate(lens)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    s.advance(plan)
    assert len(plan.chunks) == len(reqs) and not plan.preempted
    return reqs


def test_preemption_takes_the_newest_first_and_reports_pages_freed():
    s = _sched(num_pages=8)
    a, b, c = _admit(s, [4, 8, 12])  # 1 + 2 + 3 pages, 2 free
    a.output_ids.extend([3] * 24)  # a now needs 7 pages: 6 more
    plan = s.schedule()
    assert plan.preempted == (Preemption("c", 3), Preemption("b", 2))  # newest first, until a fits
    assert _work(plan) == [("a", 4, 24)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # back at the front, in arrival order
    for r in (b, c):
        assert r.status is Status.WAITING and r.pages == [] and r.num_computed == 0 and r.num_preemptions == 1
    assert s.running == [a] and len(a.pages) == 7 and s.pool.num_free == 1


def test_preemption_stops_as_soon_as_the_request_fits():
    s = _sched(num_pages=7)
    a, b, c = _admit(s, [4, 4, 4])  # 1 page each, 4 free
    a.output_ids.extend([3] * 20)  # a needs 6 pages: 5 more, 4 free -> only c must go
    plan = s.schedule()
    assert plan.preempted == (Preemption("c", 1),)
    assert [x.request_id for x in s.running] == ["a", "b"]


def test_a_request_with_nothing_newer_to_evict_yields_itself():
    s = _sched(num_pages=5)
    a, b = _admit(s, [8, 8])  # 2 + 2 pages, 1 free
    for r in (a, b):
        r.output_ids.append(3)  # both need a third page
    plan = s.schedule()
    # a (older) takes the free page; b would have to evict a, which is older, so b gives itself up
    assert plan.preempted == (Preemption("b", 2),)
    assert _work(plan) == [("a", 8, 1)]
    assert b.status is Status.WAITING and s.waiting[0] is b and s.pool.num_free == 2


def test_no_admission_in_a_step_that_preempted():
    s = _sched(num_pages=5)
    a, b = _admit(s, [8, 8])
    s.add(_req("z", 1, 5))
    for r in (a, b):
        r.output_ids.append(3)
    plan = s.schedule()
    assert plan.preempted and [c.request.request_id for c in plan.chunks] == ["a"]
    assert [r.request_id for r in s.waiting] == ["b", "z"]


def test_a_preempted_request_is_recomputed_from_scratch():
    s = _sched(num_pages=5)
    a, b = _admit(s, [8, 8])
    for r in (a, b):
        r.output_ids.append(3)
    s.advance(s.schedule())  # b preempted; a holds 3 pages
    s.finish(a, "stop")
    plan = s.schedule()
    assert _work(plan) == [("b", 0, 9)]  # prompt and its sampled token, recomputed in one chunk
    assert plan.chunks[0].completes_prompt  # whose last row samples b's next token


@pytest.mark.parametrize("where", ["running", "waiting", "preempted"])
def test_finish_frees_pages_and_leaves_both_queues(where):
    s = _sched(num_pages=5)
    a, b = _admit(s, [8, 4])
    s.add(w := _req("w", 3, 9))
    target = {"running": b, "waiting": w, "preempted": b}[where]
    if where == "preempted":
        a.output_ids.extend([3] * 8)  # a needs both free pages
        b.output_ids.append(3)  # b needs one more: nothing newer to evict, so b yields
        s.advance(s.schedule())
        assert b.status is Status.WAITING and b.pages == []
    s.finish(target, "abort")
    assert target.status is Status.FINISHED and target.finish_reason == "abort" and target.pages == []
    assert target not in s.running and target not in s.waiting
    assert s.pool.num_free == s.pool.num_pages - sum(len(r.pages) for r in (a, b, w))
    assert target.request_id not in [c.request.request_id for c in s.schedule().chunks]


def test_everything_finished_returns_every_page():
    s = _sched(num_pages=6, budget=5)
    reqs = _admit(s, [2, 3])
    s.add(late := _req("z", 9, 5))
    for _ in range(3):
        _step(s)
    for r in [*reqs, late]:
        s.finish(r, "length")
    assert not s.has_work() and s.pool.num_free == 6 and all(r == 0 for r in s.pool.ref)


def test_prefix_cache_hit_starts_after_the_cached_pages():
    s = _sched(prefix=True)
    a = _req("a", 10, 0)
    s.add(a)
    _step(s)  # 10 prompt tokens computed: pages 0 and 1 full and named
    b = Request("b", list(a.prompt_ids[:9]) + [5, 6, 7], SamplingParams(), arrival=1)
    s.add(b)
    plan = s.schedule()
    chunk = next(c for c in plan.chunks if c.request is b)
    assert (chunk.start, chunk.num_tokens) == (8, 4) and b.num_cached_prompt == 8
    assert b.pages[:2] == a.pages[:2] and all(s.pool.ref[p] == 2 for p in a.pages[:2])
    seq = chunk.to_seq_chunk(PS)
    assert seq.context_len == 8 and seq.num_cached == 8 and seq.block_table == tuple(b.pages)


@pytest.mark.parametrize("n", [4, 8])
def test_prefix_cache_leaves_at_least_one_token_to_compute(n):
    s = _sched(prefix=True)
    a = _req("a", n, 0)
    s.add(a)
    _step(s)
    b = Request("b", list(a.prompt_ids), SamplingParams(), arrival=1)
    s.add(b)
    chunk = next(c for c in s.schedule().chunks if c.request is b)
    assert chunk.start == n - PS and chunk.num_tokens == PS  # the last page is recomputed for its logits


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    s = _sched(prefix=True)
    a = _req("a", 9, 0)
    s.add(a)
    _step(s)
    b = Request("b", list(a.prompt_ids), SamplingParams(prompt_logprobs=1), arrival=1)
    s.add(b)
    chunk = next(c for c in s.schedule().chunks if c.request is b)
    assert chunk.start == 0 and b.num_cached_prompt == 0
    seq = chunk.to_seq_chunk(PS)
    assert seq.all_logits and seq.needs_logits


def test_to_seq_chunk_carries_the_pages_up_to_the_chunk_end():
    s = _sched(budget=6)
    a = _req("a", 14, 0)
    s.add(a)
    plan = _step(s)
    seq = plan.chunks[0].to_seq_chunk(PS)
    assert seq.token_ids == tuple(a.prompt_ids[:6]) and seq.context_len == 0
    assert seq.block_table == tuple(a.pages[:2]) and not seq.needs_logits
    plan = _step(s)
    seq = plan.chunks[0].to_seq_chunk(PS)
    assert seq.context_len == 6 and seq.block_table == tuple(a.pages[:3]) and seq.num_cached == 0


def _check_accounting(s: Scheduler, live: list[Request]) -> None:
    """Every page reference belongs to a live request, and every free page is really free."""
    pool, held = s.pool, {}
    for r in live:
        assert len(set(r.pages)) == len(r.pages), f"{r.request_id} holds a page twice"
        for p in r.pages:
            held[p] = held.get(p, 0) + 1
    assert {p: n for p, n in enumerate(pool.ref) if n} == held
    assert pool.num_free == pool.num_pages - len(held)
    for r in s.running:
        assert r.status is Status.RUNNING and len(r.pages) >= -(-r.num_computed // PS)
    for r in s.waiting:
        assert r.status is Status.WAITING and r not in s.running
    assert len(s.running) <= s.max_seqs


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("prefix", [False, True])
def test_random_schedules_keep_the_page_accounting(seed, prefix):
    """Random arrivals (shared prefixes among them), decodes, finishes and aborts on a small pool:
    after every step the pool's reference counts equal the pages the live requests hold."""
    rng = random.Random(seed)
    s = _sched(num_pages=10, budget=10, max_seqs=4, prefix=prefix)
    live, stems, preempted, wants = [], [[9, 8, 7, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8]], 0, {}
    for i in range(300):
        if rng.random() < 0.4 and len(live) < 10:
            tail = [rng.randrange(10, 50) for _ in range(rng.randint(1, 6))]
            r = Request(f"r{i}", rng.choice(stems)[: rng.randint(0, 8)] + tail, SamplingParams(), arrival=float(i))
            s.add(r)
            live.append(r)
            wants[r.request_id] = rng.randint(1, 12)  # output tokens before it finishes
        plan = _step(s)
        preempted += len(plan.preempted)
        assert all(p.pages_freed >= 0 for p in plan.preempted)
        for r in [c.request for c in plan.chunks if len(c.request.output_ids) >= wants[c.request.request_id]]:
            s.finish(r, "length")
            live.remove(r)
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            s.finish(victim, "abort")
        _check_accounting(s, live)
    for r in live:
        s.finish(r, "abort")
    _check_accounting(s, [])
    assert preempted > 0 and not s.has_work()


def test_pages_freed_counts_only_pages_the_preemption_gives_back():
    """A preempted request that shares prefix pages with a running one frees only its own pages."""
    s = _sched(num_pages=5, prefix=True)
    a = _req("a", 8, 0)
    s.add(a)
    _step(s)  # a: pages 0, 1 full and named, its sampled token on page 2
    b = Request("b", list(a.prompt_ids) + [5], SamplingParams(), arrival=1)
    s.add(b)
    _step(s)  # b reuses a's two pages and takes one of its own; 1 page left
    assert b.pages[:2] == a.pages[:2] and len(b.pages) == 3 and s.pool.num_free == 1
    a.output_ids.extend([3] * 8)  # a needs 2 more pages: b (newer) must go
    before = s.pool.num_free
    plan = s.schedule()
    assert [p.request_id for p in plan.preempted] == ["b"]
    freed = s.pool.num_free - before + 2  # a took 2 pages after b left
    assert plan.preempted[0].pages_freed == freed == 1

"""State slots on the scheduling rank: the SlotPool alone, and its lifecycle through the real Scheduler
(admission takes a slot, finish / abort / failure / preemption give it back, exhaustion makes admission
wait, a re-admitted request's first chunk says reset_state). No model, no tensors: requests are
"sampled" by appending a token, as in test_scheduler.py."""

from __future__ import annotations

import pickle

import pytest

from mlaserve.cache.page_pool import PagePool
from mlaserve.cache.slot_pool import SlotPool
from mlaserve.engine.request import Request, Status
from mlaserve.engine.scheduler import Scheduler
from mlaserve.sampling.params import SamplingParams

PS = 4


def _req(rid: str, n: int, arrival: float) -> Request:
    return Request(rid, [10 + 3 * i + len(rid) for i in range(n)], SamplingParams(), arrival=arrival)


def _sched(num_slots: int, num_pages=64, budget=64, max_seqs=8, prefix=False) -> Scheduler:
    return Scheduler(PagePool(num_pages, prefix), PS, budget, max_seqs, SlotPool(num_slots))


def _step(s: Scheduler):
    plan = s.schedule()
    s.advance(plan)
    for c in plan.chunks:
        if c.completes_prompt:
            c.request.output_ids.append(3)
    return plan


def _slots(s: Scheduler) -> dict[str, int]:
    return {r.request_id: r.state_slot for r in s.running}


def test_slot_pool_hands_out_each_slot_once_and_reuses_only_after_free():
    pool = SlotPool(3)
    got = [pool.allocate(rid) for rid in "abc"]
    assert sorted(got) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="request d: no free state slot"):
        pool.allocate("d")
    with pytest.raises(RuntimeError, match="request a: frees state slot 1, which is held by 'b'"):
        pool.free(1, "a")
    pool.free(got[1], "b")
    pool.free(got[0], "a")
    # most recently freed first (its memory is resident); a freed slot is never handed out twice
    assert pool.allocate("e") == got[0] and pool.allocate("f") == got[1]
    with pytest.raises(RuntimeError, match="held by 'e'"):
        pool.free(got[0], "a")  # a double free by the old holder
    with pytest.raises(ValueError, match="at least one slot"):
        SlotPool(0)


def test_admission_takes_a_slot_and_the_first_chunk_resets_it():
    s = _sched(num_slots=4, budget=8)
    s.add(_req("a", 10, 0))
    s.add(_req("b", 3, 1))
    plan = _step(s)
    assert _slots(s) == {"a": 0}  # b waits for budget, not for a slot, and holds none while waiting
    assert s.waiting[0].state_slot is None
    seq = plan.chunks[0].to_seq_chunk(PS)
    assert (seq.state_slot, seq.reset_state) == (0, True)
    plan = _step(s)  # a's second chunk continues its state; b starts (fresh) in the same step
    seqs = {c.request.request_id: c.to_seq_chunk(PS) for c in plan.chunks}
    assert (seqs["a"].state_slot, seqs["a"].reset_state) == (0, False)
    assert (seqs["b"].state_slot, seqs["b"].reset_state) == (1, True)
    # the chunk is plain data: a tensor-parallel worker gets the same slots in the broadcast step
    assert pickle.loads(pickle.dumps(seqs["b"])) == seqs["b"]


def test_exhausted_slots_make_admission_wait_then_proceed():
    # two slots, room for eight requests otherwise: the third waits, never fails
    s = _sched(num_slots=2, max_seqs=8)
    for i, rid in enumerate("abc"):
        s.add(_req(rid, 3, i))
    _step(s)
    assert _slots(s) == {"a": 0, "b": 1} and [r.request_id for r in s.waiting] == ["c"]
    _step(s)
    assert [r.request_id for r in s.waiting] == ["c"]  # still waiting: nothing left the running set
    s.finish(s.running[0], "stop")
    plan = _step(s)
    assert _slots(s) == {"b": 1, "c": 0}  # a's slot, reused only after a gave it back
    c = next(c for c in plan.chunks if c.request.request_id == "c").to_seq_chunk(PS)
    assert c.reset_state and c.context_len == 0


@pytest.mark.parametrize("how", ["stop", "abort", "error"])
def test_every_way_out_frees_the_slot(how):
    s = _sched(num_slots=2)
    s.add(_req("a", 5, 0))
    s.add(_req("b", 5, 1))
    _step(s)
    a = s.running[0]
    s.finish(a, how)
    assert a.state_slot is None and s.slots.num_free == 1 and s.slots.owner == {1: "b"}
    s.finish(s.running[0], how)
    assert s.slots.num_free == 2 and not s.slots.owner


def test_a_waiting_request_finished_before_admission_holds_no_slot():
    s = _sched(num_slots=1)
    s.add(_req("a", 5, 0))
    s.add(_req("b", 5, 1))
    _step(s)
    b = s.waiting[0]
    s.finish(b, "abort")  # aborted while waiting: nothing to free, nothing freed twice
    assert b.state_slot is None and s.slots.owner == {0: "a"}


def test_preemption_frees_the_slot_and_readmission_resets_it():
    # 5 pages of 4 tokens: a (arrived first) and b each need 2 pages for their prompt, then grow by decode
    s = _sched(num_slots=2, num_pages=5, budget=64)
    s.add(_req("a", 7, 0))
    s.add(_req("b", 7, 1))
    _step(s)
    assert _slots(s) == {"a": 0, "b": 1}
    preempted, steps = [], 0
    while not preempted:
        plan = _step(s)
        preempted = [p.request_id for p in plan.preempted]
        steps += 1
        assert steps < 10
    assert preempted == ["b"]  # the newest goes
    b = s.waiting[0]
    assert b.request_id == "b" and b.status is Status.WAITING and b.state_slot is None
    assert s.slots.owner == {0: "a"}
    s.finish(s.running[0], "stop")  # a leaves: b comes back and recomputes from token 0 with a zeroed state
    plan = _step(s)
    seq = plan.chunks[0].to_seq_chunk(PS)
    assert seq.request_id == "b" and seq.context_len == 0 and seq.reset_state
    assert seq.state_slot == b.state_slot == 0  # a's slot, the most recently freed


def test_n_children_are_requests_with_their_own_slots():
    # n > 1 is n requests of one prompt (entrypoints/llm.py): each child keeps its own state
    s = _sched(num_slots=4)
    prompt = [5, 6, 7, 8, 9]
    for j in range(3):
        s.add(Request(f"r-{j}", list(prompt), SamplingParams(seed=j), arrival=j))
    _step(s)
    assert sorted(_slots(s).values()) == [0, 1, 2]


def test_without_a_slot_pool_no_request_gets_a_slot():
    s = Scheduler(PagePool(16), PS, 64, 8)
    s.add(_req("a", 5, 0))
    plan = _step(s)
    seq = plan.chunks[0].to_seq_chunk(PS)
    assert s.slots is None and seq.state_slot is None and not seq.reset_state


def test_the_batch_carries_slots_per_sequence_and_per_token_in_batch_order():
    from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

    prefill = SeqChunk("p", (1, 2, 3), 0, (0,), state_slot=2, reset_state=True)
    decode = SeqChunk("d", (4,), 5, (1, 2), state_slot=0)
    batch = ForwardBatch.build([prefill, decode], PS, 1)  # decodes first
    assert batch.state_slots.tolist() == [0, 2] and batch.token_state_slots.tolist() == [0, 2, 2, 2]
    assert batch.reset_slots == (2,)
    plain = ForwardBatch.build([SeqChunk("a", (1, 2), 0, (0,))], PS, 1)
    assert plain.state_slots is None and plain.token_state_slots is None and plain.reset_slots == ()
    with pytest.raises(ValueError, match="request a: no state slot in a step whose other requests have one"):
        ForwardBatch.build([SeqChunk("a", (1, 2), 0, (0,)), decode], PS, 1)
    with pytest.raises(ValueError, match="requests d and p share state slot 0"):
        ForwardBatch.build([decode, SeqChunk("p", (1, 2), 0, (3,), state_slot=0)], PS, 1)

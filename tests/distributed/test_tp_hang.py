"""Tensor parallelism: a worker that is alive but stuck (here: stopped with SIGSTOP) is named on
rank 0 as hung within seconds, the step's requests fail with that report, and no process is left;
a long step or an idle engine is not taken for a hang; a normal shutdown stops the watchdog."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch.distributed as dist
from conftest import finishes_within
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.distributed import heartbeat
from mlaserve.distributed.group import TensorParallelError
from mlaserve.distributed.heartbeat import Heartbeat, Watchdog
from mlaserve.distributed.spawn import WorkerProcess, live_workers
from mlaserve.sampling.params import SamplingParams

OPTS = dict(page_size=8, max_num_batched_tokens=24)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def _no_children(before: frozenset) -> bool:
    deadline = time.monotonic() + 60  # a bound for a leak, returned from as soon as they are gone
    while set(live_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    return not set(live_workers()) - before


def _step_until_finished(llm: LLM, rid: str, worker: WorkerProcess):
    """Step until rid finishes. A broken watchdog leaves a step waiting on the stopped rank: bounded, the test then
    fails naming the hang, and the worker is killed so that nothing waits on it."""

    def steps():
        while True:
            for out in llm.engine.step():
                if out.request_id == rid and out.finished:
                    return out

    try:
        return finishes_within(120, steps)  # the watchdog names the hang after HANG_TIMEOUT_S (5 s)
    except AssertionError:
        worker.kill()
        raise


def _two_steps_then_stop(llm: LLM) -> tuple[str, WorkerProcess]:
    """A request mid-generation (prefill and one decode step done), then its worker stopped."""
    (worker,) = llm.runner.group.procs
    rid = llm.engine.add_request(random_ids(12), LONG)
    for _ in range(2):
        assert not [o for o in llm.engine.step() if o.finished]
    os.kill(worker.pid, signal.SIGSTOP)
    return rid, worker


def test_heartbeat_beats_through_a_busy_main_thread_and_a_silent_rank_is_named():
    """In one process: rank 1 beats while this (main) thread runs a busy Python loop for at least twice
    the timeout (a long step: not a hang) and until rank 2, which beat once and stopped (a stopped process), is
    reported: never before the timeout."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    beating, silent = Heartbeat(store, 1).start(), Heartbeat(store, 2).start()
    silent.stop()
    hung: dict[int, tuple[str, float]] = {}
    t0 = time.monotonic()
    dog = Watchdog(store, [1, 2], lambda r, rep: hung.setdefault(r, (rep, time.monotonic() - t0)), timeout_s=1.0)
    dog.start()
    n, deadline = 0, t0 + 300  # a bound for a watchdog that never reports
    # holds the GIL but for the interpreter's switch interval
    while (2 not in hung or time.monotonic() - t0 < 2.5) and time.monotonic() < deadline:
        n += 1
    assert list(hung) == [2], hung
    report, after = hung[2]
    assert re.fullmatch(r"hung: no heartbeat for \d+\.\d s", report) and float(report.split()[-2]) >= 1.0
    assert after >= 1.0
    dog.stop()
    beating.stop()
    assert not dog._thread.is_alive() and not beating._thread.is_alive()


def test_stopped_worker_is_named_hung_and_every_process_exits(hf_model_dir, monkeypatch):
    """SIGSTOP a worker mid-generation: the step's request fails naming rank 1 as hung (default
    HANG_TIMEOUT_S, and not before it), the worker is killed (SIGKILL: SIGTERM would wait for SIGCONT), the
    watchdog stops, and later requests fail at once, without a collective."""
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTS)
    group = llm.runner.group
    rid, worker = _two_steps_then_stop(llm)
    t0 = time.monotonic()
    out = _step_until_finished(llm, rid, worker)
    took = time.monotonic() - t0
    assert took > heartbeat.HANG_TIMEOUT_S - 1, took  # the last beat came before SIGSTOP
    assert out.outputs[0].finish_reason == "error"
    assert re.search(
        r"TensorParallelError: tensor-parallel rank 1 hung: no heartbeat for \d+\.\d s \(rank 0 killed it\)",
        out.outputs[0].error,
    ), out.outputs[0].error
    assert _no_children(before)
    assert worker.exitcode == -signal.SIGKILL
    assert not group.watchdog._thread.is_alive()
    steps: list = []
    monkeypatch.setattr(llm.runner, "_execute_all", lambda *a: steps.append(a))
    (again,) = finishes_within(300, llm.generate, [random_ids(12)], SamplingParams(max_tokens=3))
    assert "rank 1 hung" in again.outputs[0].error and steps == []


def test_a_rank_that_is_not_our_child_is_reported_not_killed(hf_model_dir, monkeypatch):
    """As under torchrun (the ranks are the launcher's processes): the step still fails at once
    with the report; the stopped rank is left alone (here the test ends it). The default threshold is
    the previous test's; here a 2 s one (as the idle test's) saves the wait."""
    monkeypatch.setattr(heartbeat, "HANG_TIMEOUT_S", 2.0)
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTS)
    group = llm.runner.group
    rid, worker = _two_steps_then_stop(llm)
    group.procs = []  # the group no longer owns the worker: it cannot kill it
    try:
        out = _step_until_finished(llm, rid, worker)
        assert re.search(r"rank 1 hung: no heartbeat for .* s \(not a process of ours", out.outputs[0].error)
        assert worker.is_alive()  # stopped, not killed
        with pytest.raises(TensorParallelError, match="rank 1 hung"):
            llm.runner.execute([])
    finally:
        worker.kill()
        worker.join()
    assert _no_children(before)


def test_idle_and_normal_shutdown_raise_no_false_alarm(hf_model_dir, monkeypatch):
    """With a 2 s threshold: an engine idle for 3 s and then stepping again is not hung (the
    worker's heartbeat went on: its counter moved), and a normal close stops the watchdog before
    the workers leave (no report, no thread left)."""
    monkeypatch.setattr(heartbeat, "HANG_TIMEOUT_S", 2.0)
    folder, _ = hf_model_dir("v3_odd")
    before = frozenset(live_workers())
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTS)
    group = llm.runner.group
    assert group.watchdog.timeout_s == 2.0
    beats = group.store.add(f"{heartbeat.HEARTBEAT}1", 0)
    (first,) = llm.generate([random_ids(12)], SamplingParams(max_tokens=4, ignore_eos=True))
    time.sleep(3.0)
    (second,) = llm.generate([random_ids(12)], SamplingParams(max_tokens=4, ignore_eos=True))
    assert first.outputs[0].finish_reason == second.outputs[0].finish_reason == "length"
    assert group.store.add(f"{heartbeat.HEARTBEAT}1", 0) - beats >= 4  # 0.5 s beats over > 3 s
    llm.close()
    assert group.hung == {} and group.failure is None
    assert not group.watchdog._thread.is_alive()
    assert _no_children(before)

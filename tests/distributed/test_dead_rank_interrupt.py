"""Rank 0 stops waiting for a collective as soon as a worker of its group is no longer alive, even when gloo's
transfer does not fail (its peer's connection idle: the CI case of a SIGKILLed EP rank that held rank 0 in a
collective for COLLECTIVE_TIMEOUT, 300 s). The peer here is a second gloo rank in a thread that is slow to join
the all-reduce; the group's worker list holds a really killed process."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mlaserve.distributed.collectives import CollectiveAbandoned, Collectives
from mlaserve.distributed.group import TensorParallelGroup


def _sleep() -> None:
    time.sleep(60)


@pytest.fixture
def killed_worker():
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, daemon=True)
    proc.start()
    proc.kill()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    return proc


def test_stop_reason_names_a_dead_worker(killed_worker):
    alive = multiprocessing.get_context("spawn").Process(target=_sleep, daemon=True)
    alive.start()
    try:
        assert TensorParallelGroup(None, None, [alive]).stop_reason() is None
        group = TensorParallelGroup(None, None, [alive, killed_worker])
        assert group.stop_reason() == "tensor-parallel rank 2 died (killed by SIGKILL)"
        group.hung[1] = "hung: no heartbeat for 5.0 s (rank 0 killed it)"  # the watchdog's verdict comes first
        assert group.stop_reason().startswith("tensor-parallel rank 1 hung")
    finally:
        alive.kill()
        alive.join()


def test_a_collective_is_abandoned_within_slices_when_a_worker_is_dead(killed_worker):
    store = dist.HashStore()
    group = TensorParallelGroup(store, None, [killed_worker])
    peer: dict = {}
    ready, release = threading.Event(), threading.Event()

    def rank1() -> None:
        peer["comm"] = Collectives(store, 1, 2)
        ready.set()
        release.wait(60)  # joins the all-reduce only after rank 0 gave up on it, so that it completes
        peer["comm"].all_reduce(torch.ones(4))

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    comm = Collectives(store, 0, 2, group.stop_reason)
    assert ready.wait(60)
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveAbandoned, match=r"rank 1 died \(killed by SIGKILL\)"):
            comm.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5.0  # a few WAIT_SLICEs, not COLLECTIVE_TIMEOUT
    finally:
        release.set()
        t.join(60)
    assert not t.is_alive()

"""Hang detection: a worker that is alive but stuck.

A worker that dies or raises fails rank 0's pending collective at once (its sockets close, its
report is in the store). A worker that is alive but stuck does not: gloo would wait
COLLECTIVE_TIMEOUT (minutes). So every worker runs a daemon Heartbeat thread that bumps a counter
in the rendezvous store every HEARTBEAT_INTERVAL_S, and rank 0 runs a Watchdog thread that calls a
rank hung when its counter has not moved for HANG_TIMEOUT_S. Silence is measured on rank 0's own
clock (the counter changed or not), so machines whose clocks disagree are no problem.

What a heartbeat sees, and what it cannot:
  seen      a stopped process (SIGSTOP, a debugger, swapped out): none of its threads run;
            a deadlock or endless call that holds the GIL (a C extension that never releases
            it): the heartbeat thread never gets the GIL;
            a machine or link that no longer reaches the store (torchrun across machines).
  not seen  a call that releases the GIL and never returns (a kernel, a read or a lock that
            blocks forever), a busy Python loop, a deadlock on Python locks (waiting on one
            releases the GIL): the heartbeat thread keeps beating. These are left to gloo's
            COLLECTIVE_TIMEOUT on rank 0.
A long legitimate step is not a hang for the same reason: the heartbeat thread beats while the
main thread computes (torch kernels release the GIL; Python code yields it every few ms). Only
one call holding the GIL for longer than HANG_TIMEOUT_S would be taken for a hang.

Exit: both threads call the store (C++, the GIL released). A daemon thread still inside such a call when
the interpreter finalizes aborts the process: CPython ends a thread that wants the GIL back then with
pthread_exit, whose unwinding runs into pybind11's GIL guard (a noexcept destructor) -> std::terminate
("terminate called without an active exception", SIGABRT) -- after the rank's work was done. So stop()
joins the thread until it has ended (each store call returns or raises within the store's timeout), and
an atexit hook stops any thread its owner left running (atexit runs before finalization). gloo's own threads
meet the same end through a tensor they release after a collective: collectives.py, Exit.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

HEARTBEAT = "mlaserve/heartbeat/"  # store key of a rank's heartbeat counter

HEARTBEAT_INTERVAL_S = 0.5
# A rank is hung when its heartbeat has not moved for this long: 10 missed beats. Seconds, not a
# beat or two, because on an overloaded machine (2 cores shared by several processes) a thread
# can wait hundreds of ms to be scheduled and one C call may hold the GIL for a while (loading or
# unpickling a large tensor); short enough that a stopped rank is named within seconds (the issue
# asks for < 10 s), not after gloo's COLLECTIVE_TIMEOUT.
HANG_TIMEOUT_S = 5.0
POLL_S = 0.25  # how often the watchdog reads the counters

_started: weakref.WeakSet = weakref.WeakSet()  # every Heartbeat and Watchdog started in this process


def _join(stop: threading.Event, thread: threading.Thread) -> None:
    """Stop a store-calling thread and wait until it has ended (module docstring: Exit). No timeout: a
    store call returns or raises within the store's timeout, and the loop ends at its next check."""
    stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join()


@atexit.register
def stop_all() -> None:
    """Stop every heartbeat and watchdog still running, before the interpreter finalizes (module docstring)."""
    for t in list(_started):
        t.stop()


class Heartbeat:
    """A worker's daemon thread: store.add(HEARTBEAT + rank, 1) every HEARTBEAT_INTERVAL_S. The
    first beat is written before start() returns, so rank 0 sees the rank at once."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.key = store, f"{HEARTBEAT}{rank}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mlaserve-heartbeat-rank{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self.store.add(self.key, 1)
        self._thread.start()
        _started.add(self)
        return self

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 -- the store is gone: rank 0 exited, our collectives fail too
                return

    def stop(self) -> None:
        """Stop beating; returns once the thread has ended (module docstring: Exit)."""
        _join(self._stop, self._thread)


class Watchdog:
    """Rank 0's thread: on_hang(rank, report) once for each rank whose heartbeat has not moved for
    timeout_s (default HANG_TIMEOUT_S, read when the watchdog is made: tests may change it).

    When the watchdog itself did not run for a while (rank 0 stopped or starved), that time is
    not held against the workers: their clocks restart."""

    def __init__(self, store, ranks, on_hang: Callable[[int, str], None], timeout_s: float | None = None) -> None:
        self.store, self.on_hang = store, on_hang
        self.timeout_s = HANG_TIMEOUT_S if timeout_s is None else timeout_s
        self.ranks = list(ranks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlaserve-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        _started.add(self)
        return self

    def stop(self) -> None:
        """Stop watching (the group shuts down); returns once the thread has ended, unless called from it
        (module docstring: Exit)."""
        _join(self._stop, self._thread)

    def _run(self) -> None:
        now = time.monotonic()
        seen = {r: (None, now) for r in self.ranks}  # rank -> (last counter, when it last moved)
        last_poll = now
        while seen and not self._stop.wait(POLL_S):
            now = time.monotonic()
            if now - last_poll > self.timeout_s / 2:  # we were not running: restart every clock
                seen = {r: (beat, now) for r, (beat, _) in seen.items()}
            last_poll = now
            for rank in list(seen):
                try:
                    beat = self.store.add(f"{HEARTBEAT}{rank}", 0)
                except Exception:  # noqa: BLE001 -- the store is closed: the group is shutting down
                    return
                if self._stop.is_set():
                    return
                silent = self._silence(seen, rank, beat, time.monotonic())
                if silent is not None:
                    del seen[rank]
                    self.on_hang(rank, f"hung: no heartbeat for {silent:.1f} s")

    def _silence(self, seen: dict, rank: int, beat: int, now: float) -> float | None:
        """Seconds rank has been silent when that is past the timeout, else None (and the
        counter's last move recorded)."""
        last, since = seen[rank]
        if beat != last:
            seen[rank] = (beat, now)
            return None
        return now - since if now - since > self.timeout_s else None

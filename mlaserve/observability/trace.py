"""The route ledger: one JSON record per step of what ran where, written before the math runs.

Sinks: NullTracer (default), JsonlTracer (a file, one line per step), MemoryTracer (a ring,
for tests and the server). Model and attention code import nothing from here.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path

from mlaserve.attention.plan import StepRoute
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk


def step_record(step: int, batch: ForwardBatch, plan: StepRoute, num_layers: int, preempted: tuple = ()) -> dict:
    """preempted: the scheduler's Preemption records of this step (request id, pages freed)."""
    rec = {
        "step": step,
        "layers": f"0-{num_layers - 1}",
        "num_tokens": batch.num_tokens,
        "num_decode_tokens": batch.num_decode_tokens,
        **plan.to_record(),
    }
    rec["requests"] = [_request_record(s) for s in batch.seqs]
    rec["preempted"] = [{"id": p.request_id, "pages_freed": p.pages_freed} for p in preempted]
    return rec


def _request_record(s: SeqChunk) -> dict:
    out = {"id": s.request_id, "query_len": s.query_len, "context_len": s.context_len, "cached_tokens": s.num_cached}
    if s.state_slot is not None:  # a model with request states: its slot, and whether the runner zeroed it
        out |= {"state_slot": s.state_slot, "state_reset": s.reset_state}
        if s.restore_page is not None:  # a prefix hit: the slot restored from this page's snapshot rows
            out["state_restore_page"] = s.restore_page
    return out


class NullTracer:
    enabled = False

    def record(self, rec: dict) -> None:
        pass

    def close(self) -> None:
        pass


class MemoryTracer:
    """A ring of the last `maxlen` records. Each record written gets a sequence number (0, 1, ...), so a
    reader on another thread (the server's /debug/routes) can ask for what it has not seen yet."""

    enabled = True

    def __init__(self, maxlen: int = 10000) -> None:
        self.records: deque[dict] = deque(maxlen=maxlen)
        self.total = 0  # records ever written: the next record's sequence number
        self._lock = threading.Lock()  # the ring and its count change together (the writer is the engine loop)

    def record(self, rec: dict) -> None:
        with self._lock:
            self.records.append(rec)
            self.total += 1

    def since(self, first: int) -> tuple[list[dict], int]:
        """The records numbered >= first that the ring still holds, and the next number."""
        with self._lock:
            records, total = list(self.records), self.total
        return records[max(0, first - (total - len(records))) :], total

    def close(self) -> None:
        pass


class JsonlTracer:
    enabled = True

    def __init__(self, path: str | Path) -> None:
        self._f = open(path, "a", encoding="utf-8")

    def record(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def make_tracer(trace) -> NullTracer | MemoryTracer | JsonlTracer:
    if trace is None:
        return NullTracer()
    if trace == "memory":
        return MemoryTracer()
    if isinstance(trace, (NullTracer, MemoryTracer, JsonlTracer)):
        return trace
    return JsonlTracer(trace)

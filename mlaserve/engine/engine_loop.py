"""One thread that owns the Engine and steps it while there is work.

Front ends (the HTTP server) never call Engine methods: they post commands (add, abort, call)
to this loop's inbox and receive each request's outputs through the `sink` they gave with it.
Every request that is live at a step goes into that step's one forward pass, so concurrent
clients are batched together. The loop blocks on its inbox while the engine is idle.

Failure isolation: a ValueError from add_request is returned to the caller of add() (a bad
request, the client's fault); an exception raised by step() fails only the requests that were
live in that step (each sink receives a `StepFailure`), and the loop keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from mlaserve.engine.engine import Engine
from mlaserve.engine.request import RequestOutput
from mlaserve.sampling.params import SamplingParams

log = logging.getLogger("mlaserve.engine_loop")

Sink = Callable[[object], None]  # receives RequestOutput or StepFailure, on the loop thread


@dataclass(frozen=True)
class StepFailure:
    """The engine raised while this request was live; the request has been aborted."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, taken on the loop thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    pages_total: int = 0
    pages_free: int = 0
    num_live: int = 0  # requests added and not yet finished (as seen by the loop)
    slots_total: int = 0  # state slots (0: the model keeps no request-addressed state; cache/slot_pool.py)
    slots_free: int = 0

    @property
    def pages_used(self) -> int:
        return self.pages_total - self.pages_free

    @property
    def slots_used(self) -> int:
        return self.slots_total - self.slots_free


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "call" | "stop"
    args: tuple = ()
    future: Future | None = None
    sink: Sink | None = None
    extra: dict = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine: Engine, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._on_output = on_output  # observer of every output (metrics), called on the loop thread
        self.stats = self._snapshot()
        self.error: BaseException | None = None  # set if the loop itself died (health turns red)
        self._thread = threading.Thread(target=self._run, name="mlaserve-engine-loop", daemon=True)

    # ------------------------------------------------------------------ called from any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str, sink: Sink) -> Future:
        """Future -> request_id once the engine accepted it, or the engine's ValueError."""
        fut: Future = Future()
        self._inbox.put(_Command("add", (list(prompt_ids), params, request_id), fut, sink))
        return fut

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Command("abort", (request_id,)))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the loop thread, between steps (e.g. read-only inspection)."""
        fut: Future = Future()
        self._inbox.put(_Command("call", (fn,), fut))
        return fut

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort everything live and end the thread."""
        self._inbox.put(_Command("stop"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._drain(block=not busy):
                    break
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # the loop itself is broken: health reports it
            self.error = e
            log.exception("engine loop died")
            self._fail_all(f"engine loop died: {e!r}")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; blocks for the first one when the engine is idle. False on stop."""
        while True:
            try:
                cmd = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if cmd.kind == "stop":
                for rid in list(self._sinks):
                    self.engine.abort(rid)
                self._deliver(self.engine.step() if self.engine.has_unfinished() else [])
                return False
            self._apply(cmd)

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "add":
            prompt_ids, params, rid = cmd.args
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid)
            except ValueError as e:
                cmd.future.set_exception(e)
                return
            self._sinks[rid] = cmd.sink
            cmd.future.set_result(rid)
        elif cmd.kind == "abort":
            self.engine.abort(cmd.args[0])
        elif cmd.kind == "call":
            try:
                cmd.future.set_result(cmd.args[0](self.engine))
            except Exception as e:
                cmd.future.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the %d live request(s)", len(self._sinks))
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if self._on_output is not None:
                self._on_output(out)
            if sink is not None:
                sink(out)
        self.stats = self._snapshot()

    def _fail_all(self, reason: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be inconsistent after a failed step
                log.exception("abort of %s after a failed step", rid)
            sink(StepFailure(rid, reason))
        try:
            if self.engine.has_unfinished():  # collect the abort outputs so the engine forgets them
                self.engine.step()
        except Exception:
            log.exception("engine could not settle after a failed step")
        self.stats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        e = self.engine
        return EngineStats(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            pages_total=e.pool.num_pages,
            pages_free=e.pool.num_free,
            num_live=len(self._sinks),
            slots_total=e.slots.num_slots if e.slots is not None else 0,
            slots_free=e.slots.num_free if e.slots is not None else 0,
        )

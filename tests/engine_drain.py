"""An Engine stepped by hand until it holds no request: the tests that drive `Engine.step` themselves (to look at
the cache, the slots or the trace between steps) drain it with `drain` and read the final outputs it collects."""

from __future__ import annotations

from collections.abc import Callable

from mlaserve.engine.request import RequestOutput


def drain(engine, after_step: Callable[[], None] | None = None) -> dict[str, RequestOutput]:
    """Step `engine` until nothing is unfinished -> each request's final output by id (an abort's too); one final
    output per request (a second is a failure). `after_step`: called after every step (a test's own checks)."""
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id}: two final outputs"
                finals[out.request_id] = out
        if after_step is not None:
            after_step()
    return finals


def token_ids(finals: dict[str, RequestOutput]) -> dict[str, list[int]]:
    """The generated tokens of each final output (its first completion) by request id."""
    return {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}

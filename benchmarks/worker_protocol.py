"""The worker side of the benchmarks' engine processes: one JSON line in, one JSON line out.

Imports nothing heavy (llamacpp_session.py's process measures llama.cpp's memory and time, so it must not load
torch for this)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def private_stdout():
    """A private copy of stdout for the replies; fd 1 itself goes to stderr, so nothing a library prints can
    garble them."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def error_reply(ex: Exception) -> dict:
    traceback.print_exc()
    return {"ok": False, "error": f"{type(ex).__name__}: {ex}"}


def serve_calls(proto, target, extra: Callable[[], dict] = dict) -> None:
    """Until "quit": each call {"op", "args"} runs target.op(*args); the reply is {"ok", "result"} or the error,
    with extra()'s fields (an engine's memory after the call)."""
    for line in sys.stdin:
        call = json.loads(line)
        if call["op"] == "quit":
            break
        try:
            reply = {"ok": True, "result": getattr(target, call["op"])(*call.get("args", []))}
        except Exception as ex:  # noqa: BLE001 -- the parent reports it and goes on
            reply = error_reply(ex)
        reply.update(extra())
        proto.write(json.dumps(reply, default=str) + "\n")

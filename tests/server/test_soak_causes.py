"""benchmarks/soak.py reports every outcome it did not ask for with its cause, and does not count a stream
that stopped early as a success. Served by an httpx mock (no model): a stream that ends with an error
event (the server's message is the cause), one cut without [DONE], one that finished before max_tokens
although ignore_eos was set, a 5xx, and a client-side timeout; a whole stream is the only 200."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chunk(text: str, finish=None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"


ERROR = {"error": {"message": "the engine failed this request: boom", "code": "engine_error", "type": "server_error"}}
BODIES = {
    "whole": _chunk("a") + _chunk("b", "length") + "data: [DONE]\n\n",
    "error-event": _chunk("a") + "data: " + json.dumps(ERROR) + "\n\n" + "data: [DONE]\n\n",
    "cut": _chunk("a") + _chunk("b"),
    "early-stop": _chunk("a") + _chunk("b", "stop") + "data: [DONE]\n\n",
}


def test_each_unasked_outcome_is_listed_with_its_cause():
    soak = _soak_module()
    plan = iter(["whole", "error-event", "cut", "early-stop", "500", "timeout"])

    def handler(request: httpx.Request) -> httpx.Response:
        what = next(plan)
        if what == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        if what == "500":
            return httpx.Response(
                500, json={"error": {"message": "internal error: KeyError", "code": "internal_error"}}
            )
        return httpx.Response(200, text=BODIES[what], headers={"content-type": "text/event-stream"})

    args = soak.parse_args(["--duration", "1"])
    s = soak.Soak("http://127.0.0.1:1", "m", 100, 64, args)
    http = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1")
    rng = random.Random(0)
    for _ in range(5):
        s._stream(http, rng)
    try:
        s._stream(http, rng)
    except httpx.TransportError as e:  # what client() does with it
        s._error("transport", "stream", f"{type(e).__name__}: {e}", 0.0)
    assert dict(s.statuses) == {"200": 1, "stream-error": 1, "stream-cut": 2, "500": 1, "transport": 1}
    causes = {e["outcome"] + ": " + e["cause"] for e in s.errors}
    assert "stream-error: engine_error: the engine failed this request: boom" in causes
    assert "stream-cut: the stream ended after 2 chunks with finish_reason None, no [DONE]" in causes
    assert "stream-cut: the stream ended after 2 chunks with finish_reason 'stop'" in causes
    assert "500: internal_error: internal error: KeyError" in causes
    assert "transport: ReadTimeout: no answer" in causes
    report = soak.report(s, [], [{"t_s": 1, "pages_in_use": 0, "rss_mib": None}], args)
    assert not report["verdict"]["no_5xx"] and not report["verdict"]["no_transport_errors"]
    assert len(report["errors"]) == 5 and sum(report["error_causes"].values()) == 5

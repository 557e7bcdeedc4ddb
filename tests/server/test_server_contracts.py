"""Server contracts: every outcome reported truthfully, with the status it deserves.

Most tests run the app in this process (tests/inproc_server.py) over one embedded model, so a test
can inject a fault into the engine loop's outputs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from inproc_server import InProcServer

from mlaserve.engine.engine_loop import StepFailure
from mlaserve.entrypoints.llm import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def server(llm):
    srv = InProcServer(llm)
    yield srv
    srv.stop()


def _inject(monkeypatch, server, doomed: dict[str, str]):
    """Engine requests whose id ends with a key of `doomed` fail: "error" = finish_reason error from
    the engine (as a request with non-finite logits gets), "step" = a StepFailure (step() raised)."""
    loop = server.loop
    real_add = loop.add

    def add(prompt, params, rid, sink):
        how = next((v for k, v in doomed.items() if rid.endswith(k)), None)
        if how is None:
            return real_add(prompt, params, rid, sink)

        def failing(out):
            if isinstance(out, StepFailure) or not out.finished:
                return sink(out)
            if how == "step":
                return sink(StepFailure(rid, "injected step fault"))
            bad = replace(out.outputs[0], finish_reason="error", error="non-finite logits (injected)")
            return sink(replace(out, outputs=[bad]))

        return real_add(prompt, params, rid, failing)

    monkeypatch.setattr(loop, "add", add)


BODY = {"model": "tiny", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("how", ["error", "step"])
def test_one_failed_choice_keeps_the_others(server, monkeypatch, how):
    want = server.post("/v1/completions", json=dict(BODY, prompt=["In the beginning", "And God said"])).json()
    _inject(monkeypatch, server, {"-1-0": how})
    r = server.post("/v1/completions", json=dict(BODY, prompt=["In the beginning", "And God said"]))
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert choices[0]["text"] == want["choices"][0]["text"] and choices[0]["finish_reason"] == "length"
    assert "error" not in choices[0]
    assert choices[1]["finish_reason"] == "error"
    assert choices[1]["error"]["type"] == "server_error" and "injected" in choices[1]["error"]["message"]
    # n > 1 on chat: sample 1 of 3 fails
    _inject(monkeypatch, server, {"-0-1": how})
    chat = dict(BODY, messages=[{"role": "user", "content": "Hi"}], n=3)
    r = server.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    reasons = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
    assert reasons == {0: "length", 1: "error", 2: "length"}
    assert server.wait_idle() == 0 and server.serving.in_flight == 0


def test_one_failed_choice_in_a_stream(server, monkeypatch):
    _inject(monkeypatch, server, {"-0-1": "error"})
    r = server.post("/v1/completions", json=dict(BODY, prompt="In the beginning", n=2, stream=True))
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert not any("error" in e for e in events)  # no whole-request error event
    finals = {c["index"]: c for e in events for c in e["choices"] if c["finish_reason"]}
    assert finals[0]["finish_reason"] == "length" and finals[1]["finish_reason"] == "error"
    assert "injected" in finals[1]["error"]["message"]


def test_every_choice_failed_is_a_500(server, monkeypatch):
    _inject(monkeypatch, server, {"-0": "error", "-1": "step"})
    r = server.post("/v1/completions", json=dict(BODY, prompt="In the beginning", n=2))
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    r = server.post("/v1/completions", json=dict(BODY, prompt="In the beginning", n=2, stream=True))
    assert '"server_error"' in r.text and r.text.endswith("data: [DONE]\n\n")
    assert server.wait_idle() == 0 and server.serving.in_flight == 0


def test_a_batch_that_can_never_fit_is_a_400_naming_the_limit(server):
    limit = server.serving.max_in_flight  # max_num_seqs + max_queued
    r = server.post("/v1/completions", json=dict(BODY, prompt=["In the beginning"] * (limit // 16 + 1), n=16))
    assert r.status_code == 400 and str(limit) in r.json()["error"]["message"], r.text
    assert "retry-after" not in r.headers and r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/completions", json=dict(BODY, prompt=[[1, 2, 3]] * (limit + 1)))
    assert r.status_code == 400 and str(limit) in r.json()["error"]["message"], r.text
    assert server.serving.in_flight == 0
    r = server.post("/v1/completions", json=dict(BODY, prompt=["In the beginning"] * (limit // 16), n=16))
    assert r.status_code == 200, r.text  # at the limit: served


def test_no_request_shape_is_a_500(server):
    r = server.post("/tokenize", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert server.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user"}]}).status_code == 400
    assert server.post("/tokenize", json={}).status_code == 400
    assert server.post("/tokenize", json={"prompt": "In the beginning"}).json()["count"] > 0


def test_openapi_states_what_the_server_does(server):
    doc = server.get("/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
    post = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "500", "503"} <= set(post)
    assert "text/event-stream" in post["200"]["content"]
    assert "text/plain" in doc["paths"]["/health"]["get"]["responses"]["200"]["content"]
    assert server.post("/v1/completions", json={}).status_code == 400  # what the document says
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"]["maximum"] == server.serving.llm.config.model.vocab_size - 1


def test_types_are_json_types(server):
    for bad in ({"n": "2"}, {"echo": 0}, {"max_tokens": "4"}, {"n": 1.5}, {"temperature": "0"}):
        r = server.post("/v1/completions", json=dict(BODY, prompt="x") | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), (bad, r.text)
    assert server.post("/v1/completions", json=dict(BODY, prompt="x", n=2.0)).status_code == 200  # 2.0 is 2


def test_undeclared_methods_get_405_with_allow(server):
    r = server.http.request("TRACE", "/version")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_model_retrieve_and_head(server):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(NotFoundError):
        client.models.retrieve("other")
    for path in ("/health", "/metrics"):
        r = server.http.head(path)
        assert r.status_code == 200 and r.content == b"", path


def test_cors_preflight_only_with_allowed_origins(server):
    from fastapi.testclient import TestClient

    from mlaserve.entrypoints.openai.app import build_app

    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    closed = TestClient(build_app(server.serving)).options("/v1/completions", headers=pre)
    assert "access-control-allow-origin" not in closed.headers  # off by default
    app = build_app(server.serving, api_key="k", allowed_origins=["http://ui.example"])
    opened = TestClient(app).options("/v1/completions", headers=pre)  # no key on a preflight
    assert opened.status_code == 200 and opened.headers["access-control-allow-origin"] == "http://ui.example"
    other = TestClient(app).options("/v1/completions", headers=pre | {"Origin": "http://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_debug_endpoints_are_opt_in_and_keyed(server):
    from fastapi.testclient import TestClient

    from mlaserve.entrypoints.openai.app import build_app

    for path in ("/debug/config", "/debug/routes", "/docs", "/redoc"):
        assert server.get(path).status_code == 404, path
    folder = str(server.serving.llm.loaded.path)
    debug = TestClient(build_app(server.serving, debug_endpoints=True))
    shown = debug.get("/debug/config")
    assert shown.status_code == 200 and folder not in shown.text
    assert shown.json()["model"] == server.serving.llm.loaded.path.name
    assert debug.get("/debug/config", params={"paths": "true"}).json()["model"] == folder  # asked for
    assert debug.get("/docs").status_code == 200
    keyed = TestClient(build_app(server.serving, api_key="k", debug_endpoints=True))
    for path in ("/debug/config", "/debug/routes", "/docs", "/openapi.json"):
        assert keyed.get(path).status_code == 401, path
        assert keyed.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path


def _count(server, name: str, **labels) -> float:
    return server.serving.metrics.registry.get_sample_value(name, labels) or 0.0


def test_chunked_body_over_the_limit_is_a_413_counted_and_logged(server, caplog):
    from mlaserve.entrypoints.openai.app import MAX_BODY_BYTES

    before = _count(server, "mlaserve_requests_total", status="413")

    def chunks():
        piece = b"x" * (1 << 20)
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            yield piece

    with caplog.at_level("INFO", logger="mlaserve.server"):
        r = server.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        sized = server.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))
        assert sized.status_code == 413
    assert _count(server, "mlaserve_requests_total", status="413") == before + 2
    assert sum("status=413" in m for m in caplog.messages) == 2


def test_401_counted_and_logged(server, caplog):
    from fastapi.testclient import TestClient

    from mlaserve.entrypoints.openai.app import build_app

    before = _count(server, "mlaserve_requests_total", status="401")
    with caplog.at_level("INFO", logger="mlaserve.server"):
        assert TestClient(build_app(server.serving, api_key="k")).get("/v1/models").status_code == 401
    assert _count(server, "mlaserve_requests_total", status="401") == before + 1
    assert any("status=401" in m and "/v1/models" in m for m in caplog.messages)


def test_a_disconnected_stream_counts_what_it_streamed(server, caplog):
    import logging
    import threading

    import httpx

    before = _count(server, "mlaserve_generation_tokens_total")
    body = dict(BODY, prompt="In the beginning", max_tokens=40, ignore_eos=True, stream=True)
    logged = threading.Event()
    watcher = logging.Handler()
    watcher.emit = lambda record: logged.set() if "status=499" in record.getMessage() else None
    logging.getLogger("mlaserve.server").addHandler(watcher)
    try:
        with caplog.at_level("INFO", logger="mlaserve.server"):
            with (
                httpx.Client(base_url=server.url, timeout=60) as c,
                c.stream("POST", "/v1/completions", json=body) as r,
            ):
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: {")
                    if events == 5:
                        break  # leave mid-stream
            assert logged.wait(30)
    finally:
        logging.getLogger("mlaserve.server").removeHandler(watcher)
    line = next(m for m in caplog.messages if "status=499" in m)
    tokens = int(line.split("output_tokens=")[1].split()[0])
    assert tokens >= 5 and "ttft=-" not in line, line
    assert _count(server, "mlaserve_generation_tokens_total") >= before + 5
    assert server.wait_idle() == 0


def test_shutdown_past_grace_ends_streams_with_an_error_event():
    """SIGTERM with --grace 0 during a long stream: the stream ends with an error event and [DONE],
    the log has no traceback, and the process exits 0."""
    import signal

    from server_process import ServerProcess

    srv = ServerProcess("--grace", "0", "--max-num-seqs", "4")
    body = {"prompt": "In the beginning", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 4}
    lines: list[str] = []
    try:
        with srv.http.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3:
                        srv.proc.send_signal(signal.SIGTERM)
    finally:
        code = srv.stop()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert '"shutting_down"' in lines[-2], lines[-3:]
    logs = srv.logs()
    assert code == 0 and "Traceback" not in logs and "CancelledError" not in logs, logs[-3000:]
    assert "status=503" in logs


def test_usage_reports_cached_prompt_tokens(server):
    prompt = list(range(100, 160))  # 60 tokens: full pages of it are cached after the first request
    first = server.post("/v1/completions", json=dict(BODY, prompt=prompt)).json()["usage"]
    again = server.post("/v1/completions", json=dict(BODY, prompt=prompt)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < 60
    chat = dict(BODY, messages=[{"role": "user", "content": "Hi"}])
    assert "cached_tokens" in server.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens_details"]


def test_echo_text_offsets_index_the_returned_text(server):
    body = dict(BODY, prompt="In the beginning God", echo=True, logprobs=1, max_tokens=3)
    choice = server.post("/v1/completions", json=body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    special = {"<bos>"}  # the embedded model's tokenizer
    assert lp["tokens"][0] in special  # the prompt starts with <bos>, which is not in the text
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        if tok not in special:
            assert text[off : off + len(tok)] == tok, (tok, off, text)
    assert lp["text_offset"][1] == 0


def test_chat_errors_name_messages_and_text_only(server):
    long = [{"role": "user", "content": "word " * 700}]
    r = server.post("/v1/chat/completions", json=dict(BODY, messages=long, max_tokens=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    r = server.post("/v1/chat/completions", json=dict(BODY, messages=parts))
    assert r.status_code == 400 and "this model takes text only" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages"


def test_odd_content_part_types_are_400s(server):
    for kind in ({"x": 1}, [1], None, 3):
        parts = [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]
        r = server.post("/v1/chat/completions", json=dict(BODY, messages=parts))
        assert r.status_code == 400, (kind, r.text)

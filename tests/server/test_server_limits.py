"""Server limits: API key, the bounded queue (429 + Retry-After), SIGTERM during a stream."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

KEY = "s3cret-key"


TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one running request at a time and one queued: the third concurrent request is refused
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess("--api-key", KEY, "--max-num-seqs", "1", "--max-queued", "1", "--chat-template", str(template))
    yield srv
    assert srv.stop() == 0, srv.logs()


def test_api_key(server):
    assert server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
    bad = server.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert server.client(api_key=KEY).models.list().data
    assert server.get("/health").status_code == 200 and server.get("/metrics").status_code == 200
    assert KEY not in server.logs()


def test_chat_template_file_is_used(server):
    from mlaserve.embedded import default_model_path
    from mlaserve.engine.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is the LORD?"}]
    got = server.post("/tokenize", json={"messages": messages}, headers={"Authorization": f"Bearer {KEY}"}).json()
    want = "[system] Be brief.\n[user] Who is the LORD?\n[assistant]"
    assert got["tokens"] == Tokenizer.from_folder(default_model_path()).encode(want)


def _wait_for(server, name: str, value: float, timeout: float = 60.0) -> None:
    """Until the metric reads `value` (the server's own state, not a guess of how long a step takes)."""
    deadline = time.monotonic() + timeout
    while server.metric(name, default=0.0) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value} in {timeout}s"
        time.sleep(0.02)


def test_queue_bound_answers_429_with_retry_after(server):
    """One request running, one queued (seen on /metrics): the next is refused with 429 and Retry-After."""
    statuses: list[int] = []
    body = {"prompt": "In the beginning", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY}"}

    def call(max_tokens):
        statuses.append(
            server.post("/v1/completions", json=dict(body, max_tokens=max_tokens), headers=auth).status_code
        )

    # the first runs long enough to hold the one slot while the second waits and the third is refused; the queued
    # one's own length is not the point (it ran 400 tokens more, alone, after the first)
    threads = [threading.Thread(target=call, args=(n,)) for n in (body["max_tokens"], 8)]
    threads[0].start()
    _wait_for(server, "mlaserve_running_requests", 1)
    threads[1].start()
    _wait_for(server, "mlaserve_queue_depth", 1)
    refused = server.post("/v1/completions", json=dict(body, max_tokens=1), headers=auth)
    assert refused.status_code == 429, (refused.status_code, refused.text)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and statuses == [200, 200], statuses
    assert server.wait_idle() == 0


def test_sigterm_during_a_stream_finishes_it_and_exits_0(server):
    """Last test of the module: it stops the module's server."""
    body = {"model": server.model, "prompt": "And God said", "max_tokens": 30, "temperature": 0, "stream": True}
    chunks: list[str] = []
    auth = {"Authorization": f"Bearer {KEY}"}
    with server.http.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
                if len(chunks) == 2:
                    server.proc.send_signal(signal.SIGTERM)
    assert chunks[-1] == "data: [DONE]" and len(chunks) > 3  # the stream in flight was finished
    assert server.proc.wait(60) == 0, server.logs()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)

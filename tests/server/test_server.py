"""`mlaserve serve` through the official openai client, against a real server process.

References: the offline LLM on the same (embedded) model -- greedy text and token ids, and
log-softmax of LLM.prompt_logits for every logprob the server reports.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch
from server_process import ServerProcess

from mlaserve.entrypoints.llm import LLM
from mlaserve.sampling.params import SamplingParams

PROMPTS = [
    "In the beginning God created",
    "And the earth was without form",
    "Blessed are the meek, for they",
    "The LORD is my shepherd; I shall",
]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0, srv.logs()


@pytest.fixture(scope="module")
def llm():
    return LLM()


def greedy(llm, prompt, max_tokens=12, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0].outputs[0]


def test_models_health_version(server):
    assert server.get("/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    assert server.get("/version").json()["version"]


def test_completion_text_ids_and_batch_equal_offline(server, llm):
    client = server.client()
    ref = greedy(llm, PROMPTS[0])
    out = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    ids = llm.encode(PROMPTS[0])
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref.token_ids)
    batch = client.completions.create(model=server.model, prompt=[PROMPTS[1], ids], max_tokens=12, temperature=0)
    texts = {c.index: c.text for c in batch.choices}
    assert texts == {0: greedy(llm, PROMPTS[1]).text, 1: ref.text}


def test_chat_equals_template_then_offline(server, llm):
    messages = [{"role": "user", "content": "Who made the heaven?"}]
    out = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    prompt = llm.tokenizer.apply_chat_template(messages)  # the tiny model has no template: the fallback
    assert prompt.endswith("assistant:")
    assert out.choices[0].message.content == greedy(llm, prompt, 10).text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streams_reassemble_to_the_whole_text(server):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me of Abraham"}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    whole = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=24, temperature=0)
    parts = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text


def test_logprobs_equal_log_softmax_of_prompt_logits(server, llm):
    out = server.client().completions.create(
        model=server.model, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3
    )
    ids = llm.encode(PROMPTS[3])
    ref = greedy(llm, PROMPTS[3], 6)
    lp = torch.log_softmax(llm.prompt_logits(ids + ref.token_ids[:-1]), -1)[len(ids) - 1 :]
    want = lp.gather(1, torch.tensor(ref.token_ids)[:, None])[:, 0]
    got = torch.tensor(out.choices[0].logprobs.token_logprobs)
    print(f"server vs offline logprobs: {(got - want).abs().max().item():.2e}")
    assert (got - want).abs().max() <= 1e-5  # the same fp32 forward, batched otherwise: rounding
    top = out.choices[0].logprobs.top_logprobs
    assert all(len(t) <= 3 for t in top)
    assert all(max(t.values()) == pytest.approx(lp[i].max().item(), abs=1e-5) for i, t in enumerate(top))


def test_echo_scoring_equals_prompt_logits(server, llm):
    """What lm-eval's local-completions does: echo + max_tokens 0 scores the prompt."""
    ids = llm.encode(PROMPTS[0] + " the heaven and the earth.")
    out = server.client().completions.create(
        model=server.model, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lps = out.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    want = torch.log_softmax(llm.prompt_logits(ids), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    print(f"echo scoring vs offline: {(torch.tensor(lps[1:]) - want).abs().max().item():.2e}")
    assert (torch.tensor(lps[1:]) - want).abs().max() <= 1e-5
    assert out.usage.completion_tokens == 0


def test_n_with_seed_is_reproducible(server):
    client = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seed + j per sample
    ids = server.post("/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    assert a.usage.prompt_tokens == len(ids)  # the prompt counts once for its n samples


def test_stop_string_cuts_the_text(server, llm):
    ref = greedy(llm, PROMPTS[0], 16).text
    stop = ref.split()[2]
    cut = ref[: ref.index(stop)]
    out = server.client().completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"


def test_tokenize_detokenize_debug(server, llm):
    tok = server.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tok["tokens"] == llm.encode(PROMPTS[0])
    assert server.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPTS[0]
    records = server.get("/debug/routes", params={"last": 2}).json()["records"]
    assert len(records) == 2 and records[-1]["segments"]
    table = {row["name"]: row for row in server.get("/debug/config").json()["provenance"]}
    assert table["num_pages"]["value"] == llm.config.cache.num_pages and table["dtype"]["source"]


BAD = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 1_000_000]}, "prompt"),
    ({"prompt": [5] * 600}, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_requests_are_4xx_naming_the_field(server, body, param):
    r = server.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_bad_bodies_and_chat(server):
    assert server.post("/v1/completions", content=b"{not json").status_code == 400
    bad_utf8 = server.post(
        "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert bad_utf8.status_code == 400 and "error" in bad_utf8.json()
    big = server.post("/v1/completions", content=b"x" * (5 * 1024 * 1024))
    assert big.status_code == 413
    r = server.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 999})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert server.get("/health").status_code == 200


def _stream_text(server, prompt: str, max_tokens: int) -> str:
    parts = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in parts)


def test_32_concurrent_streams_equal_each_alone(server):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    client = server.client()
    alone = [
        client.completions.create(model=server.model, prompt=p, max_tokens=10, temperature=0).choices[0].text
        for p in prompts
    ]
    got: dict[int, str] = {}

    def run(i):
        got[i] = _stream_text(server, prompts[i], 10)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert [got.get(i) for i in range(32)] == alone
    steps = server.get("/debug/routes", params={"last": 200}).json()["records"]
    assert max(len(r["requests"]) for r in steps) > 1  # concurrent requests shared forward passes
    assert server.wait_idle() == 0


def test_disconnects_abort_and_free_pages(server):
    """Half the streams hang up after their first chunk; the other half still finish right."""
    prompts = [f"{PROMPTS[i % 4]} again {i}" for i in range(8)]
    done: dict[int, str] = {}

    def hang_up(i):
        body = {"model": server.model, "prompt": prompts[i], "max_tokens": 400, "temperature": 0, "stream": True}
        with server.http.stream("POST", server.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream

    def finish(i):
        done[i] = _stream_text(server, prompts[i], 12)

    threads = [threading.Thread(target=hang_up if i % 2 else finish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and sorted(done) == [0, 2, 4, 6], sorted(done)
    client = server.client()
    for i, text in done.items():
        assert (
            text
            == client.completions.create(model=server.model, prompt=prompts[i], max_tokens=12, temperature=0)
            .choices[0]
            .text
        )
    assert server.wait_idle() == 0
    assert server.metric('mlaserve_requests_total{status="499"}') >= 4  # the hang-ups, counted as such


def _wait_for(check, what: str, timeout: float = 60.0) -> None:
    """Until check() holds: the server's own state, not a guess of how long a step takes."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


def test_non_streaming_client_that_gives_up_aborts(server):
    """The client closes its connection once the server runs its request (480 tokens: far from done)."""
    before = server.metric('mlaserve_requests_total{status="499"}', default=0.0)
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    payload = json.dumps(body).encode()
    url = httpx.URL(server.url)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((url.host, url.port), timeout=60) as sock:
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        _wait_for(lambda: server.metric("mlaserve_running_requests", default=0.0) == 1, "the request running")
    _wait_for(
        lambda: server.metric('mlaserve_requests_total{status="499"}', default=0.0) == before + 1,
        "the abandoned request counted as 499",
    )
    assert server.wait_idle() == 0


def test_metrics_exposition(server):
    before = server.metric("mlaserve_prefix_cache_hit_tokens_total")
    prompt = list(range(10, 50))  # 40 tokens: two full pages of 16 are cached after the first request
    for _ in range(2):
        server.client().completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0)
    assert server.metric("mlaserve_prefix_cache_hit_tokens_total") - before == 32
    text = server.get("/metrics").text
    for name in (
        'mlaserve_requests_total{status="200"}',
        "mlaserve_prompt_tokens_total",
        "mlaserve_generation_tokens_total",
        "mlaserve_time_to_first_token_seconds_bucket",
        "mlaserve_time_per_output_token_seconds_bucket",
        "mlaserve_e2e_request_latency_seconds_bucket",
        "mlaserve_queue_depth",
        "mlaserve_running_requests",
        "mlaserve_kv_pages_in_use",
        "mlaserve_kv_pages_total",
        "mlaserve_prefix_cache_hit_tokens_total",
        "mlaserve_preemptions_total",
        'mlaserve_attention_tokens_total{path="absorbed",phase="decode",sparse="true"}',
    ):
        assert name in text, name
    assert server.metric("mlaserve_kv_pages_total") > 0
    log = server.logs()
    assert "status=200 prompt_tokens=" in log and PROMPTS[0] not in log  # no prompt text in the log
    assert json.dumps(PROMPTS[0]) not in log


def _fuzz_bodies():
    from hypothesis import strategies as st

    junk = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([-1, 0, 10**6, 2**63, -(2**70), 1e308, float("nan"), float("inf")]),
        st.text(max_size=8),
        st.lists(st.integers(-5, 5000), max_size=4),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    small = st.integers(0, 6)

    def field(valid, bad=junk):  # mostly valid values, so that some bodies pass and reach the engine
        return st.integers(0, 4).flatmap(lambda k: bad if k == 0 else valid)

    # no null max_tokens: it means "to the end of the context", which is valid but slow
    bad_max = st.sampled_from([-1, 10**6, 2**63, "x", 1.5, True, [], {}])

    fields = {
        "model": field(st.just("tiny-dsa")),
        "temperature": field(st.floats(0, 2)),
        "top_p": field(st.floats(0.05, 1)),
        "top_k": field(st.integers(-1, 50)),
        "min_p": field(st.floats(0, 1)),
        "presence_penalty": field(st.floats(-2, 2)),
        "repetition_penalty": field(st.floats(0.5, 2)),
        "n": field(st.integers(1, 3)),
        "stop": field(
            st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3))
        ),
        "seed": field(st.integers(-(2**63), 2**63 - 1)),
        "logprobs": field(st.integers(0, 5)),
        "echo": field(st.booleans()),
        "stream": field(st.booleans()),
    }
    prompt = st.one_of(
        st.text(max_size=40),
        st.text(max_size=40),
        st.lists(st.integers(-3, 5000), max_size=12),
        st.lists(st.one_of(st.text(max_size=10), st.lists(st.integers(0, 4200), max_size=5)), max_size=3),
        junk,
    )
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "system", "assistant"])), "content": field(st.text(max_size=20))}
    )
    # max_tokens always set and small: a chat without it would run to the end of the context
    completion = st.fixed_dictionaries({"prompt": prompt, "max_tokens": field(small, bad_max)}, optional=fields)
    chat = st.fixed_dictionaries(
        {"messages": field(st.lists(message, min_size=1, max_size=3)), "max_tokens": field(st.integers(1, 6), bad_max)},
        optional={"top_logprobs": field(small), **fields},
    )
    return st.one_of(
        st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat)
    )


def test_fuzz_request_schema_never_5xx(server):
    """Hypothesis-generated bodies (valid and junk values in every field): never a 5xx."""
    from hypothesis import HealthCheck, given, settings

    seen: list[int] = []

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_fuzz_bodies())
    def run(case):
        path, body = case
        r = server.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        seen.append(r.status_code)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert r.json()["error"]["message"]

    run()
    print("fuzz statuses:", {c: seen.count(c) for c in sorted(set(seen))})
    assert 200 in seen and 400 in seen
    assert server.get("/health").status_code == 200
    assert server.wait_idle() == 0

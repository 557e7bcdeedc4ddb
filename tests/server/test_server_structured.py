"""response_format / structured_outputs / logit_bias / best_of and unknown fields through the official
openai client against a real `mlaserve serve` (the embedded model, which cannot write JSON unaided).
Outputs are checked with jsonschema and re.fullmatch, never against recorded strings."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "kind": {"enum": ["village", "town", "city"]},
        "gates": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "population", "kind", "gates"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Tell me of Jerusalem"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server  # the session's (conftest.py): these tests only send it requests


def _chat(server, **kw):
    kw.setdefault("max_tokens", 100)
    kw.setdefault("messages", MESSAGES)
    return server.client().chat.completions.create(model=server.model, **kw)


def test_json_schema_validates_at_temperature_1_with_seeds_and_n2(server):
    seen = set()
    # the seeds' requests at once (the server batches them: one after the other took four times as long); the
    # same-seed pair below stays one after the other, each alone in its batches
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda seed: _chat(server, response_format=FORMAT, temperature=1.0, seed=seed, n=2), range(4))
        )
    for r in answers:
        assert len(r.choices) == 2
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch.message.content
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
            seen.add(ch.message.content)
    assert len(seen) > 2
    again = _chat(server, response_format=FORMAT, temperature=1.0, seed=0, n=2)
    first = _chat(server, response_format=FORMAT, temperature=1.0, seed=0, n=2)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


def test_json_object_and_streaming(server):
    r = _chat(server, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200)
    content, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert content.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(content), dict)
    stream = _chat(server, response_format=FORMAT, temperature=0.0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = _chat(server, response_format=FORMAT, temperature=0.0)
    assert "".join(parts) == whole.choices[0].message.content
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)


def test_structured_outputs_extra_body_on_both_endpoints(server):
    c = server.client()
    r = _chat(
        server, temperature=1.0, seed=3, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} [0-9]{1,3}"}}
    )
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", r.choices[0].message.content)
    choices = ["Moses", "Aaron", "Miriam"]
    r = c.completions.create(
        model=server.model,
        prompt="And the LORD spake unto",
        max_tokens=10,
        n=3,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(ch.text in choices and ch.finish_reason == "stop" for ch in r.choices)
    r = c.completions.create(
        model=server.model,
        prompt="Numbers:",
        max_tokens=30,
        temperature=0.0,
        extra_body={"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}},
    )
    if r.choices[0].finish_reason == "stop":
        assert all(isinstance(x, int) for x in json.loads(r.choices[0].text))


def test_length_is_reported(server):
    r = _chat(server, response_format=FORMAT, temperature=0.0, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def _bad(server, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, **kw)
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


def test_refusals_name_the_field(server):
    msg = _bad(
        server,
        "response_format",
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    )
    assert "nope" in msg
    _bad(server, "response_format", response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    _bad(server, "response_format", response_format={"type": "xml"})
    _bad(server, "structured_outputs", extra_body={"structured_outputs": {"regex": "a("}})
    _bad(server, "structured_outputs", extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    _bad(server, "structured_outputs", extra_body={"structured_outputs": {"whitespace_pattern": " "}})
    _bad(server, "best_of", extra_body={"best_of": 3})
    _bad(server, "logit_bias", logit_bias={"999999": 5})
    _bad(server, "logit_bias", logit_bias={"5": 500})
    assert "Extra inputs" in _bad(server, "frobnicate", extra_body={"frobnicate": 1})
    # harmless fields the clients send are accepted
    assert _chat(server, max_tokens=2, user="someone", logit_bias={}).choices


def test_logit_bias(server):
    base = _chat(server, temperature=0.0, max_tokens=1, logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    tok = server.post("/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    biased = _chat(server, temperature=0.0, max_tokens=1, logprobs=True, logit_bias={str(tok[0]): -100})
    assert biased.choices[0].logprobs.content[0].token != first


def test_message_fields_read_or_refused(server):
    reply = _chat(server, max_tokens=3, temperature=0.0).choices[0].message
    # a client's own message object sent back as it came (refusal / annotations / audio / function_call null)
    back = [*MESSAGES, reply.model_dump(), {"role": "user", "content": "And then?"}]
    assert _chat(server, messages=back, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, messages=[{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}])
    assert "cache_control" in e.value.body["message"] and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        _chat(server, messages=[{"role": "assistant", "content": "x", "audio": {"id": "a"}}])

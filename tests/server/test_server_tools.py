"""Tool calls through the official openai client against a real server on the embedded model
(DeepSeek-V3.2 layout: the DSML format), which cannot call tools unaided: required / named calls are
generated under the tools' schemas, so their arguments must validate (jsonschema), whatever the seed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
VERSE = {
    "type": "object",
    "properties": {
        "book": {"enum": ["Genesis", "Exodus", "Psalms"]},
        "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
    },
    "required": ["book", "chapter"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_verse", "parameters": VERSE}},
]
SCHEMAS = {"get_weather": WEATHER, "find_verse": VERSE}
MESSAGES = [{"role": "user", "content": "What is the weather in Jerusalem?"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server  # the session's (conftest.py): these tests only send it requests


def _chat(server, **kw):
    kw.setdefault("max_tokens", 440)
    kw.setdefault("parallel_tool_calls", False)  # one call fits the embedded model's 512-token context
    kw.setdefault("messages", MESSAGES)
    return server.client().chat.completions.create(model=server.model, tools=TOOLS, **kw)


def _check_calls(calls, only=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in SCHEMAS and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate_across_seeds_and_n2(server):
    # the seeds' requests at once (the server batches them: one after the other took three times as long)
    with ThreadPoolExecutor(3) as pool:
        answers = list(
            pool.map(lambda seed: _chat(server, tool_choice="required", temperature=1.0, seed=seed, n=2), range(3))
        )
    for r in answers:
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls", ch.message
            _check_calls(ch.message.tool_calls)
            assert not ch.message.content


def test_named_tool_and_parallel(server):
    named = dict(tool_choice={"type": "function", "function": {"name": "find_verse"}}, temperature=1.0, seed=4)
    parallel = dict(tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=9)
    with ThreadPoolExecutor(2) as pool:  # at once: the server batches them (one after the other took twice as long)
        r, second = pool.map(lambda kw: _chat(server, **kw), (named, parallel))
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    _check_calls(ch.message.tool_calls, only="find_verse")
    assert len(ch.message.tool_calls) == 1
    ch = second.choices[0]
    if ch.finish_reason == "tool_calls":  # else a second call ran past the context: "length"
        _check_calls(ch.message.tool_calls)
    else:
        assert ch.finish_reason == "length"


def test_streamed_calls_assemble_to_the_whole_response(server):
    for seed in (1, 2):
        kw = dict(tool_choice="required", temperature=1.0, seed=seed)
        whole = _chat(server, **kw).choices[0]
        calls, content, reason = {}, "", None
        for chunk in _chat(server, stream=True, **kw):
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == whole.finish_reason == "tool_calls"
        assert content == (whole.message.content or "")
        assert [calls[i] for i in sorted(calls)] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
        ]


def test_auto_and_none(server):
    r = _chat(server, tool_choice="auto", temperature=1.0, seed=0, max_tokens=30)
    ch = r.choices[0]
    if ch.message.tool_calls:  # the grammar switched on at the start marker: the call validates
        _check_calls(ch.message.tool_calls)
    else:
        assert ch.finish_reason in ("stop", "length") and "DSML" not in (ch.message.content or "")
    r = _chat(server, tool_choice="none", temperature=0.0, max_tokens=10)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_length_inside_a_call(server):
    """Cut inside the call: no calls, no markup in content, "length"; streamed the same (test_tool_call_cut.py)."""
    for max_tokens in (1, 8, 30):
        ch = _chat(server, tool_choice="required", temperature=0.0, max_tokens=max_tokens).choices[0]
        assert ch.finish_reason == "length" and not ch.message.tool_calls
        assert not ch.message.content, ch.message.content  # required: the output is the call, so nothing before it
        content, reason = "", None
        for chunk in _chat(server, tool_choice="required", temperature=0.0, max_tokens=max_tokens, stream=True):
            for c in chunk.choices:
                assert not c.delta.tool_calls
                content += c.delta.content or ""
                reason = c.finish_reason or reason
        assert reason == "length" and content == ""


def test_transcript_with_calls_and_results(server):
    first = _chat(server, tool_choice="required", temperature=0.0).choices[0].message
    call = first.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 31 degrees"},
    ]
    tokens = server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert call.function.name in text and "sunny, 31 degrees" in text  # rendered, not dropped
    r = _chat(server, messages=messages, tool_choice="none", temperature=0.0, max_tokens=4)
    assert r.usage.prompt_tokens > _chat(server, tool_choice="none", max_tokens=1).usage.prompt_tokens + 10


def _bad(server, param, **kw):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_refusals(server):
    _bad(server, "tool_choice", tool_choice={"type": "function", "function": {"name": "nope"}})
    _bad(server, "tool_choice", tool_choice="sometimes")
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model=server.model, messages=MESSAGES, tools=[{"type": "function", "function": {"name": ""}}]
        )
    _bad(server, "tools", tool_choice="required", response_format={"type": "json_object"})

"""A tool call cut short by max_tokens (finish_reason "length"): the contract, in every format, whole and
streamed. The partial call is not a call (it is not valid: no `tool_calls`) and not content (its markup is
not text for the user): `content` is the text before the call's start marker, and `finish_reason` stays
"length", so a client (an agent SDK) sees that the answer was cut instead of taking markup as the answer.

OpenAI returns a cut call's partial arguments as a tool call with "length"; vLLM and SGLang hand the raw
section back as content when it does not parse. Neither is acceptable here (a call that cannot be valid,
or markup as the answer); the cut output is reported as what it is."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.tools.formats import FORMATS, ToolCall
from mlaserve.tools.request import ToolContext

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
CONTENT = "Let me look."
CALLS = [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}))]


def _text(name: str) -> str:
    return CONTENT + FORMATS[name].render(CALLS)


def _ctx(name: str) -> ToolContext:
    return ToolContext(FORMATS[name], "auto", TOOLS, None)


def _markup_free(content: str | None) -> bool:
    """Content cut anywhere is a prefix of the plain text: no character of a call's markup in it."""
    return CONTENT.startswith(content or "")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_cut_anywhere_is_content_before_the_call(name):
    text = _text(name)
    whole, reason = _ctx(name).message(text, "stop")
    assert reason == "tool_calls" and whole["content"] == CONTENT  # the uncut output, for contrast
    for cut in range(len(text)):  # every point of the output, the section's inside included
        msg, reason = _ctx(name).message(text[:cut], "length")
        assert reason == "length"
        assert "tool_calls" not in msg, (cut, msg)
        assert _markup_free(msg["content"]), (cut, msg["content"])
        if cut >= len(CONTENT) + len(FORMATS[name].START):  # the marker was written: all the plain text is there
            assert msg["content"] == CONTENT


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=20, deadline=None)
@given(cut=st.integers(0, 10_000), splits=st.lists(st.integers(0, 10_000), max_size=8))
def test_cut_streamed_is_the_same_as_whole(name, cut, splits):
    text = _text(name)
    text = text[: cut % len(text)]
    whole, reason = _ctx(name).message(text, "length")
    ctx, content, calls, final = _ctx(name), "", [], None
    points = sorted({s % (len(text) + 1) for s in splits}) + [len(text)]
    for i, p in enumerate(points):
        finished = i == len(points) - 1
        delta, tc, r = ctx.stream(0, text[:p], finished, "length" if finished else None)
        content += delta
        calls += tc or []
        final = r
    assert final == reason == "length" and not calls
    assert content == (whole["content"] or "") and _markup_free(content)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_stop_string_inside_a_call_does_not_leak_it(name):
    text = _text(name)
    msg, reason = _ctx(name).message(text[: len(text) - 3], "stop")
    assert reason == "stop" and "tool_calls" not in msg and msg["content"] == CONTENT

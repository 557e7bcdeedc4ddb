"""Reasoning separation: <think>...</think> -> reasoning_content, the rest -> content, whole and streamed
(hand-written outputs split at every point), and through a real server with a thinking chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

from mlaserve.entrypoints.openai.reasoning import ReasoningSplitter

CASES = [
    # (prompt opened <think>, model output, reasoning, content)
    (True, "Let me think.\nOK.</think>\n\nThe answer is 4.", "Let me think.\nOK.", "\n\nThe answer is 4."),
    (False, "<think>Hmm</think>Four.", "Hmm", "Four."),
    (True, "<think>Hmm</think>Four.", "Hmm", "Four."),
    (False, "Four, no thinking.", None, "Four, no thinking."),
    (True, "still thinking when cut", "still thinking when cut", ""),
    (False, "<", None, "<"),
    (True, "a </thin", "a </thin", ""),
]


@pytest.mark.parametrize("opened,text,reasoning,content", CASES)
def test_split(opened, text, reasoning, content):
    assert ReasoningSplitter(opened).split(text) == (reasoning, content)


@pytest.mark.parametrize("opened,text,reasoning,content", CASES)
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 1000), max_size=10))
def test_stream_split_anywhere(opened, text, reasoning, content, cuts):
    sp = ReasoningSplitter(opened)
    points = sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]
    got_r, got_c = "", ""
    for i, p in enumerate(points):
        r, c = sp.stream(0, text[:p], i == len(points) - 1)
        assert "<think>" not in r and "</think>" not in c
        got_r += r
        assert c.startswith(got_c) or got_c == ""  # content only grows
        got_c = c
    assert got_r == (reasoning or "") and got_c == content


TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if thinking is defined and not thinking %}<think></think>"
    "{% else %}<think>{% endif %}{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    path.write_text(TEMPLATE)
    srv = ServerProcess("--chat-template", str(path))
    yield srv
    assert srv.stop() == 0, srv.logs()


def _chat(server, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "How many?"}])
    return server.client().chat.completions.create(model=server.model, **kw)


def test_server_separates_reasoning(server):
    r = _chat(server, max_tokens=20, temperature=0.0)
    msg = r.choices[0].message
    assert msg.reasoning_content and "<think>" not in msg.reasoning_content
    assert not msg.content and r.choices[0].finish_reason == "length"  # never closed its thinking
    chunks = list(_chat(server, max_tokens=20, temperature=0.0, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == msg.reasoning_content
    off = _chat(server, max_tokens=20, temperature=0.0, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None


def test_grammar_waits_for_the_reasoning(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    off = _chat(
        server,
        max_tokens=30,
        temperature=1.0,
        seed=0,
        response_format=fmt,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    jsonschema.validate(json.loads(off.choices[0].message.content), SCHEMA)
    on = _chat(server, max_tokens=12, temperature=1.0, seed=0, response_format=fmt)
    msg = on.choices[0].message
    # the reasoning is free text (not JSON), which a grammar applied from the first token would forbid
    assert msg.reasoning_content and on.choices[0].finish_reason == "length"
    assert not msg.reasoning_content.lstrip().startswith("{")

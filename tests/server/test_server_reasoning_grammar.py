"""Through the server and the openai client: a thinking template that leaves `<think>` to the model (as
Kimi-K2-Thinking's and DeepSeek-R1's do) lets the model reason before a forced tool call or a json_schema
answer (the grammar starts where the reasoning ends); the reasoning goes to reasoning_content and never
into content or a call; with thinking off (the prompt closes the block) the grammar holds from the first
token, as before. The embedded model writes `<think>` only when pushed: logit_bias on the byte-level tokens
'<', 'th', 'ink', '>', '/' makes opening the block likely (a grammar from the first token forbids it: the
test fails there), not closing it, so these answers are cut in their reasoning; the walks of
tests/identities/test_reasoning_grammar.py hold reasoning-then-call to the parsers for every format."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest
from inproc_server import InProcServer

# writes </think> (the reasoning parser is "think"), opens nothing: the model may write <think> itself;
# thinking false closes the block in the prompt
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
    "{% if thinking is defined and not thinking %}<think></think>{% endif %}{% endif %}"
)
THINK_TOKENS = {"30": 8, "259": 8, "2106": 8, "32": 8, "17": 8}  # '<' 'th' 'ink' '>' '/' (embedded vocabulary)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
FMT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
OFF = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    from mlaserve import LLM

    srv = InProcServer(LLM(), chat_template=TEMPLATE)
    yield srv
    srv.stop()


def _chat(server, **kw):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    kw.setdefault("messages", [{"role": "user", "content": "Weather?"}])
    return client.chat.completions.create(model=server.model, temperature=1.0, **kw)


def _no_markers(*texts):
    for t in texts:
        assert "<think>" not in (t or "") and "</think>" not in (t or ""), t


def test_tool_call_may_follow_reasoning(server, caplog):
    reasoned = 0
    with caplog.at_level(logging.INFO, logger="mlaserve.server"):
        for seed in range(4):
            r = _chat(server, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=40, logit_bias=THINK_TOKENS)
            ch = r.choices[0]
            reasoning = getattr(ch.message, "reasoning_content", None)
            _no_markers(reasoning, ch.message.content)
            if ch.message.tool_calls:  # the call is whole: its arguments validate, the reasoning is not in them
                assert ch.finish_reason == "tool_calls"
                for c in ch.message.tool_calls:
                    jsonschema.validate(json.loads(c.function.arguments), WEATHER)
                    assert not reasoning or reasoning not in c.function.arguments
            else:
                assert ch.finish_reason == "length" and not ch.message.content  # cut: no markup as content
            reasoned += bool(reasoning)
    assert reasoned >= 2, "the model could not open its reasoning before the call"
    assert "grammar after reasoning: optional (the prompt leaves <think> to the model)" in caplog.text


def test_json_may_follow_reasoning_and_streams_the_same(server):
    kw = dict(response_format=FMT, seed=1, max_tokens=24, logit_bias=THINK_TOKENS)
    whole = _chat(server, **kw).choices[0]
    assert whole.message.reasoning_content and whole.finish_reason == "length"
    assert not whole.message.content  # cut inside the reasoning: nothing claimed valid, nothing leaked
    chunks = list(_chat(server, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)


def test_thinking_off_is_unchanged(server):
    """The prompt closes the block: the grammar holds from the first token (the biased think tokens cannot open
    a block), the answer validates and there is no reasoning_content."""
    for seed in range(2):
        r = _chat(server, response_format=FMT, seed=seed, max_tokens=30, logit_bias=THINK_TOKENS, extra_body=OFF)
        ch = r.choices[0]
        assert getattr(ch.message, "reasoning_content", None) is None and ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)

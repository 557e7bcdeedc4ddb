"""Every tool-call format, end to end through its grammar: the structural tag that `tool_choice` required /
named builds for the format (xgrammar's, per family), walked at random over the embedded model's byte-level
tokens (any marker can be spelled in bytes), must give text that the format's own parser reads back into
calls whose names are the tools' and whose arguments validate (jsonschema) against the tools' schemas.
This is what holds the parser and the grammar to one format (V4's `<｜DSML｜tool_calls>` against V3.2's
`function_calls`, for example).

With the families' published chat templates (tests/fixtures/chat_templates/<format>.jinja, where they come from:
its README; MLASERVE_CHAT_TEMPLATES names another folder): the parsed call, sent back as an assistant message with
a tool result, is rendered by the real template, and the format's parser reads the same name and arguments back
from the rendered text. V3.2 and V4 publish a Python encoder, no template: their transcript is written by
engine/dsml_encoding.py (held to the encoder's examples in test_dsml_official_encoding.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import jsonschema
import pytest
from grammar_walk import walk

from mlaserve.entrypoints.openai.protocol import ChatMessage
from mlaserve.tools.formats import FORMATS
from mlaserve.tools.request import ToolContext, transcript

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
VERSE = {
    "type": "object",
    "properties": {"book": {"enum": ["Genesis", "Psalms"]}, "verses": {"type": "array", "items": {"type": "integer"}}},
    "required": ["book"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "find_verse", "parameters": VERSE}},
]
SCHEMAS = {"get_weather": WEATHER, "find_verse": VERSE}
# the families' published templates, named by format (deepseek_v31.jinja, glm45.jinja, ...); another folder
# of them can be named by MLASERVE_CHAT_TEMPLATES
TEMPLATES = Path(
    os.environ.get("MLASERVE_CHAT_TEMPLATES") or Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
)


@pytest.fixture(scope="module")
def engine():
    from mlaserve import LLM

    return LLM().engine


def _calls(engine, name: str, choice, parallel: bool, seed: int):
    ctx = ToolContext.build(TOOLS, choice, parallel, FORMATS[name])
    tokens, ended = walk(engine.grammar_backend(), ctx.structured, set(engine.eos_ids), set(), random.Random(seed), 700)
    if not ended:
        return None, None
    text = engine.tokenizer.decode(tokens)
    msg, reason = ctx.message(text, "stop")
    assert reason == "tool_calls", (name, text)
    return text, msg["tool_calls"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_output_parses_and_validates(engine, name):
    ended = 0
    for seed in range(6):
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "find_verse"}}
        text, calls = _calls(engine, name, choice, parallel=seed >= 4, seed=seed)
        if text is None:
            continue
        ended += 1
        assert calls and (seed >= 4 or len(calls) == 1)
        for c in calls:
            assert c["function"]["name"] in SCHEMAS and (seed % 2 or c["function"]["name"] == "find_verse")
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    assert ended >= 3, f"{name}: only {ended} of 6 walks ended within 700 tokens"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_real_template_renders_what_the_parser_reads(engine, name):
    """One grammar-made call, then two (from two walks: GLM's parallel walks rarely end within the budget), each
    with and without assistant text before them, each answered by a tool result with its tool_call_id."""
    from mlaserve.engine.dsml_encoding import ENCODINGS
    from mlaserve.engine.tokenizer import Tokenizer

    path = TEMPLATES / f"{name}.jinja"
    if path.is_file():
        tok = Tokenizer(engine.tokenizer.tok, {"chat_template": path.read_text()}, [])
    elif (
        name in ENCODINGS
    ):  # V3.2, V4: the published encoder's text (held to its examples: test_dsml_official_encoding)
        tok = Tokenizer(engine.tokenizer.tok, {}, [])
        tok.encoding = name
    else:
        pytest.skip(f"no real chat template at {path}")
    walks = []
    for seed in range(8):
        _, calls = _calls(engine, name, "required", parallel=False, seed=seed)
        if calls is not None:
            walks.append(calls)
        if len(walks) == 2:
            break
    assert len(walks) == 2, f"{name}: {len(walks)} of 8 walks ended"
    fmt = FORMATS[name]
    for calls in (walks[0], walks[0] + walks[1]):
        for content in ("", "Let me check."):
            messages = [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": content, "tool_calls": calls},
            ]
            messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"} for i, c in enumerate(calls)
            ]
            # what the server hands the template: the request's messages through transcript()
            msgs = transcript([ChatMessage(**m) for m in messages], fmt, has_template=True)
            rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tools=TOOLS)
            assert all(f"result {i}" in rendered for i in range(len(calls)))
            # the assistant turn: from the user's text to the first tool result
            turn = rendered[rendered.index("Weather in Paris?") + len("Weather in Paris?") : rendered.index("result 0")]
            start = turn.find(fmt.START)
            assert start >= 0 and content in turn[:start], (name, turn)
            _, parsed = fmt.parse(_section(turn[start:], fmt.END), TOOLS)
            assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
            ], (name, turn)


def _section(text: str, end: str) -> str:
    """The call section as the template wrote it: up to its end marker (formats without one, GLM's
    per-call blocks, up to the last call's close)."""
    at = text.rfind(end)
    return text[: at + len(end)]

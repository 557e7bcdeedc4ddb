"""Each tool-call format: hand-written model outputs (the families' published formats) parse into
OpenAI calls, render -> parse round-trips, malformed sections fail naming the format, and a streamed
output split at every point gives the same content and calls as the whole one."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaserve.tools.formats import FORMATS, ToolCall, ToolParseError
from mlaserve.tools.request import ToolContext, transcript
from mlaserve.tools.select import choose_format

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
            },
        },
    }
]

HANDWRITTEN = {
    "deepseek_v3": (
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather'
        '\n```json\n{"city": "Rome", "days": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "deepseek_v31": (
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
        '{"city": "Rome", "days": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    ),
    "deepseek_v32": (
        'Let me look.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    ),
    "deepseek_v4": (
        'Let me look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    ),
    "glm45": (
        "Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n"
        "</tool_call>"
    ),
    "kimi_k2": (
        "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1'
        '<|tool_call_argument_begin|>{"city": "Rome", "days": 1}<|tool_call_end|><|tool_calls_section_end|>'
    ),
}
EXPECTED = [{"city": "Paris", "days": 3}, {"city": "Rome", "days": 1}]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_handwritten_output_parses(name):
    content, calls = FORMATS[name].parse(HANDWRITTEN[name], TOOLS)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather"] * 2
    assert [json.loads(c.arguments) for c in calls] == EXPECTED
    assert FORMATS[name].parse("no calls here", TOOLS) == ("no calls here", [])


_values = st.recursive(
    st.one_of(st.integers(-1000, 1000), st.booleans(), st.none(), st.text(alphabet="abc xyz.,!", max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("pqr"), inner, max_size=2),
    max_leaves=5,
)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=30, deadline=None)
@given(
    args=st.lists(
        st.dictionaries(st.sampled_from(["city", "days", "opts", "x"]), _values, max_size=3), min_size=1, max_size=3
    )
)
def test_render_parse_round_trip(name, args):
    fmt = FORMATS[name]
    calls = [ToolCall("get_weather", json.dumps(a)) for a in args]
    tools = None if name == "glm45" else TOOLS  # GLM reads values by the schema's types: no schema, JSON when it parses
    if name == "glm45":
        for a in args:  # text that is also JSON (a string "3") is ambiguous without a schema
            for k, v in list(a.items()):
                if isinstance(v, str):
                    a[k] = "s:" + v
        calls = [ToolCall("get_weather", json.dumps(a)) for a in args]
    content, parsed = fmt.parse("Some text." + fmt.render(calls), tools)
    assert content == "Some text."
    assert [json.loads(c.arguments) for c in parsed] == args


MALFORMED = {
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{not json}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}",
        "<｜tool▁calls▁begin｜>junk<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ],
    "deepseek_v31": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}",
    ],
    "deepseek_v32": [
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">nope</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n',
        "<｜DSML｜function_calls>\n</｜DSML｜function_calls>",
    ],
    "deepseek_v4": [
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">nope</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n',
        # V3.2's closing marker does not close V4's section
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    ],
    "glm45": [
        "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
    ],
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_malformed_fails_naming_the_format(name):
    for text in MALFORMED[name]:
        with pytest.raises(ToolParseError, match=name):
            FORMATS[name].parse("x" + text, TOOLS)


def _ctx(name):
    return ToolContext(FORMATS[name], "auto", TOOLS, None)


@pytest.mark.parametrize("name", sorted(FORMATS))
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_stream_split_anywhere_matches_whole(name, cuts):
    text = HANDWRITTEN[name]
    whole, reason = _ctx(name).message(text, "stop")
    ctx = _ctx(name)
    content, calls, final = "", [], None
    points = sorted({c % (len(text) + 1) for c in cuts}) + [len(text)]
    for i, p in enumerate(points):
        finished = i == len(points) - 1
        delta, tc, r = ctx.stream(0, text[:p], finished, "stop" if finished else None)
        content += delta
        calls += tc or []
        final = r
    assert final == reason == "tool_calls"
    assert content == whole["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    # cut inside the section by max_tokens: no calls, the text before the call as content (test_tool_call_cut.py)
    msg, r = _ctx(name).message(text[: len(text) - 5], "length")
    assert r == "length" and "tool_calls" not in msg and msg["content"] == "Let me look."


def test_format_choice_from_template_and_model_type():
    assert choose_format("deepseek_v32", None)[0] == "deepseek_v32"
    assert (
        choose_format(
            "deepseek_v3",
            "...{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'}}",
        )[0]
        == "deepseek_v31"
    )
    assert (
        choose_format(
            "deepseek_v3", "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}} function<｜tool▁sep｜>"
        )[0]
        == "deepseek_v3"
    )
    assert choose_format("deepseek_v3", "<|tool_calls_section_begin|>")[0] == "kimi_k2"
    assert choose_format("glm_moe_dsa", None)[0] == "glm45"
    assert choose_format("deepseek_v4", None)[0] == "deepseek_v4"
    assert choose_format("deepseek_v32", "{{ '<｜DSML｜tool_calls>' }}")[0] == "deepseek_v4"
    assert choose_format("deepseek_v4", "{{ '<｜DSML｜function_calls>' }}")[0] == "deepseek_v32"
    assert choose_format("deepseek_v3", None, "glm45") == ("glm45", "user option (--tool-call-parser)")
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose_format("deepseek_v3", None, "llama")


def test_transcript_renders_calls_without_a_template():
    class M:
        def __init__(self, role, content, **kw):
            self.role, self.content = role, content
            self.tool_calls = kw.get("tool_calls")
            self.tool_call_id = kw.get("tool_call_id")
            self.name = self.reasoning_content = None

        def text(self):
            return self.content or ""

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Ur"}'}}
    msgs = [M("assistant", None, tool_calls=[call]), M("tool", "hot", tool_call_id="call_1")]
    for fmt in FORMATS.values():
        with_tpl = transcript(msgs, fmt, True)
        assert with_tpl[0]["tool_calls"][0]["function"]["name"] == "get_weather" and with_tpl[0]["content"] == ""
        assert with_tpl[1] == {"role": "tool", "content": "hot", "tool_call_id": "call_1"}
        plain = transcript(msgs, fmt, False)
        assert fmt.parse(plain[0]["content"], TOOLS)[1][0].name == "get_weather"

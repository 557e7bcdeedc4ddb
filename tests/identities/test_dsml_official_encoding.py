"""DeepSeek-V3.2 and DeepSeek-V4 publish no chat template but a Python encoder (`encoding/encoding_dsv32.py`,
`encoding/encoding_dsv4.py` in deepseek-ai/DeepSeek-V3.2 and deepseek-ai/DeepSeek-V4-Flash on the Hugging Face
Hub). What mlaserve renders for them (engine/dsml_encoding.py over the server's transcript, and the formats'
DSML calls) must be that encoder's text, byte for byte. The expected strings are written out here by hand from
the official material, never produced by our code:

* V4: the encoder's reference case 1 (test_input_1.json -> test_output_1.txt, thinking mode, two tools, one call,
  its result, the answer), as vLLM keeps DeepSeek's golden files in tests/tokenizers_/fixtures/deepseek_v4/.
* V3.2: the encoder's templates (TOOLS_SYSTEM_TEMPLATE, user/assistant/tool templates, as copied from the Hub
  into vLLM's vllm/tokenizers/deepseek_v32_encoding.py), and a thinking-mode transcript that a write-up
  rendered with encoding_dsv32.py (the Zürich / café example: calls, two results, the answer).
"""

from __future__ import annotations

import json

import pytest

from mlaserve.engine.dsml_encoding import ENCODINGS, encode
from mlaserve.entrypoints.openai.protocol import ChatMessage
from mlaserve.tools.formats import FORMATS, ToolCall
from mlaserve.tools.request import transcript

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _encode(name: str, messages: list[dict], tools=None, thinking=False) -> str:
    """What the server renders: the request's messages through transcript(), then the encoding."""
    msgs = transcript([ChatMessage(**m) for m in messages], FORMATS[name], has_template=True)
    return encode(ENCODINGS[name], msgs, tools, thinking)


def _call(id_: str, name: str, args: dict) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# ---- V4: reference case 1 ------------------------------------------------------------------------------------
V4_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a specific location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for information",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query"},
                    "num_results": {"type": "integer", "description": "Number of results to return"},
                },
                "required": ["query"],
            },
        },
    },
]
V4_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Beijing?"},
    {
        "role": "assistant",
        "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
        "tool_calls": [_call("call_001", "get_weather", {"location": "Beijing", "unit": "celsius"})],
    },
    {
        "role": "tool",
        "tool_call_id": "call_001",
        "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}',
    },
    {
        "role": "assistant",
        "reasoning_content": "Got the weather data. Let me format a nice response.",
        "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.",
    },
]
V4_OUTPUT_1 = (
    "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n## Tools\n\nYou have access to a set of tools to help "
    'answer the user\'s question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the '
    'following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter '
    'name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters '
    'should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, '
    'objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled '
    "(triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool "
    "calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response."
    "\n\n### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": {"type": '
    '"object", "properties": {"location": {"type": "string", "description": "The city name"}, "unit": {"type": '
    '"string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}'
    '\n{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", '
    '"properties": {"query": {"type": "string", "description": "Search query"}, "num_results": {"type": '
    '"integer", "description": "Number of results to return"}}, "required": ["query"]}}\n\nYou MUST strictly '
    "follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>The user wants to know the weather in Beijing. I "
    'should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" '
    'string="true">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>'
    '<｜User｜><tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result><｜Assistant｜>'
    "<think>Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently "
    "sunny with a temperature of 22°C and 45% humidity.<｜end▁of▁sentence｜>"
)


def test_v4_reference_case():
    assert _encode("deepseek_v4", V4_MESSAGES, V4_TOOLS, thinking=True) == V4_OUTPUT_1


def test_v4_chat_mode_generation_prompt_after_results():
    """Chat mode: every assistant opener is </think>; two results of one turn are one user turn, in the order of
    the calls (the second result is sent first here), joined by a blank line; the generation prompt follows."""
    calls = [_call("a", "get_weather", {"location": "Paris"}), _call("b", "search", {"query": "x"})]
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    assert _encode("deepseek_v4", messages) == (
        f'{BOS}<｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">x</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>A</tool_result>\n\n"
        "<tool_result>B</tool_result><｜Assistant｜></think>"
    )


# ---- V3.2 ------------------------------------------------------------------------------------------------------
def test_v32_thinking_transcript():
    """The write-up's transcript rendered by encoding_dsv32.py (thinking mode): string values raw (quotes and
    all), other values JSON, `\\n\\n` before the section, results in <function_results>, <think> reopened after
    them, the answer's reasoning closed by </think>."""
    calls = [
        _call("c1", "get_weather", {"city": "Zürich", "unit": "c"}),
        _call("c2", "search", {"query": 'café "best"', "filters": {"tags": ["a", "b"], "max": 3}}),
    ]
    messages = [
        {"role": "user", "content": "Weather in Zürich, and a café?"},
        {"role": "assistant", "reasoning_content": "I should call the tools.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "c2", "content": "[]"},
        {"role": "assistant", "reasoning_content": "Done.", "content": "It is 20C."},
    ]
    assert _encode("deepseek_v32", messages, thinking=True) == (
        f"{BOS}<｜User｜>Weather in Zürich, and a café?"
        "<｜Assistant｜><think>I should call the tools.</think>\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">c</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="search">\n'
        '<｜DSML｜parameter name="query" string="true">café "best"</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="filters" string="false">{"tags": ["a", "b"], "max": 3}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n<function_results>\n"
        '<result>{"temp": 20}</result>\n'
        "<result>[]</result>\n"
        "</function_results>\n\n<think>Done.</think>It is 20C.<｜end▁of▁sentence｜>"
    )


def test_v32_chat_mode_with_tools():
    """Chat mode with the request's tools: the tools prompt after the system message (TOOLS_SYSTEM_TEMPLATE),
    </think> after each user turn and after the results; a call without arguments keeps the empty line between
    its invoke tags (the encoder's '<invoke name="{name}">\\n{arguments}\\n</invoke>')."""
    tools = [
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
        {
            "type": "function",
            "function": {"name": "find", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        },
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [_call("x", "now", {}), _call("y", "find", {"n": 2})],
        },
        {"role": "tool", "tool_call_id": "x", "content": "12:00"},
        {"role": "tool", "tool_call_id": "y", "content": "ok"},
    ]
    assert _encode("deepseek_v32", messages, tools) == (
        f"{BOS}Be brief.\n\n## Tools\nYou have access to a set of tools you can use to answer the user's question.\n"
        'You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your '
        'reply to the user:\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="$FUNCTION_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
        '...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$FUNCTION_NAME2">\n...\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>\nString and scalar parameters should be specified as is without any escaping or "
        'quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" '
        'for string type parameters and "false" for other types (numbers, booleans, arrays, objects).\n'
        "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
        "thinking block. Here is an example:\n<｜DSML｜function_calls>\n...\n</｜DSML｜function_calls>\n"
        "<function_results>\n...\n</function_results>\n<think>...thinking about results</think>\n"
        "Here are the functions available in JSONSchema format:\n<functions>\n"
        '{"name": "now", "parameters": {"type": "object", "properties": {}}}\n'
        '{"name": "find", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}\n'
        "</functions>\n"
        "<｜User｜>Time?<｜Assistant｜></think>Checking.\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="find">\n<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>"
        "\n\n<function_results>\n<result>12:00</result>\n<result>ok</result>\n</function_results>\n\n</think>"
    )


def test_tools_without_a_system_message_open_the_prompt():
    """No system message: the tools prompt is the first thing after BOS (the encoders read tools from a system
    message; one with empty content is put first)."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    for name, heading in (("deepseek_v32", "## Tools\nYou have access"), ("deepseek_v4", "## Tools\n\nYou have")):
        text = _encode(name, [{"role": "user", "content": "Time?"}], tools)
        assert text.startswith(BOS + "\n\n" + heading), (name, text[:80])
        assert text.endswith("<｜User｜>Time?<｜Assistant｜></think>"), (name, text[-60:])


# ---- the formats' own DSML against the encoders' -----------------------------------------------------------------
@pytest.mark.parametrize("name,block", [("deepseek_v32", "function_calls"), ("deepseek_v4", "tool_calls")])
def test_format_render_and_parse_are_the_encoders(name, block):
    """render(calls) is the text the encoder writes after an assistant's content (a call without arguments
    included), and parse() reads the model's own output of that shape back."""
    calls = [ToolCall("now", "{}"), ToolCall("find", json.dumps({"q": 'a "b" <c>', "n": [1, 2]}))]
    official = (
        f'\n\n<｜DSML｜{block}>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name="find">\n'
        '<｜DSML｜parameter name="q" string="true">a "b" <c></｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">[1, 2]</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜{block}>"
    )
    fmt = FORMATS[name]
    assert fmt.render(calls) == official
    content, parsed = fmt.parse("Let me look." + official)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("now", {}),
        ("find", {"q": 'a "b" <c>', "n": [1, 2]}),
    ]


@pytest.mark.parametrize("name", ["deepseek_v32", "deepseek_v4"])
def test_bad_transcripts_are_named(name):
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool result with no assistant tool call"):
        encode(ENCODINGS["deepseek_v32"], [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}])
    with pytest.raises(ValueError, match=rf"messages\[0\]: role 'developer' is not written by the {name} encoding"):
        encode(ENCODINGS[name], [{"role": "developer", "content": "x"}])

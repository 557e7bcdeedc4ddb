"""DeepSeek-V3.2 DSML (V4 writes the same calls inside <｜DSML｜tool_calls>: deepseek_v4.py):

<｜DSML｜function_calls>
<｜DSML｜invoke name="NAME">
<｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
<｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜function_calls>
"""

from __future__ import annotations

import json
import re

from mlaserve.tools.formats.base import ToolCall, ToolParseError, split_content

NAME = "deepseek_v32"
XGRAMMAR_MODEL = "deepseek_v3_2"
TEMPLATE_ARGUMENTS = "object"  # the DSML templates render `arguments` only when it is a mapping
START = "<｜DSML｜function_calls>"
END = "</｜DSML｜function_calls>"
_INVOKE = re.compile(r'<｜DSML｜invoke name="(?P<name>[^"]+)">(?P<body>.*?)</｜DSML｜invoke>', re.S)
_PARAM = re.compile(
    r'<｜DSML｜parameter name="(?P<key>[^"]+)" string="(?P<str>true|false)">(?P<value>.*?)</｜DSML｜parameter>', re.S
)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    return parse_dsml(text, NAME, START, END)


def parse_dsml(text: str, fmt: str, start: str, end: str) -> tuple[str, list[ToolCall]]:
    """DSML invokes inside the section START ... END (fmt: the format's name, for errors)."""
    content, section = split_content(text, start)
    if section is None:
        return content, []
    content = content.rstrip("\n")  # the format opens its section after a blank line
    if not section.rstrip().endswith(end):
        raise ToolParseError(f"{fmt}: tool-call section not closed with {end}")
    body = section[len(start) : section.rstrip().rindex(end)]
    calls, pos = [], 0
    for m in _INVOKE.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{fmt}: unexpected text in the tool-call section: {body[pos : m.start()][:80]!r}")
        calls.append(ToolCall(m["name"], json.dumps(_params(fmt, m["name"], m["body"]), ensure_ascii=False)))
        pos = m.end()
    if body[pos:].strip() or not calls:
        raise ToolParseError(f"{fmt}: malformed tool call: {body[pos:][:80]!r}")
    return content, calls


def _params(fmt: str, name: str, body: str) -> dict:
    args, pos = {}, 0
    for m in _PARAM.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{fmt}: call {name!r}: unexpected text {body[pos : m.start()][:80]!r}")
        if m["str"] == "true":
            args[m["key"]] = m["value"]
        else:
            try:
                args[m["key"]] = json.loads(m["value"])
            except ValueError as e:
                raise ToolParseError(f"{fmt}: call {name!r} parameter {m['key']!r} is not JSON ({e})") from None
        pos = m.end()
    if body[pos:].strip():
        raise ToolParseError(f"{fmt}: call {name!r}: malformed parameter {body[pos:][:80]!r}")
    return args


def render(calls: list[ToolCall]) -> str:
    return render_dsml(calls, START, END)


def render_dsml(calls: list[ToolCall], start: str, end: str) -> str:
    """The calls as DeepSeek's encoders write them into an assistant turn (encoding_dsv32.py /
    encoding_dsv4.py): a blank line, the section, one invoke per call with its parameters one a line (an
    invoke without parameters keeps the empty line between its tags)."""
    invokes = []
    for c in calls:
        params = []
        for key, value in json.loads(c.arguments).items():
            if isinstance(value, str):
                params.append(f'<｜DSML｜parameter name="{key}" string="true">{value}</｜DSML｜parameter>')
            else:
                text = json.dumps(value, ensure_ascii=False)
                params.append(f'<｜DSML｜parameter name="{key}" string="false">{text}</｜DSML｜parameter>')
        invokes.append(f'<｜DSML｜invoke name="{c.name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>")
    return f"\n\n{start}\n" + "\n".join(invokes) + f"\n{end}"

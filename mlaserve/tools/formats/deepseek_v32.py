"""DeepSeek-V3.2 / V4 DSML:

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
START = "<｜DSML｜function_calls>"
END = "</｜DSML｜function_calls>"
_INVOKE = re.compile(r'<｜DSML｜invoke name="(?P<name>[^"]+)">(?P<body>.*?)</｜DSML｜invoke>', re.S)
_PARAM = re.compile(
    r'<｜DSML｜parameter name="(?P<key>[^"]+)" string="(?P<str>true|false)">(?P<value>.*?)</｜DSML｜parameter>', re.S
)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    content, section = split_content(text, START)
    if section is None:
        return content, []
    content = content.rstrip("\n")  # the format opens its section after a blank line
    if not section.rstrip().endswith(END):
        raise ToolParseError(f"{NAME}: tool-call section not closed with {END}")
    body = section[len(START) : section.rstrip().rindex(END)]
    calls, pos = [], 0
    for m in _INVOKE.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{NAME}: unexpected text in the tool-call section: {body[pos : m.start()][:80]!r}")
        calls.append(ToolCall(m["name"], json.dumps(_params(m["name"], m["body"]), ensure_ascii=False)))
        pos = m.end()
    if body[pos:].strip() or not calls:
        raise ToolParseError(f"{NAME}: malformed tool call: {body[pos:][:80]!r}")
    return content, calls


def _params(name: str, body: str) -> dict:
    args, pos = {}, 0
    for m in _PARAM.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{NAME}: call {name!r}: unexpected text {body[pos : m.start()][:80]!r}")
        if m["str"] == "true":
            args[m["key"]] = m["value"]
        else:
            try:
                args[m["key"]] = json.loads(m["value"])
            except ValueError as e:
                raise ToolParseError(f"{NAME}: call {name!r} parameter {m['key']!r} is not JSON ({e})") from None
        pos = m.end()
    if body[pos:].strip():
        raise ToolParseError(f"{NAME}: call {name!r}: malformed parameter {body[pos:][:80]!r}")
    return args


def render(calls: list[ToolCall]) -> str:
    out = [START]
    for c in calls:
        out.append(f'<｜DSML｜invoke name="{c.name}">')
        for key, value in json.loads(c.arguments).items():
            if isinstance(value, str):
                out.append(f'<｜DSML｜parameter name="{key}" string="true">{value}</｜DSML｜parameter>')
            else:
                text = json.dumps(value, ensure_ascii=False)
                out.append(f'<｜DSML｜parameter name="{key}" string="false">{text}</｜DSML｜parameter>')
        out.append("</｜DSML｜invoke>")
    out.append(END)
    return "\n\n" + "\n".join(out)

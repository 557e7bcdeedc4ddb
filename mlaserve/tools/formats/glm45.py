"""GLM-4.5 .. GLM-5: <tool_call>NAME
<arg_key>KEY</arg_key>
<arg_value>VALUE</arg_value>
</tool_call>   (one block per call; string values raw, others JSON)"""

from __future__ import annotations

import json
import re

from mlaserve.tools.formats.base import ToolCall, ToolParseError, param_types, split_content

NAME = "glm45"
XGRAMMAR_MODEL = "glm_4_7"
START = "<tool_call>"
END = "</tool_call>"
_CALL = re.compile(r"<tool_call>(?P<name>[^<\n]+?)\s*(?P<body>(?:<arg_key>.*?)?)</tool_call>", re.S)
_ARG = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    content, section = split_content(text, START)
    if section is None:
        return content, []
    calls, pos = [], 0
    for m in _CALL.finditer(section):
        if section[pos : m.start()].strip():
            raise ToolParseError(f"{NAME}: unexpected text between tool calls: {section[pos : m.start()][:80]!r}")
        name = m["name"].strip()
        calls.append(ToolCall(name, json.dumps(_args(name, m["body"], param_types(tools, name)), ensure_ascii=False)))
        pos = m.end()
    if section[pos:].strip() or not calls:
        raise ToolParseError(f"{NAME}: malformed or unclosed tool call: {section[pos:][:80]!r}")
    return content, calls


def _args(name: str, body: str, types: dict) -> dict:
    args, pos = {}, 0
    for m in _ARG.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{NAME}: call {name!r}: unexpected text {body[pos : m.start()][:80]!r}")
        key, value = m["key"].strip(), m["value"]
        if (types.get(key) or {}).get("type") == "string":
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError:
                if key in types:
                    raise ToolParseError(
                        f"{NAME}: call {name!r} argument {key!r} is not JSON: {value[:80]!r}"
                    ) from None
                args[key] = value  # a parameter the tools do not describe: the text as written
        pos = m.end()
    if body[pos:].strip():
        raise ToolParseError(f"{NAME}: call {name!r}: malformed argument {body[pos:][:80]!r}")
    return args


def render(calls: list[ToolCall]) -> str:
    out = []
    for c in calls:
        lines = [f"{START}{c.name}"]
        for key, value in json.loads(c.arguments).items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            lines.append(f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>")
        out.append("\n".join(lines) + f"\n{END}")
    return "".join(out)

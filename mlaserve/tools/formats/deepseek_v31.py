"""DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, ToolParseError, json_arguments, split_content

NAME = "deepseek_v31"
XGRAMMAR_MODEL = "deepseek_v3_1"
START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.+?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.S)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    content, section = split_content(text, START)
    if section is None:
        return content, []
    if not section.rstrip().endswith(END):
        raise ToolParseError(f"{NAME}: tool-call section not closed with {END}")
    body = section[len(START) : section.rstrip().rindex(END)]
    calls, pos = [], 0
    for m in _CALL.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{NAME}: unexpected text in the tool-call section: {body[pos : m.start()][:80]!r}")
        calls.append(ToolCall(m["name"].strip(), json_arguments(m["args"], f"{NAME} call {m['name']!r}")))
        pos = m.end()
    if body[pos:].strip() or not calls:
        raise ToolParseError(f"{NAME}: malformed tool call: {body[pos:][:80]!r}")
    return content, calls


def render(calls: list[ToolCall]) -> str:
    inner = "".join(f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{c.arguments}<｜tool▁call▁end｜>" for c in calls)
    return f"{START}{inner}{END}"

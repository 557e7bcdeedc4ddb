"""DeepSeek-V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json
ARGS
```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, ToolParseError, json_arguments, split_content

NAME = "deepseek_v3"
XGRAMMAR_MODEL = "deepseek_r1"
START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.S,
)


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
    inner = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{c.arguments}\n```<｜tool▁call▁end｜>"
        for c in calls
    )
    return f"{START}{inner}{END}"

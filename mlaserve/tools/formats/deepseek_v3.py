"""DeepSeek-V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
```json
ARGS
```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, parse_section

NAME = "deepseek_v3"
XGRAMMAR_MODEL = "deepseek_r1"
START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]+)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.S,
)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    return parse_section(text, NAME, START, END, _CALL)


def render(calls: list[ToolCall]) -> str:
    inner = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{c.arguments}\n```<｜tool▁call▁end｜>"
        for c in calls
    )
    return f"{START}{inner}{END}"

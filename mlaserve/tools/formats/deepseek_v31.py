"""DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, parse_section

NAME = "deepseek_v31"
XGRAMMAR_MODEL = "deepseek_v3_1"
START = "<｜tool▁calls▁begin｜>"
END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.+?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.S)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    return parse_section(text, NAME, START, END, _CALL)


def render(calls: list[ToolCall]) -> str:
    inner = "".join(f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{c.arguments}<｜tool▁call▁end｜>" for c in calls)
    return f"{START}{inner}{END}"

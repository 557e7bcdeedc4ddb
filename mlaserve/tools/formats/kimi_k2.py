"""Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
<|tool_call_end|>...<|tool_calls_section_end|>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, parse_section

NAME = "kimi_k2"
XGRAMMAR_MODEL = "kimi"
START = "<|tool_calls_section_begin|>"
END = "<|tool_calls_section_end|>"
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^:<]+):\d+)\s*<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    return parse_section(text, NAME, START, END, _CALL, with_id=True)


def render(calls: list[ToolCall]) -> str:
    inner = "".join(
        f"<|tool_call_begin|>functions.{c.name}:{i}<|tool_call_argument_begin|>{c.arguments}<|tool_call_end|>"
        for i, c in enumerate(calls)
    )
    return f"{START}{inner}{END}"

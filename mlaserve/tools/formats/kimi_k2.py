"""Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
<|tool_call_end|>...<|tool_calls_section_end|>"""

from __future__ import annotations

import re

from mlaserve.tools.formats.base import ToolCall, ToolParseError, json_arguments, split_content

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
        calls.append(ToolCall(m["name"].strip(), json_arguments(m["args"], f"{NAME} call {m['name']!r}"), m["id"]))
        pos = m.end()
    if body[pos:].strip() or not calls:
        raise ToolParseError(f"{NAME}: malformed tool call: {body[pos:][:80]!r}")
    return content, calls


def render(calls: list[ToolCall]) -> str:
    inner = "".join(
        f"<|tool_call_begin|>functions.{c.name}:{i}<|tool_call_argument_begin|>{c.arguments}<|tool_call_end|>"
        for i, c in enumerate(calls)
    )
    return f"{START}{inner}{END}"

"""DeepSeek-V4: V3.2's DSML calls (invoke / parameter string="true|false", deepseek_v32.py) inside
<｜DSML｜tool_calls> ... </｜DSML｜tool_calls> where V3.2 writes <｜DSML｜function_calls> (the one difference
V4's tool parsers in vLLM and SGLang, and xgrammar's `deepseek_v4` structural tag, document):

<｜DSML｜tool_calls>
<｜DSML｜invoke name="NAME">
<｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls>
"""

from __future__ import annotations

from mlaserve.tools.formats.base import ToolCall
from mlaserve.tools.formats.deepseek_v32 import parse_dsml, render_dsml

NAME = "deepseek_v4"
XGRAMMAR_MODEL = "deepseek_v4"
TEMPLATE_ARGUMENTS = "object"  # as V3.2's
START = "<｜DSML｜tool_calls>"
END = "</｜DSML｜tool_calls>"


def parse(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    return parse_dsml(text, NAME, START, END)


def render(calls: list[ToolCall]) -> str:
    return render_dsml(calls, START, END)

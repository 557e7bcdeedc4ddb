"""The tool-call formats, by name (what --tool-call-parser takes)."""

from mlaserve.tools.formats import deepseek_v3, deepseek_v4, deepseek_v31, deepseek_v32, glm45, kimi_k2
from mlaserve.tools.formats.base import ToolCall, ToolParseError

FORMATS = {m.NAME: m for m in (deepseek_v3, deepseek_v31, deepseek_v32, deepseek_v4, glm45, kimi_k2)}

__all__ = ["FORMATS", "ToolCall", "ToolParseError"]

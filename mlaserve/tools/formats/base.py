"""What every tool-call format module provides, and the shared pieces."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


class ToolParseError(ValueError):
    """The model's text holds a tool-call section that does not parse (named in the message)."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def json_arguments(text: str, where: str) -> str:
    """Arguments text -> canonical JSON text of an object; ToolParseError naming `where` if not one."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ToolParseError(f"{where}: arguments are not JSON ({e}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ToolParseError(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False)


def split_content(text: str, start: str) -> tuple[str, str | None]:
    """(content before the tool-call section, the section from its start marker on, or None)."""
    at = text.find(start)
    if at < 0:
        return text, None
    return text[:at], text[at:]


def param_types(tools: list[dict] | None, name: str) -> dict[str, object]:
    """{parameter: its JSON schema} of tool `name` (formats that write values as text need it)."""
    for t in tools or []:
        fn = t.get("function", {})
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def parse_section(text: str, name: str, start: str, end: str, call: re.Pattern, with_id: bool = False):
    """(content, calls) of a format whose section is START (CALL)+ END with JSON arguments: `call` matches one call
    with groups name and args (and id when `with_id`); anything else inside the section is a ToolParseError."""
    content, section = split_content(text, start)
    if section is None:
        return content, []
    if not section.rstrip().endswith(end):
        raise ToolParseError(f"{name}: tool-call section not closed with {end}")
    body = section[len(start) : section.rstrip().rindex(end)]
    calls, pos = [], 0
    for m in call.finditer(body):
        if body[pos : m.start()].strip():
            raise ToolParseError(f"{name}: unexpected text in the tool-call section: {body[pos : m.start()][:80]!r}")
        args = json_arguments(m["args"], f"{name} call {m['name']!r}")
        calls.append(ToolCall(m["name"].strip(), args, m["id"]) if with_id else ToolCall(m["name"].strip(), args))
        pos = m.end()
    if body[pos:].strip() or not calls:
        raise ToolParseError(f"{name}: malformed tool call: {body[pos:][:80]!r}")
    return content, calls

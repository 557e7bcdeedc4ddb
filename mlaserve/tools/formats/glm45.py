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
TEMPLATE_ARGUMENTS = "object"  # GLM-4.5..5's templates iterate `arguments.items()`
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
        args[key] = _value(name, key, value, types.get(key))
        pos = m.end()
    if body[pos:].strip():
        raise ToolParseError(f"{NAME}: call {name!r}: malformed argument {body[pos:][:80]!r}")
    return args


def _value(name: str, key: str, text: str, schema) -> object:
    """A value as GLM writes it: strings raw, everything else JSON; which one, the parameter's schema says
    (a string type, or string members of its enum / const / anyOf, e.g. {"enum": ["Genesis", "Psalms"]})."""
    strings = _string_members(schema)
    if strings is True:
        return _layout_stripped(text)
    word = text.strip()  # around a value that is not a free string, blank space is layout (as around JSON)
    try:
        value = json.loads(text)
    except ValueError:
        if strings is None:
            return text  # a parameter the tools do not describe: as written
        if word in strings:
            return word
    else:
        if strings is None or word not in strings or value in strings:
            return value
        return word  # "3" where the enum holds the string "3"
    raise ToolParseError(f"{NAME}: call {name!r} argument {key!r} is not JSON: {text[:80]!r}")


def _layout_stripped(text: str) -> str:
    """A free string without the blank the grammar writes around it: xgrammar's glm_xml grammar allows one
    whitespace character of layout on each side of a value (`max_whitespace_cnt` 1; the value's own
    schema, a maxLength say, holds what is inside it), so that character is not part of the string.
    (The template writes `<arg_value>{{ v }}</arg_value>`, no blank: a template-written value is unchanged.)"""
    if text[:1] in _BLANK:
        text = text[1:]
    if text[-1:] in _BLANK:
        text = text[:-1]
    return text


_BLANK = (" ", "\t", "\n", "\r")


def _string_members(schema):
    """True: any string; a set: these strings (enum / const); an empty set: no strings; None: no schema."""
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return True
    out: set = set()
    for v in schema.get("enum", []) + ([schema["const"]] if "const" in schema else []):
        if isinstance(v, str):
            out.add(v)
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        sub = _string_members(branch)
        if sub is True:
            return True
        out |= sub or set()
    return out


def render(calls: list[ToolCall]) -> str:
    out = []
    for c in calls:
        lines = [f"{START}{c.name}"]
        for key, value in json.loads(c.arguments).items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            lines.append(f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>")
        out.append("\n".join(lines) + f"\n{END}")
    return "".join(out)

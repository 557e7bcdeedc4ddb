"""OpenAI tools / tool_choice / parallel_tool_calls on a chat request.

    ctx = ToolContext.build(req, format_module)   # None when the request has no tools (or tool_choice none)
    ctx.structured                                # the grammar: xgrammar's structural tag for the format
    ctx.message(text, finish_reason)              # -> (message dict, finish_reason) for the response
    ctx.stream(text, finished)                    # -> (content delta, tool_calls delta or None), streaming

required / named: the output *is* the tool-call section, generated under the tools' JSON schemas.
auto: free text until the model writes the format's start marker; from there the grammar holds.
A thinking request's reasoning comes first, before either (entrypoints/openai/chat.py, structured/reasoning.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from mlaserve.structured.spec import StructuredOutputs, check_strict
from mlaserve.structured.strict import plain_length_strings
from mlaserve.tools.formats import ToolCall, ToolParseError

log = logging.getLogger("mlaserve.server")


class ToolRequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_tools(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise ToolRequestError("tools", "must be a non-empty list")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolRequestError("tools", f"{where} must be {{'type': 'function', 'function': {{...}}}}")
        unknown = sorted(set(t) - {"type", "function"})
        if unknown:
            raise ToolRequestError("tools", f"{where}.{unknown[0]} is not supported")
        fn = t["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolRequestError("tools", f"{where}.function.{unknown[0]} is not supported")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in '<>"\n:'):
            raise ToolRequestError("tools", f"{where}.function.name must be a non-empty name, got {name!r}")
        if name in names:
            raise ToolRequestError("tools", f"{where}: tool name {name!r} appears twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise ToolRequestError("tools", f"{where}.function.parameters must be an object schema")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolRequestError("tools", f"{where}.function.strict must be a bool, got {strict!r}")
        if strict is not False and params is not None:  # the call's arguments must validate (as response_format)
            try:
                check_strict(params, f"{where}.function.parameters")
            except ValueError as e:
                raise ToolRequestError("tools", str(e)) from None
    return tools


def check_tool_choice(choice, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """-> (mode: none | auto | required | forced, the tools the grammar may call)."""
    if choice is None:
        return ("auto" if tools else "none"), tools or []
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolRequestError("tool_choice", f"{choice!r} needs tools")
        return choice, tools or []
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        picked = [t for t in tools or [] if t["function"]["name"] == name]
        if not picked:
            raise ToolRequestError("tool_choice", f"names the function {name!r}, which is not among the tools")
        return "forced", picked
    raise ToolRequestError(
        "tool_choice", f"must be none, auto, required or {{'type': 'function', ...}}, got {choice!r}"
    )


@dataclass
class ToolContext:
    fmt: object  # a module of mlaserve/tools/formats
    mode: str  # auto | required | forced
    tools: list[dict]
    structured: StructuredOutputs
    sent: dict = field(default_factory=dict)  # choice index -> characters of content streamed

    @staticmethod
    def build(tools, tool_choice, parallel_tool_calls, fmt) -> ToolContext | None:
        """The grammar holds from the first token; a reasoning block before it is added the same way for
        every format and for response_format (StructuredOutputs.after_reasoning, structured/reasoning.py),
        not by xgrammar's per-model `reasoning`, which differs by model."""
        tools = check_tools(tools) if tools is not None else None
        mode, allowed = check_tool_choice(tool_choice, tools)
        if mode == "none":
            return None
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolRequestError("parallel_tool_calls", "must be a bool")
        import xgrammar as xgr

        grammar_tools = [  # xgrammar's length-bounded strings, worked around as for response_format
            {**t, "function": {**t["function"], "parameters": plain_length_strings(t["function"]["parameters"])}}
            if t["function"].get("parameters") is not None
            else t
            for t in allowed
        ]
        try:
            tag = xgr.get_model_structural_tag(
                fmt.XGRAMMAR_MODEL,
                tools=grammar_tools,
                tool_choice="required" if mode == "forced" else mode,
                reasoning="disabled",
                parallel_tool_calls=parallel_tool_calls is not False,
                max_whitespace_cnt=1,  # the schema's values, not blank space
            )
        except Exception as e:
            raise ToolRequestError("tools", f"cannot build the tool-call grammar: {e}") from None
        return ToolContext(fmt, mode, allowed, StructuredOutputs(structural_tag=tag.model_dump_json()))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return self.fmt.parse(text, self.tools)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A call cut short (max_tokens, or a stop string, inside the section) is neither a call (it is not
        valid) nor content (its markup is not text for the user): the content is the text before the call's
        start marker and `finish_reason` keeps the reason it ended ("length"), so a client sees it was cut."""
        try:
            content, calls = self.parse(text)
        except ToolParseError as e:
            if finish_reason == "stop":
                log.warning("tool-call output did not parse: %s", e)
            content, calls = _safe_prefix(text, self.fmt.START), []
        if finish_reason == "length":  # a start marker cut in the middle is markup too
            content = _safe_prefix(content, self.fmt.START)
        msg = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    def stream(self, index: int, text: str, finished: bool, finish_reason: str | None):
        """-> (content delta, tool_calls delta or None, finish_reason): content as soon as it cannot be
        the start of a tool-call section; each call whole, once the section is complete."""
        sent = self.sent.get(index, 0)
        calls = None
        if finished:
            msg, finish_reason = self.message(text, finish_reason)
            content = msg.get("content") or ""
            if msg.get("tool_calls"):
                calls = [dict(c, index=i) for i, c in enumerate(msg["tool_calls"])]
        else:
            content = _safe_prefix(text, self.fmt.START)
        delta = content[sent:] if len(content) > sent else ""
        self.sent[index] = max(sent, len(content))
        return delta, calls, finish_reason


def _safe_prefix(text: str, start: str) -> str:
    """The part of `text` that is content whatever comes next: before the start marker (or before a
    tail that may become it), without trailing newlines (some formats open their section after them)."""
    at = text.find(start)
    if at >= 0:
        text = text[:at]
    else:
        for k in range(min(len(start) - 1, len(text)), 0, -1):
            if start.startswith(text[-k:]):
                text = text[:-k]
                break
    return text.rstrip("\n")


def transcript(messages, fmt, has_template: bool) -> list[dict]:
    """Chat messages as the template reads them: assistant tool_calls and tool results kept (OpenAI
    shapes; arguments as JSON text, or as an object for the formats whose templates iterate them:
    TEMPLATE_ARGUMENTS); without a template, assistant calls are written in the model's own format."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        calls = getattr(m, "tool_calls", None)
        if calls:
            d["tool_calls"] = [_check_call(c) for c in calls]
            if getattr(fmt, "TEMPLATE_ARGUMENTS", "text") == "object":  # the family's template reads a mapping
                for c in d["tool_calls"]:
                    c["function"] = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
            if not has_template:
                d["content"] += fmt.render([ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in calls])
        if getattr(m, "tool_call_id", None) is not None:
            d["tool_call_id"] = m.tool_call_id
        if getattr(m, "name", None) is not None:
            d["name"] = m.name
        if getattr(m, "reasoning_content", None) is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _check_call(c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise ToolRequestError(
            "messages", f"an assistant tool_call must have function.name and function.arguments: {c!r}"
        )
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = None
    if not isinstance(args, dict):  # a function's parameters are an object schema; the formats render its keys
        raise ToolRequestError("messages", f"tool_call {fn['name']!r}: arguments are not a JSON object")
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}

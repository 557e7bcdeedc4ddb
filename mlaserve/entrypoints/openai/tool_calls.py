"""Chat requests with tools: the checkpoint's tool-call format (chosen once, logged), the grammar, the
transcript the chat template reads, and the response's tool_calls (mlaserve/tools/)."""

from __future__ import annotations

import logging

from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.tools.formats import FORMATS
from mlaserve.tools.request import ToolContext, ToolRequestError, transcript
from mlaserve.tools.select import choose_format

log = logging.getLogger("mlaserve.server")
_RESERVED = ("messages", "add_generation_prompt", "tools")


def set_tool_format(serving, override: str | None = None) -> str:
    """Choose (and record on `serving`, and in the log) the tool-call format of the served model."""
    template = serving.chat_template or (serving.tokenizer.chat_template if serving.tokenizer else None)
    name, why = choose_format(serving.llm.config.model.model_type, template, override)
    serving.tool_format = name
    log.info("tool-call format %s (%s)", name, why)
    return name


def tool_format(serving):
    name = getattr(serving, "tool_format", None) or set_tool_format(serving)
    return FORMATS[name]


def _has_template(serving) -> bool:
    return bool(serving.chat_template or (serving.tokenizer and serving.tokenizer.chat_template))


def tool_context(serving, req, thinking: bool = False) -> ToolContext | None:
    """thinking: the prompt opened <think>; the grammar lets the reasoning finish before any call."""
    try:
        fmt = tool_format(serving)
        ctx = ToolContext.build(req.tools, req.tool_choice, req.parallel_tool_calls, fmt, thinking)
    except ToolRequestError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None
    if ctx is not None:
        if req.response_format is not None or req.structured_outputs is not None:
            raise APIError(400, "tools cannot be combined with response_format / structured_outputs", "tools")
        try:
            serving.llm.engine.check_params_structured(ctx.structured)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", "tools", "invalid_value") from None
    return ctx


def prompt_messages(serving, req) -> tuple[list[dict], dict]:
    """-> (messages, extra template variables: tools, chat_template_kwargs)."""
    try:
        msgs = transcript(req.messages, tool_format(serving), _has_template(serving))
    except ToolRequestError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    clash = sorted(set(kwargs) & set(_RESERVED))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {clash[0]!r}", "chat_template_kwargs", "invalid_value")
    tools = getattr(req, "tools", None)
    if tools and getattr(req, "tool_choice", None) != "none":
        kwargs["tools"] = tools
    return msgs, kwargs

"""Chat requests with tools: the checkpoint's tool-call format (chosen once, logged), the grammar, the
transcript the chat template reads, and the response's tool_calls (mlaserve/tools/)."""

from __future__ import annotations

import logging

from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.tools.formats import FORMATS
from mlaserve.tools.request import ToolContext, ToolRequestError, transcript
from mlaserve.tools.select import chat_formats

log = logging.getLogger("mlaserve.server")
_RESERVED = ("messages", "add_generation_prompt", "tools")


def set_chat_formats(serving, tool_override: str | None = None, reasoning_override: str | None = None) -> None:
    """Decide the served template's tool-call and reasoning parsers (the loader decided them for the checkpoint's
    own template; --chat-template may differ), record them in the config's provenance and in the log."""
    llm = serving.llm
    if serving.chat_template is not None:
        llm.config = chat_formats(
            llm.config, serving.chat_template, tool_override, reasoning_override, "--chat-template"
        )
    elif llm.config.chat.tool_call_parser is None or tool_override or reasoning_override:
        template = serving.tokenizer.chat_template if serving.tokenizer else None
        encoding = serving.tokenizer.encoding if serving.tokenizer else None  # the loader's (no template)
        llm.config = chat_formats(llm.config, template, tool_override, reasoning_override, encoding=encoding)
    serving.tool_format, serving.reasoning_parser = llm.config.chat.tool_call_parser, llm.config.chat.reasoning_parser
    for s in llm.config.provenance:
        if s.name in ("tool_call_parser", "reasoning_parser", "reasoning_grammar"):
            log.info("%s %s (%s)", s.name, s.value, s.source)


def tool_format(serving):
    if getattr(serving, "tool_format", None) is None:
        set_chat_formats(serving)
    return FORMATS[serving.tool_format]


def thinks(serving) -> bool:
    """The served template's chat output carries <think>...</think> to separate (reasoning_parser "think")."""
    if getattr(serving, "reasoning_parser", None) is None:
        set_chat_formats(serving)
    return serving.reasoning_parser == "think"


def _has_template(serving) -> bool:
    """The prompt is written by a template or a published encoding (which read tool_calls as calls), not by
    the plain transcript (which needs the calls written into the content)."""
    tok = serving.tokenizer
    return bool(serving.chat_template or (tok and (tok.chat_template or tok.encoding)))


def tool_context(serving, req) -> ToolContext | None:
    """The tools' grammar from the first token; a thinking request puts the reasoning block before it
    (chat.py: StructuredOutputs.after_reasoning, as for response_format)."""
    try:
        fmt = tool_format(serving)
        ctx = ToolContext.build(req.tools, req.tool_choice, req.parallel_tool_calls, fmt)
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

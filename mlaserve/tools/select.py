"""Which tool-call format a checkpoint speaks: its chat template's markers first (a template is what the
model was trained to read and write), then its model type. --tool-call-parser overrides. Whether its chat
output carries reasoning to separate: the template's `</think>`; --reasoning-parser overrides. Both are
decided once per served template (`chat_formats`) and recorded in the engine config's provenance, with
`reasoning_grammar`: where a grammar starts when the reasoning parser is on (after the reasoning). Without a
template, DeepSeek-V3.2 and V4 checkpoints are prompted with the encoding their releases publish instead
(`choose_encoding`, engine/dsml_encoding.py)."""

from __future__ import annotations

from dataclasses import replace

from mlaserve.config.engine import REASONING_PARSERS, EngineConfig
from mlaserve.config.provenance import Setting
from mlaserve.tools.formats import FORMATS

_BY_MODEL_TYPE = {
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",
    "kimi_k2": "kimi_k2",
    "glm4_moe": "glm45",
    "glm_moe_dsa": "glm45",
}


def choose_format(model_type: str | None, chat_template: str | None, override: str | None = None) -> tuple[str, str]:
    """-> (format name, why): the why is recorded in the server's log."""
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"tool_call_parser {override!r} is not one of {', '.join(sorted(FORMATS))}")
        return override, "user option (--tool-call-parser)"
    t = chat_template or ""
    if "｜DSML｜tool_calls" in t:
        return "deepseek_v4", "chat template writes <｜DSML｜tool_calls>"
    if "｜DSML｜" in t:
        return "deepseek_v32", "chat template writes DSML"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2", "chat template writes <|tool_calls_section_begin|>"
    if "<arg_key>" in t:
        return "glm45", "chat template writes <arg_key>"
    if "<｜tool▁sep｜>" in t:
        # V3 / R1 fence the arguments as ```json (their published templates write tool['type'] + '<｜tool▁sep｜>',
        # so the text "function<｜tool▁sep｜>" appears only once rendered); V3.1 writes NAME<｜tool▁sep｜>ARGS
        if "```json" in t or "function<｜tool▁sep｜>" in t or "'function' + '<｜tool▁sep｜>'" in t:
            return "deepseek_v3", "chat template writes function<｜tool▁sep｜>NAME and fenced JSON"
        return "deepseek_v31", "chat template writes NAME<｜tool▁sep｜>"
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type], f"model_type {model_type}"
    return "deepseek_v3", f"model_type {model_type!r} not known for tool calls: DeepSeek-V3's format"


def choose_encoding(model_type: str | None, chat_template: str | None, has_token) -> str | None:
    """The published prompt encoding (engine/dsml_encoding.py ENCODINGS) a checkpoint without a chat template
    is prompted with: DeepSeek-V3.2's and V4's releases ship a Python encoder instead of a template. Only
    where the vocabulary holds the encoding's <｜User｜> / <｜Assistant｜> tokens (a tokenizer without them, e.g.
    the embedded test model's, keeps the plain transcript). has_token(text) -> bool."""
    if chat_template or model_type not in ("deepseek_v32", "deepseek_v4"):
        return None
    return model_type if has_token("<｜User｜>") and has_token("<｜Assistant｜>") else None


def choose_reasoning(
    chat_template: str | None, override: str | None = None, encoding: str | None = None
) -> tuple[str, str]:
    """-> ("think" | "none", why). encoding: the published encoding used without a template."""
    if override is not None:
        if override not in REASONING_PARSERS:
            choices = ", ".join(c for c in REASONING_PARSERS if c is not None)
            raise ValueError(f"reasoning_parser {override!r} is not one of {choices}")
        return override, "user option (--reasoning-parser)"
    if chat_template and "</think>" in chat_template:
        return "think", "chat template writes </think>"
    if not chat_template and encoding is not None:
        return "think", f"{encoding} encoding (no chat template) writes </think>"
    return "none", "chat template has no </think>" if chat_template else "no chat template"


# How a constrained request (structured output, tools) meets the reasoning: decided with the reasoning parser;
# per request, the prompt says which block (structured/reasoning.py, entrypoints/openai/reasoning.py).
_REASONING_GRAMMAR = {
    "think": (
        "after_reasoning",
        "reasoning parser think: one grammar, the reasoning block (free text up to </think>; opened by the prompt "
        "or optionally by the model) then the constraint, rather than a matcher switched on at </think>",
    ),
    "none": ("from_first_token", "reasoning parser none: the grammar holds from the first token"),
}


def chat_formats(
    cfg: EngineConfig,
    chat_template: str | None,
    tool_override: str | None = None,
    reasoning_override: str | None = None,
    template_source: str = "",
    encoding: str | None = None,
) -> EngineConfig:
    """`cfg` with its tool-call and reasoning parsers decided for `chat_template` and recorded (the loader does
    it with the checkpoint's template; the server again with --chat-template's, whose name is template_source;
    encoding: the published encoding the prompt is written with when there is no template)."""
    tool, tool_why = choose_format(cfg.model.model_type, chat_template, tool_override)
    reasoning, reasoning_why = choose_reasoning(chat_template, reasoning_override, encoding)
    if template_source:
        tool_why, reasoning_why = (w.replace("chat template", template_source) for w in (tool_why, reasoning_why))
    new = (
        Setting("tool_call_parser", tool, tool_why),
        Setting("reasoning_parser", reasoning, reasoning_why),
        Setting("reasoning_grammar", *_REASONING_GRAMMAR[reasoning]),
    )
    names = {s.name for s in new}
    kept = tuple(s for s in cfg.provenance if s.name not in names)
    chat = replace(cfg.chat, tool_call_parser=tool, reasoning_parser=reasoning)
    return replace(cfg, chat=chat, provenance=kept + new)

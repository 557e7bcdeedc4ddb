"""Which tool-call format a checkpoint speaks: its chat template's markers first (a template is what the
model was trained to read and write), then its model type. --tool-call-parser overrides."""

from __future__ import annotations

from mlaserve.tools.formats import FORMATS

_BY_MODEL_TYPE = {
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v32",
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
        return override, "--tool-call-parser"
    t = chat_template or ""
    if "｜DSML｜" in t:
        return "deepseek_v32", "chat template writes DSML"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2", "chat template writes <|tool_calls_section_begin|>"
    if "<arg_key>" in t:
        return "glm45", "chat template writes <arg_key>"
    if "<｜tool▁sep｜>" in t:
        if "function<｜tool▁sep｜>" in t or "'function' + '<｜tool▁sep｜>'" in t:
            return "deepseek_v3", "chat template writes function<｜tool▁sep｜>NAME"
        return "deepseek_v31", "chat template writes NAME<｜tool▁sep｜>"
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type], f"model_type {model_type}"
    return "deepseek_v3", f"model_type {model_type!r} not known for tool calls: DeepSeek-V3's format"

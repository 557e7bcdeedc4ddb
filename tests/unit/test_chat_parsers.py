"""The chat output's parsers (tool-call format, reasoning separation): decided from the chat template, or set
by --tool-call-parser / --reasoning-parser (EngineOptions), recorded in provenance with the reason, shown by
`mlaserve inspect`; an unknown name is refused listing the choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlaserve.config.engine import TOOL_CALL_PARSERS
from mlaserve.config.model import ConfigError
from mlaserve.entrypoints.llm import LLM
from mlaserve.tools.formats import FORMATS
from mlaserve.tools.select import chat_formats, choose_reasoning


def _settings(cfg) -> dict:
    return {s.name: (s.value, s.source) for s in cfg.all_provenance()}


def test_the_option_vocabulary_is_the_formats():
    assert set(TOOL_CALL_PARSERS) - {None} == set(FORMATS)


def test_reasoning_from_the_template_or_the_option():
    assert choose_reasoning("{{ '<think>' }}...{{ '</think>' }}")[0] == "think"
    assert choose_reasoning("{{ m.content }}") == ("none", "chat template has no </think>")
    assert choose_reasoning(None) == ("none", "no chat template")
    assert choose_reasoning(None, "think") == ("think", "user option (--reasoning-parser)")
    with pytest.raises(ValueError, match="reasoning_parser 'r1' is not one of think, none"):
        choose_reasoning(None, "r1")


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the embedded model: DeepSeek-V3.2 layout, a template without think tags


def test_recorded_in_provenance(llm):
    got = _settings(llm.config)
    assert got["tool_call_parser"][0] == llm.config.chat.tool_call_parser == "deepseek_v32"
    assert got["reasoning_parser"][0] == llm.config.chat.reasoning_parser == "none"
    cfg = chat_formats(llm.config, "x</think>y", "glm45", None, "--chat-template")
    got = _settings(cfg)
    assert got["tool_call_parser"] == ("glm45", "user option (--tool-call-parser)")
    assert got["reasoning_parser"] == ("think", "--chat-template writes </think>")
    assert [s.name for s in cfg.provenance].count("tool_call_parser") == 1  # replaced, not appended twice


def test_options_override_and_unknown_names_are_refused():
    llm = LLM(tool_call_parser="kimi_k2", reasoning_parser="think")
    got = _settings(llm.config)
    assert got["tool_call_parser"] == ("kimi_k2", "user option (--tool-call-parser)")
    assert got["reasoning_parser"] == ("think", "user option (--reasoning-parser)")
    for name in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(ConfigError, match=f"{name} must be one of .*'(glm45|think)'.*got 'nope'"):
            LLM(**{name: "nope"})


def test_inspect_shows_them_and_the_cli_lists_choices():
    run = [sys.executable, "-m", "mlaserve.entrypoints.cli", "inspect", "--reasoning-parser", "think"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "deepseek_v32" in lines["tool_call_parser"] and "model_type deepseek_v32" in lines["tool_call_parser"]
    assert "think" in lines["reasoning_parser"] and "--reasoning-parser" in lines["reasoning_parser"]
    bad = subprocess.run(run[:-1] + ["r1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "invalid choice: 'r1'" in bad.stderr and "'think'" in bad.stderr

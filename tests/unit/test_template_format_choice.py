"""The publishers' chat templates (tests/fixtures/chat_templates, README there) select their own tool-call
format and the `think` reasoning parser by their markers, whatever the model type says: the format a
checkpoint is served with is the one its template renders calls in (test_tool_grammar_formats.py renders them).
DeepSeek-R1's template writes `tool['type'] + '<｜tool▁sep｜>'` and fenced JSON, never the text
`function<｜tool▁sep｜>`: it was taken for V3.1's format."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaserve.tools.select import choose_format, choose_reasoning

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def test_every_template_is_here():
    assert NAMES == ["deepseek_v3", "deepseek_v31", "glm45", "kimi_k2"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("model_type", [None, "deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_template_selects_its_format(name, model_type):
    template = (TEMPLATES / f"{name}.jinja").read_text()
    assert choose_format(model_type, template)[0] == name
    assert choose_reasoning(template) == ("think", "chat template writes </think>")

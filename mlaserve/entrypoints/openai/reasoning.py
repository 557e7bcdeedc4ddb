"""Reasoning separation: a thinking model's `<think>...</think>` goes to `reasoning_content`, the rest to
`content` (no think tags leak into either).

Thinking is on for a request when the reasoning parser is "think" (tools/select.py: the served chat
template writes `</think>`, or --reasoning-parser think) and either the rendered prompt ends with the
opener (DeepSeek-R1 / V3.1 / V3.2 thinking mode: the template writes `<think>` and the model continues
inside it) or the output itself begins with `<think>` (GLM-4.5..5). Reasoning parser "none" (a template
without think tags, e.g. the embedded model's plain transcript) leaves the text as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(serving, ids: list[int]) -> bool:
    return serving.decode(ids[-16:], skip_special_tokens=False).rstrip().endswith(OPEN)


@dataclass
class ReasoningSplitter:
    in_reasoning: bool  # the prompt ended inside <think>
    sent: dict = field(default_factory=dict)  # choice index -> (reasoning chars sent, content chars sent)

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str]:
        """-> (reasoning or None, content). Unfinished: what is sure so far (a tail that may become a
        tag is held back)."""
        t = text
        inside = self.in_reasoning
        if t.startswith(OPEN):
            inside, t = True, t[len(OPEN) :]
        elif not finished and OPEN.startswith(t):
            return ("" if inside else None), ""  # may still become <think>
        if not inside:
            return None, t
        at = t.find(CLOSE)
        if at < 0:
            return (t if finished else _hold(t, CLOSE)), ""
        return t[:at], t[at + len(CLOSE) :]

    def stream(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """-> (reasoning delta, the content so far) for one streamed choice."""
        reasoning, content = self.split(text, finished)
        sent = self.sent.get(index, 0)
        reasoning = reasoning or ""
        self.sent[index] = max(sent, len(reasoning))
        return reasoning[sent:], content


def _hold(text: str, tag: str) -> str:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return text[:-k]
    return text


def after_reasoning(spec):
    """A StructuredOutputs that lets the model finish its thinking (any text up to </think>) and then
    holds the answer to `spec`: the grammar never constrains the reasoning."""
    import json

    from mlaserve.structured.backend import _regex_literal
    from mlaserve.structured.spec import StructuredOutputs

    kind = spec.kind
    if kind == "json":
        inner = {"type": "json_schema", "json_schema": spec.schema}
    elif kind == "json_object":
        inner = {"type": "json_schema", "json_schema": {"type": "object"}}
    elif kind == "regex":
        inner = {"type": "regex", "pattern": spec.regex}
    elif kind == "choice":
        inner = {"type": "regex", "pattern": "|".join(_regex_literal(c) for c in spec.choice)}
    elif kind == "grammar":
        inner = {"type": "grammar", "grammar": spec.grammar}
    else:
        raise ValueError(f"structured {kind} cannot follow a model's reasoning")
    think = {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": [OPEN, CLOSE]}, "end": CLOSE}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [think, inner]}}
    return StructuredOutputs(structural_tag=json.dumps(tag))

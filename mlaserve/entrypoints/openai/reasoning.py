"""Reasoning separation: a thinking model's `<think>...</think>` goes to `reasoning_content`, the rest to
`content` (no think tags leak into either).

Thinking is on for a request when the reasoning parser is "think" (tools/select.py: the served chat
template writes `</think>`, or --reasoning-parser think) and either the rendered prompt ends with the
opener (DeepSeek-R1 / V3.1 / V3.2 thinking mode: the template writes `<think>` and the model continues
inside it) or the output itself begins with `<think>` (GLM-4.5..5). Reasoning parser "none" (a template
without think tags, e.g. the embedded model's plain transcript) leaves the text as it is.

A grammar starts where the reasoning ends (`reasoning_start`, then structured/reasoning.py): the prompt
opened `<think>` ("inside"), or left it to the model ("optional": Kimi-K2-Thinking, DeepSeek-R1's template
write no opener and the model writes `<think>` itself), or closed it ("off": thinking off, unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaserve.structured.reasoning import CLOSE, OPEN


@dataclass(frozen=True)
class ReasoningStart:
    """How a chat request's output may begin, decided from the rendered prompt before anything runs; a
    grammar (structured output, tools) starts after the reasoning: StructuredOutputs.after_reasoning."""

    mode: str  # "inside" | "optional" | "off" (structured/reasoning.py)
    why: str


def reasoning_start(thinks: bool, prompt_tail: str) -> ReasoningStart:
    """thinks: the reasoning parser is "think"; prompt_tail: the rendered prompt's last tokens as text."""
    if not thinks:
        return ReasoningStart("off", "reasoning parser none")
    tail = prompt_tail.rstrip()
    if tail.endswith(OPEN):
        return ReasoningStart("inside", f"the prompt opens {OPEN}")
    if tail.endswith(CLOSE):
        return ReasoningStart("off", f"the prompt closes the reasoning ({CLOSE}: thinking off)")
    return ReasoningStart("optional", f"the prompt leaves {OPEN} to the model")


def prompt_start(serving, ids: list[int], thinks: bool) -> ReasoningStart:
    return reasoning_start(thinks, serving.decode(ids[-16:], skip_special_tokens=False))


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

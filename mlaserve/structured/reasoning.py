"""A constraint that starts where the model's reasoning ends: one grammar, "reasoning block, then the
constrained part", for every kind of constraint (JSON schema, json_object, regex, choice, EBNF, and the
tool-call grammars of mlaserve/tools/, which are structural tags).

    StructuredOutputs(..., after_reasoning=MODE)    MODE (decided per request from the rendered prompt,
                                                    entrypoints/openai/reasoning.py reasoning_start):
    inside     the prompt opened <think>:           THOUGHT </think> CONSTRAINED
    optional   the prompt left <think> to the model (Kimi-K2-Thinking, DeepSeek-R1's template):
                                                    [<think> THOUGHT </think>] CONSTRAINED
    None       thinking off (the prompt closed the block, or no reasoning parser): CONSTRAINED alone,
               compiled exactly as before

    THOUGHT      any text without <think> or </think>: the reasoning is never constrained, cannot open a
                 second block, and the model cannot stop (EOS) before the constrained part
    CONSTRAINED  the request's constraint as one element of an xgrammar structural tag

Why a grammar and not a matcher switched on when </think> is generated (vLLM's way): the matcher then
follows every output token from the first, so what already keeps it right (MTP drafts checked and rolled
back token by token, preemption keeping the output tokens, n > 1, the batched mask) needs nothing new,
whereas a switch is a second piece of per-request state that speculative rollback and preemption would
have to restore; the end marker is recognised in bytes by the grammar whatever tokens spell it (five
byte-level tokens in the embedded vocabulary); and an output can never end inside the reasoning with no
constrained part (it can only be cut by max_tokens, reported as "length"). The cost is the mask filled
for the reasoning tokens too (free text: xgrammar's cheapest state).

Why not xgrammar's own per-model `reasoning=` of its tool-call tags: it differs by model (Kimi-K2's block
excludes nothing, GLM's excludes the tool markers, and "enabled" assumes the prompt opened <think>), and
response_format has none; here every format and every kind gets the same block.

The JSON element differs from the standalone JSON grammar in one way: xgrammar's structural-tag JSON
allows at least one whitespace character between tokens (`max_whitespace_cnt` 1, as the tool-call
grammars already use), where the standalone one allows none. The output validates either way.
"""

from __future__ import annotations

import json

from mlaserve.structured.spec import REASONING_MODES, choice_regex
from mlaserve.structured.strict import plain_length_strings

OPEN, CLOSE = "<think>", "</think>"
MODES = REASONING_MODES


def reasoning_block(mode: str) -> dict:
    """The structural-tag element of the reasoning block for `mode` (see the notation above)."""
    thought = {"type": "any_text", "excludes": [OPEN, CLOSE]}
    if mode == "inside":
        return {"type": "tag", "begin": "", "content": thought, "end": CLOSE}
    if mode == "optional":
        return {"type": "optional", "content": {"type": "tag", "begin": OPEN, "content": thought, "end": CLOSE}}
    raise ValueError(f"structured after_reasoning must be one of {', '.join(MODES)}, got {mode!r}")


def constrained_element(spec) -> dict:
    """The request's constraint (a StructuredOutputs of any kind) as a structural-tag element."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = plain_length_strings(spec.schema) if kind == "json" else {"type": "object"}
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if kind == "choice":
        return {"type": "regex", "pattern": choice_regex(spec.choice)}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec.grammar}
    tag = json.loads(spec.structural_tag)
    if "format" not in tag:
        raise ValueError(
            "structured structural_tag: the legacy form (structures / triggers) cannot follow a reasoning block; "
            'write it as {"type": "structural_tag", "format": ...}'
        )
    return tag["format"]


def after_reasoning_tag(spec) -> str:
    """The structural tag (JSON text) of `spec` preceded by its reasoning block (spec.after_reasoning)."""
    elements = [reasoning_block(spec.after_reasoning), constrained_element(spec)]
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}})

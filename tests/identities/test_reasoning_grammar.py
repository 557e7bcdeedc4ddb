"""On a thinking request the grammar starts where the reasoning ends (structured/reasoning.py): for every
tool-call format and every response_format kind, the constraint with its reasoning block ("inside": the prompt
opened <think>; "optional": the model may open it) is walked over the embedded model's byte-level tokens:
random reasoning (any allowed token, so '<', '/', 'th' appear), then `</think>` spelled in tokens, then a
random walk over what the grammar allows. The text is split as the server splits it (ReasoningSplitter) and
parsed as it parses it (ToolContext.message): the reasoning is exactly what was generated before `</think>`
(no marker in it), and the constrained part alone is the content, whose calls' arguments (or whose JSON)
validate. Thinking off leaves the grammar as it was; which mode a prompt gets is decided from the publishers'
own templates (tests/fixtures/chat_templates) and the DSML encodings."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch
from grammar_walk import byte_level_tokens_with

from mlaserve.entrypoints.openai.reasoning import ReasoningSplitter, reasoning_start
from mlaserve.sampling.token_mask import unpack_bitmask
from mlaserve.structured.reasoning import CLOSE, OPEN
from mlaserve.structured.spec import StructuredOutputs
from mlaserve.tools.formats import FORMATS
from mlaserve.tools.request import ToolContext

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


@pytest.fixture(scope="module")
def engine():
    from mlaserve import LLM

    return LLM().engine


def _allowed(matcher, vocab: int, avoid: set[int]) -> list[int]:
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    matcher.fill(mask, 0)
    return [t for t in unpack_bitmask(mask, vocab)[0].nonzero().flatten().tolist() if t not in avoid]


def _think_walk(engine, spec: StructuredOutputs, seed: int, open_block: bool, max_steps: int = 500):
    """-> (text, the reasoning as generated, or None when the walk did not end within max_steps).
    Reasoning: 0..24 random allowed tokens (none holding '>', so `</think>` is not spelled by chance),
    then `</think>`'s tokens; the rest: a random walk over the grammar until it allows and takes EOS."""
    rng = random.Random(seed)
    backend, tok = engine.grammar_backend(), engine.tokenizer
    vocab, stop = backend.vocab_size, set(engine.eos_ids)
    no_close = byte_level_tokens_with(tok, ord(">"))
    m = backend.matcher(spec)
    tokens: list[int] = []
    if open_block:
        tokens += tok.tok.encode(OPEN, add_special_tokens=False).ids
    for t in tokens:
        m.accept(t)  # raises when the grammar forbids it
    thought = []
    n = rng.randrange(25)
    while len(thought) < n or m.in_character:  # `</think>` only between characters (structured/utf8.py)
        allowed = _allowed(m, vocab, no_close)
        assert not stop & set(allowed), "the grammar lets the output end inside the reasoning"
        thought.append(rng.choice(allowed))
        m.accept(thought[-1])
    close = tok.tok.encode(CLOSE, add_special_tokens=False).ids
    for t in close:
        m.accept(t)
    tokens += thought + close
    reasoning = tok.decode(thought)
    for _ in range(max_steps):
        t = rng.choice(_allowed(m, vocab, set()))
        m.accept(t)
        if t in stop:
            assert m.is_terminated
            return tok.decode(tokens), reasoning
        tokens.append(t)
    return None, reasoning


def _split(mode: str, text: str, reasoning: str) -> str:
    """The server's split of `text`: the reasoning exactly as generated, no marker in either part."""
    got_reasoning, content = ReasoningSplitter(mode == "inside").split(text)
    assert got_reasoning == reasoning, (text, got_reasoning, reasoning)
    assert OPEN not in got_reasoning and CLOSE not in got_reasoning
    assert OPEN not in content and CLOSE not in content
    assert text.endswith(CLOSE + content)
    return content


@pytest.mark.parametrize("mode", ["inside", "optional"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_call_after_reasoning(engine, name, mode):
    ctx = ToolContext.build(TOOLS, "required", False, FORMATS[name])
    spec = replace(ctx.structured, after_reasoning=mode)
    ended = with_reasoning = 0
    for seed in range(6):
        text, reasoning = _think_walk(engine, spec, seed, open_block=mode == "optional")
        if text is None:
            continue
        ended += 1
        content = _split(mode, text, reasoning)
        msg, reason = ctx.message(content, "stop")
        assert reason == "tool_calls" and len(msg["tool_calls"]) == 1, (name, text)
        call = msg["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)
        if reasoning.strip():
            with_reasoning += 1
            assert reasoning not in (msg["content"] or "") + call["arguments"]
    assert ended >= 3 and with_reasoning >= 1, f"{name}/{mode}: {ended} walks ended, {with_reasoning} reasoned"


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "tag": {"enum": ["a", "b"]}},
    "required": ["n", "tag"],
}
KINDS = {
    "json": (StructuredOutputs(json=SCHEMA), lambda c: jsonschema.validate(json.loads(c), SCHEMA)),
    "json_object": (StructuredOutputs(json_object=True), lambda c: isinstance(json.loads(c), dict) or 1 / 0),
    "regex": (StructuredOutputs(regex="[a-c]{2}[0-9]"), lambda c: re.fullmatch("[a-c]{2}[0-9]", c) or 1 / 0),
    "choice": (StructuredOutputs(choice=["yes", "no"]), lambda c: c in ("yes", "no") or 1 / 0),
    "grammar": (
        StructuredOutputs(grammar='root ::= "x" [0-9] [0-9]?'),
        lambda c: re.fullmatch("x[0-9]{1,2}", c) or 1 / 0,
    ),
}


@pytest.mark.parametrize("mode", ["inside", "optional"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_response_format_after_reasoning(engine, kind, mode):
    base, check = KINDS[kind]
    spec = replace(base, after_reasoning=mode)
    ended = 0
    # an object of any keys: a random walk nests deep and ends in 3 of 10 walks of 800 tokens (measured)
    seeds, steps = (10, 800) if kind == "json_object" else (4, 120)
    for seed in range(seeds):
        text, reasoning = _think_walk(engine, spec, seed, open_block=mode == "optional", max_steps=steps)
        if text is None:
            continue
        ended += 1
        check(_split(mode, text, reasoning))
    assert ended >= 2, f"{kind}/{mode}: {ended} of {seeds} walks ended"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_block_is_optional_and_off_is_unchanged(engine, name):
    """An output without reasoning (a walk of today's grammar) is accepted by the "optional" grammar, not by the
    "inside" one (that one must reason first); thinking off keeps the tools' grammar as it was (no block)."""
    from grammar_walk import walk

    ctx = ToolContext.build(TOOLS, "required", False, FORMATS[name])
    # no reasoning block: no tag ends with </think> (GLM's free text still excludes the think markers)
    assert ctx.structured.after_reasoning is None and '"end": "</think>"' not in ctx.structured.structural_tag
    backend = engine.grammar_backend()
    for seed in range(6):
        tokens, ended = walk(backend, ctx.structured, set(engine.eos_ids), set(), random.Random(seed), 500)
        if ended:
            break
    assert ended
    eos = min(engine.eos_ids)
    optional = backend.matcher(replace(ctx.structured, after_reasoning="optional"))
    for t in tokens + [eos]:
        optional.accept(t)
    assert optional.is_terminated
    inside = backend.matcher(replace(ctx.structured, after_reasoning="inside"))
    for t in tokens:
        inside.accept(t)  # the call's text is reasoning text here (no marker in it) ...
    with pytest.raises(ValueError, match="not allowed"):
        inside.accept(eos)  # ... and the output cannot end before </think> and a call


def _render(name: str, **kwargs) -> str:
    from mlaserve.engine.dsml_encoding import ENCODINGS
    from mlaserve.engine.tokenizer import Tokenizer

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    if name in ENCODINGS:
        from mlaserve.engine.dsml_encoding import encode

        return encode(ENCODINGS[name], msgs, TOOLS, bool(kwargs.get("thinking")))
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"no published chat template at {path}")
    tok = Tokenizer(_embedded_tok(), {"chat_template": path.read_text()}, [])
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tools=TOOLS, **kwargs)


_TOK = []


def _embedded_tok():
    if not _TOK:
        from mlaserve.config.engine import make_options
        from mlaserve.embedded import default_model_path
        from mlaserve.loading.model_loader import open_checkpoint

        _TOK.append(open_checkpoint(default_model_path(), make_options()).tokenizer.tok)
    return _TOK[0]


# (format, template variables, mode): the publishers' templates and encodings, thinking on and off
PROMPTS = [
    ("deepseek_v31", {"thinking": True}, "inside"),
    ("deepseek_v31", {"thinking": False}, "off"),
    ("glm45", {}, "inside"),
    ("glm45", {"enable_thinking": False}, "off"),
    ("kimi_k2", {}, "optional"),  # Kimi-K2-Thinking writes no opener: the model writes <think> itself
    ("deepseek_v3", {}, "optional"),  # DeepSeek-R1's template likewise
    ("deepseek_v32", {"thinking": True}, "inside"),
    ("deepseek_v32", {"thinking": False}, "off"),
    ("deepseek_v4", {"thinking": True}, "inside"),
    ("deepseek_v4", {"thinking": False}, "off"),
]


@pytest.mark.parametrize("name,kwargs,mode", PROMPTS)
def test_mode_from_the_publishers_prompts(name, kwargs, mode):
    prompt = _render(name, **kwargs)
    assert reasoning_start(True, prompt[-64:]).mode == mode, prompt[-80:]
    assert reasoning_start(False, prompt[-64:]).mode == "off"  # reasoning parser none: never a block


def test_recorded_in_provenance():
    """The decision for the served template, with its reason (inspect, /debug/config, the startup log)."""
    from mlaserve import LLM
    from mlaserve.tools.select import chat_formats

    llm = LLM()
    got = {s.name: (s.value, s.source) for s in llm.config.all_provenance()}
    assert got["reasoning_grammar"][0] == "from_first_token"  # the embedded model's template has no think tags
    got = {s.name: (s.value, s.source) for s in chat_formats(llm.config, "x</think>y").provenance}
    assert got["reasoning_grammar"][0] == "after_reasoning" and "</think>" in got["reasoning_grammar"][1]


def test_bad_modes_and_legacy_tags_are_refused_by_name(engine):
    with pytest.raises(ValueError, match="after_reasoning must be one of inside, optional, got 'always'"):
        StructuredOutputs(regex="a", after_reasoning="always")
    legacy = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    with pytest.raises(ValueError, match="structured structural_tag: cannot be compiled: .*legacy form"):
        engine.check_params_structured(StructuredOutputs(structural_tag=legacy, after_reasoning="inside"))


def test_auto_tool_choice_after_reasoning(engine):
    """`auto` (the lazy call: free text until the start marker) after the reasoning: a walk that closes the
    reasoning, then spells the format's start marker, ends in a call that validates; the text before the
    marker is content, the reasoning is not in it."""
    fmt = FORMATS["deepseek_v31"]
    ctx = ToolContext.build(TOOLS, "auto", False, fmt)
    spec = replace(ctx.structured, after_reasoning="inside")
    backend, tok = engine.grammar_backend(), engine.tokenizer
    m = backend.matcher(spec)
    for t in tok.tok.encode("Plan: ask." + CLOSE + "Sure." + fmt.START, add_special_tokens=False).ids:
        m.accept(t)
    rng, avoid, tokens = random.Random(0), set(), []
    for _ in range(400):
        t = rng.choice(_allowed(m, backend.vocab_size, avoid))
        m.accept(t)
        if t in engine.eos_ids:
            break
        tokens.append(t)
    content = _split("inside", "Plan: ask." + CLOSE + "Sure." + fmt.START + tok.decode(tokens), "Plan: ask.")
    msg, reason = ctx.message(content, "stop")
    assert reason == "tool_calls" and msg["content"] == "Sure.", content
    jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]), WEATHER)

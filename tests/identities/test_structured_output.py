"""Structured output offline (LLM + SamplingParams(structured=...)) on the embedded model, which cannot
write JSON by itself: every output here is checked independently (jsonschema, re.fullmatch), never
against a recorded string."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlaserve import LLM, SamplingParams, StructuredOutputs
from mlaserve.sampling.sampler import SamplingBatch, sample
from mlaserve.sampling.token_mask import unpack_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
PROMPT = "And Jesus said unto them,"


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _json(spec, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 96), structured=StructuredOutputs(json=spec), **kw)


def _text(out) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for c in out.outputs]


def test_json_schema_validates_greedy_and_sampled(llm):
    params = [_json(PERSON, temperature=0.0)] + [_json(PERSON, temperature=1.0, seed=s) for s in range(5)]
    outs = llm.generate([PROMPT] * len(params), params)
    texts = set()
    for out in outs:
        ((text, reason),) = _text(out)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
        texts.add(text)
    assert len(texts) > 2  # sampling really sampled: the grammar did not force one output


def test_seeded_and_greedy_are_reproducible_and_batch_independent(llm):
    seeded = _json(PERSON, temperature=1.0, seed=7)
    greedy = _json(PERSON, temperature=0.0)
    alone = [llm.generate(PROMPT, p)[0].outputs[0].text for p in (seeded, greedy)]
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=40)
    # constrained and free requests in one step, prompts of other lengths, run twice
    for _ in range(2):
        outs = llm.generate(["In the beginning", PROMPT, PROMPT, "Hello"], [free, seeded, greedy, free])
        assert [o.outputs[0].text for o in outs[1:3]] == alone
        with pytest.raises(ValueError):
            json.loads(outs[0].outputs[0].text)  # the free row stayed free (KJV prose, not JSON)


def test_regex_choice_json_object_and_grammar(llm):
    regex = r"[0-9]{3}-[a-z]{2,5}"
    choices = ["yes", "no", "Lord (of hosts)"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured=StructuredOutputs(regex=regex)),
        SamplingParams(temperature=1.0, seed=2, max_tokens=40, n=4, structured=StructuredOutputs(choice=choices)),
        SamplingParams(temperature=0.0, max_tokens=40, structured={"grammar": grammar}),
    ]
    r, c, g = llm.generate([PROMPT] * 3, params)
    assert re.fullmatch(regex, r.outputs[0].text) and r.outputs[0].finish_reason == "stop"
    assert len(c.outputs) == 4 and all(t in choices and f == "stop" for t, f in _text(c))
    text, reason = _text(g)[0]
    assert reason in ("stop", "length") and re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)?", text)
    obj = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured={"json_object": True}))
    text, reason = _text(obj[0])[0]
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_max_tokens_reached_says_length(llm):
    ((text, reason),) = _text(llm.generate(PROMPT, _json(PERSON, temperature=0.0, max_tokens=3))[0])
    assert reason == "length"
    with pytest.raises(ValueError):
        json.loads(text)


def test_refusals_name_the_part(llm):
    with pytest.raises(ValueError, match="structured json: cannot be compiled: .*foo"):
        llm.generate(PROMPT, _json({"type": "foo"}))
    with pytest.raises(ValueError, match="structured regex: cannot be compiled"):
        llm.generate(PROMPT, SamplingParams(structured=StructuredOutputs(regex="a(")))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured .*min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs(regex="a+"))
    with pytest.raises(ValueError, match="structured .*unknown field"):
        SamplingParams(structured={"json_schema": {}})
    assert not llm.engine.has_unfinished()  # refused before anything was queued


def test_preemption_keeps_the_grammar(llm):
    small = LLM(num_pages=8, page_size=16, max_num_batched_tokens=64)  # 4 requests of ~100 tokens need > 8 pages
    params = [_json(PERSON, temperature=1.0, seed=s, max_tokens=110) for s in range(4)]
    outs = small.generate([PROMPT * 2] * 4, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for out, p in zip(outs, params):
        text, reason = _text(out)[0]
        assert text == llm.generate(PROMPT * 2, p)[0].outputs[0].text  # same as without preemption
        if reason == "stop":
            jsonschema.validate(json.loads(text), PERSON)


def test_speculative_decoding_obeys_the_grammar(llm):
    spec = LLM(speculative="mtp")
    greedy = _json(PERSON, temperature=0.0)
    # greedy: identical to plain decoding (the drafts are checked against the masked argmax)
    assert spec.generate(PROMPT, greedy)[0].outputs[0].text == llm.generate(PROMPT, greedy)[0].outputs[0].text
    params = [_json(PERSON, temperature=1.0, seed=s) for s in range(4)] + [SamplingParams(max_tokens=30, seed=1)]
    outs = spec.generate([PROMPT] * 5, params)
    assert sum(o.metrics.get("num_draft_tokens", 0) for o in outs) > 0  # drafts were verified
    for out in outs[:4]:
        text, reason = _text(out)[0]
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_logit_bias(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].token_ids
    forced = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={base[0]: -100}))
    assert forced[0].outputs[0].token_ids[0] != base[0]
    pushed = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=0, max_tokens=6, logit_bias={"77": 100}))
    assert pushed[0].outputs[0].token_ids == [77] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**7: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_bitmask_unpacking_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    V = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    logits = torch.randn(3, V, generator=g)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=V)
    allowed = unpack_bitmask(bitmask, V)
    assert torch.equal(torch.isinf(ref), ~allowed)
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * 3, [[1]] * 3, [[]] * 3, [None] * 3, V, token_bitmask=bitmask
    )
    assert torch.equal(sample(logits, batch).token_ids, ref.argmax(-1))


# ------------------------------------------------------------------ fuzz: random schemas

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["x", "y", 3, True, None]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    ),
    st.text(alphabet="ab", min_size=1, max_size=3).map(lambda s: {"const": s}),
)


def _node(children):
    keys = st.text(alphabet="abcdefgh", min_size=1, max_size=4)
    obj = st.dictionaries(keys, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req}
        )
    )
    arr = children.map(lambda item: {"type": "array", "items": item, "maxItems": 2})
    return st.one_of(obj, arr, st.lists(children, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}))


_schemas = st.recursive(_leaf, _node, max_leaves=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**16))
def test_fuzz_random_schemas_validate_or_refuse(llm, schema, seed):
    try:
        outs = llm.generate(PROMPT, _json(schema, temperature=1.0, seed=seed, max_tokens=160))
    except ValueError as e:
        assert str(e).startswith("prompt 0: structured json")  # refused at compile time, naming it
        return
    text, reason = _text(outs[0])[0]
    if reason == "length":  # cut by max_tokens: at least a prefix the grammar allowed
        return
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_chunked_prefill_and_prefix_cache_keep_the_output(llm):
    long_prompt = PROMPT + " And they went forth, and preached every where, the Lord working with them." * 3
    chunked = LLM(max_num_batched_tokens=16, page_size=16)  # the prompt is prefilled over several steps
    params = [_json(PERSON, temperature=0.0), _json(PERSON, temperature=1.0, seed=11)]
    want = [o.outputs[0].text for o in llm.generate([long_prompt] * 2, params)]
    for _ in range(2):  # the second time the prompt's pages come from the prefix cache
        outs = chunked.generate([long_prompt] * 2, params)
        assert [o.outputs[0].text for o in outs] == want
    assert outs[0].metrics["num_cached_prompt_tokens"] > 0
    for text in want:
        jsonschema.validate(json.loads(text), PERSON)

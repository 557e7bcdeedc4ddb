"""The grammar engine fuzzed wider than a model can afford: random JSON schemas (nested objects and arrays,
enum, const, anyOf, disjoint oneOf, $defs/$ref, type lists, string patterns / lengths / formats, integers
and numbers with inclusive and exclusive bounds, multipleOf) compiled for the embedded model's tokenizer, and
for each a random walk over the tokens the grammar allows (a seeded uniform choice per step, like a model
at temperature infinity: the hardest sampler for a grammar, since it takes every odd path). Every walk the
grammar lets end must parse and validate with jsonschema (the independent judge); a strict schema with a
part the engine does not enforce must be refused at construction, naming it. Bounded: ~150 schemas and at
most 400 tokens per walk, a few seconds."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from grammar_walk import walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlaserve.sampling.token_mask import unpack_bitmask
from mlaserve.structured.spec import StructuredOutputs
from mlaserve.structured.strict import unenforced

MAX_WALK = 400
PATTERNS = ["^[a-c]{1,3}$", "^x+y?$", "^[0-9]{2}-[0-9]{2}$", "^(ab|cd)*$", "[a-z]", "^\\w{2,4}$"]
FORMATS = ["date", "email", "ipv4", "uuid", "date-time"]
LOOSE_FORMATS = ("ipv4", "date", "date-time")  # xgrammar takes "01.2.3.4" (a leading zero), Feb 31, second 60


def _bounds(kind: str):
    num = st.integers(-1000, 1000) if kind == "integer" else st.floats(-1e3, 1e3, allow_nan=False).map(round_2)
    return st.fixed_dictionaries(
        {},
        optional={
            "minimum": num,
            "maximum": num,
            "exclusiveMinimum": num,
            "exclusiveMaximum": num,
            **({"multipleOf": st.integers(1, 7)} if kind == "integer" else {}),
        },
    ).map(lambda b: {"type": kind, **_consistent(b)})


def round_2(x: float) -> float:
    return round(x, 2)


def _consistent(b: dict) -> dict:
    """Keep bounds that leave some values (an empty range is a schema no output can meet: refused or cut)."""
    lo = max([b[k] for k in ("minimum", "exclusiveMinimum") if k in b], default=None)
    hi = min([b[k] for k in ("maximum", "exclusiveMaximum") if k in b], default=None)
    if lo is not None and hi is not None and hi - lo < 2 * b.get("multipleOf", 1) + 1:
        b = {k: v for k, v in b.items() if k not in ("maximum", "exclusiveMaximum")}
    return b


_string = st.one_of(
    st.tuples(st.integers(0, 4), st.integers(0, 6)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}
    ),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}),
)
_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    _bounds("integer"),
    _bounds("number"),
    _string,
    st.lists(st.sampled_from(["x", "y z", 3, -1.5, True, None]), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}
    ),
    st.sampled_from(["a", 7, None, False]).map(lambda c: {"const": c}),
    st.just({"type": ["integer", "null"], "maximum": 9}),
)


def _node(children):
    keys = st.text(alphabet="abcdefg_", min_size=1, max_size=5)
    obj = st.tuples(
        st.dictionaries(keys, children, min_size=1, max_size=4),
        st.booleans(),
        st.randoms(use_true_random=False),
    ).map(
        lambda t: {
            "type": "object",
            "properties": t[0],
            "required": sorted(k for k in t[0] if t[2].random() < 0.6),
            "additionalProperties": False if t[1] else True,
        }
    )
    arr = st.tuples(children, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs})
    one_of = st.just({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "null"}]})
    return st.one_of(obj, arr, any_of, one_of)


_tree = st.recursive(_leaf, _node, max_leaves=8)
# $ref resolves from the document's root: a $defs entry used twice, at the top
_schemas = st.one_of(
    _tree,
    _tree.map(
        lambda d: {
            "$defs": {"d": d},
            "type": "object",
            "properties": {"r": {"$ref": "#/$defs/d"}, "s": {"type": "array", "items": {"$ref": "#/$defs/d"}}},
            "required": ["r"],
        }
    ),
)


@pytest.fixture(scope="module")
def engine():
    from mlaserve import LLM

    return LLM().engine


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_random_walks_validate_or_refuse(engine, schema, seed):
    try:
        engine.check_params_structured(StructuredOutputs(json=schema))
    except ValueError as e:  # refused at compile time, naming the kind
        assert str(e).startswith("structured json")
        return
    backend = engine.grammar_backend()
    # every token the mask allows, surrogates and overlong forms included: xgrammar alone lets ED A0..BF xx and
    # E0 80..9F xx through (not UTF-8, decoded as U+FFFD each); the matcher's UTF-8 automaton masks them
    # (structured/utf8.py; this test found E0 8B AE breaking a maxLength)
    spec = StructuredOutputs(json=schema)
    tokens, ended = walk(backend, spec, set(engine.eos_ids), set(), random.Random(seed), MAX_WALK)
    if not ended:
        return  # the walk ran out of steps: nothing was claimed
    value = json.loads(engine.tokenizer.decode(tokens))
    jsonschema.validate(value, schema)  # structure; `format` is an annotation to JSON Schema's validators
    # and asserted where xgrammar's format grammar is exact (ipv4 and date-time are looser: docs/SERVING.md)
    jsonschema.validate(value, _without_formats(schema, LOOSE_FORMATS), format_checker=jsonschema.FormatChecker())


def _without_formats(schema, names):
    if isinstance(schema, list):
        return [_without_formats(s, names) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: _without_formats(v, names) for k, v in schema.items() if not (k == "format" and v in names)}


@settings(max_examples=40, deadline=None)
@given(schema=_schemas, bad=st.sampled_from([{"not": {"type": "null"}}, {"allOf": [{"minimum": 1}, {"maximum": 5}]}]))
def test_strict_refuses_what_is_not_enforced(schema, bad):
    wrapped = {"type": "object", "properties": {"p": schema, "q": bad}, "required": ["q"]}
    assert unenforced(wrapped)
    with pytest.raises(ValueError, match=r"#/properties/q: (not|allOf)"):
        StructuredOutputs(json=wrapped)
    StructuredOutputs(json=wrapped, strict=False)


def test_length_strings_are_json(engine):
    """xgrammar's own grammar for {"type": "string", "maxLength": n} takes a raw control character (not JSON,
    the fuzz found it); the backend compiles such strings as an exact pattern instead."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "string", "minLength": 1, "maxLength": 3}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert _is_grammar_accept_string(raw, '"a\x17"')  # the defect, still there upstream
    matcher = engine.grammar_backend().matcher(StructuredOutputs(json=schema))
    vocab = engine.grammar_backend().vocab_size
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    matcher.accept(engine.tokenizer.encode('"', add_special_tokens=False)[0])
    matcher.fill(mask, 0)
    allowed = unpack_bitmask(mask, vocab)[0]
    bad = [t for t in range(vocab) if allowed[t] and any(ord(c) < 32 for c in engine.tokenizer.decode([t]))]
    assert not bad, [engine.tokenizer.decode([t]) for t in bad[:5]]

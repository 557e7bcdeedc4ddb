"""`strict` in response_format.json_schema and in tools: OpenAI's meaning is "the output is guaranteed to
match the schema" (true) or "best effort" (false). Here the output is generated under the schema's grammar
either way; what strict decides is the promise. A strict request (true, or absent: the default here) whose
schema has a part the grammar engine does not enforce is refused naming the part; strict: false is served,
best effort. Each refused construct is shown, with jsonschema as the judge, to let an invalid string through
xgrammar's grammar (so the refusal is needed), and the accepted ones to hold."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mlaserve.structured.spec import StructuredOutputs
from mlaserve.structured.strict import unenforced
from mlaserve.tools.request import ToolRequestError, check_tools

# (schema, a string the schema refuses that xgrammar's grammar for it accepts)
UNENFORCED = [
    ({"not": {"type": "string"}}, '"a"'),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
    ({"type": "integer", "multipleOf": 5, "minimum": -130}, "59"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, '"abcdef@x.com"'),
]
# enforced exactly: (schema, a string the schema refuses, which the grammar refuses too)
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1.5"),
    ({"allOf": [{"type": "integer"}]}, '"s"'),
    ({"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"]}, '{"not":"x"}'),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^a"}]}, '"b"'),
]


def _grammar_accepts(schema, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


def _valid(schema, text: str) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


@pytest.mark.parametrize("schema,bad", UNENFORCED)
def test_unenforced_parts_are_refused_when_strict(schema, bad):
    assert not _valid(schema, bad) and _grammar_accepts(schema, bad)  # the grammar would let it through
    nested = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    assert unenforced(nested)[0].startswith("#/properties/x: ")
    for spec in ({"json": nested}, {"json": nested, "strict": True}):
        with pytest.raises(ValueError, match="#/properties/x: .*strict: false"):
            StructuredOutputs(**spec)
    assert StructuredOutputs(json=nested, strict=False).schema == nested  # best effort: served


@pytest.mark.parametrize("schema,bad", ENFORCED)
def test_enforced_parts_are_accepted(schema, bad):
    assert not _valid(schema, bad) and not _grammar_accepts(schema, bad)
    assert unenforced(schema) == []
    StructuredOutputs(json=schema)


def test_tools_strict():
    def tool(strict):
        fn = {"name": "f", "parameters": {"type": "object", "properties": {"n": {"not": {"type": "null"}}}}}
        if strict is not None:
            fn["strict"] = strict
        return [{"type": "function", "function": fn}]

    for strict in (None, True):
        with pytest.raises(ToolRequestError, match=r"tools\[0\].function.parameters: .*#/properties/n: not"):
            check_tools(tool(strict))
    assert check_tools(tool(False))
    with pytest.raises(ToolRequestError, match="strict must be a bool"):
        check_tools(tool("yes"))


def test_response_format_strict_through_the_server():
    from inproc_server import InProcServer

    from mlaserve.entrypoints.llm import LLM

    srv = InProcServer(LLM())
    try:
        schema = {"type": "object", "properties": {"n": {"allOf": [{"type": "integer"}, {"minimum": 2}]}}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "n?"}], "max_tokens": 40}
        for strict in ({}, {"strict": True}):
            rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, **strict}}
            r = srv.post("/v1/chat/completions", json={**body, "response_format": rf})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
            assert "#/properties/n: allOf with 2 subschemas" in r.json()["error"]["message"]
        rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": False}}
        r = srv.post("/v1/chat/completions", json={**body, "response_format": rf, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":  # generated under the grammar: JSON, an object
            assert isinstance(json.loads(choice["message"]["content"]), dict)
    finally:
        srv.stop()

"""llama.cpp's `grammar` (GBNF) and `json_schema` fields on /v1/completions: the output is generated under
them (checked with re.fullmatch / jsonschema, not against a recorded string); a grammar that does not
compile, or two constraints at once, is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from inproc_server import InProcServer

from mlaserve.entrypoints.llm import LLM

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}


@pytest.fixture(scope="module")
def server():
    srv = InProcServer(LLM())
    yield srv
    srv.stop()


def _complete(server, **kw):
    body = {"model": "tiny", "prompt": "And Jesus said unto them,", "max_tokens": 40, **kw}
    return server.post("/v1/completions", json=body)


def test_json_schema_and_grammar_constrain_the_output(server):
    for seed in range(3):
        r = _complete(server, json_schema=SCHEMA, temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
        r = _complete(server, grammar='root ::= ("yes" | "no") " " [0-9]', temperature=1.0, seed=seed)
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"(yes|no) [0-9]", r.json()["choices"][0]["text"])


def test_refusals_name_the_field(server):
    r = _complete(server, grammar="root ::= (")
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    r = _complete(server, grammar='root ::= "a"', json_schema=SCHEMA)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    r = _complete(server, json_schema={"type": "object", "properties": {"a": {"not": {}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema", r.text
    assert "#/properties/a: not" in r.json()["error"]["message"]

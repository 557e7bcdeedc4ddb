"""The OpenAPI document states what the server requires, and the server and the document agree both ways
on the shapes schemathesis found disagreeing (each case below was a 400 to data the document called
valid, or a 200 to data it called invalid, or a 500): non-empty `stop` strings, at most 16; `tools` a
non-empty list of {type: function, function: {name, ...}} with `parameters` an object schema or null; a
`tool_choice` other than none needs tools; `best_of` at most 1; exactly one structured-output kind
(null values do not count); `response_format` shapes and its exclusions; message `annotations` empty;
an assistant tool call's arguments the text of a JSON object (a JSON `true` was a 500 in the formats that
render the arguments' keys); `logit_bias` keys token ids below the vocabulary, values in [-100, 100].

For each body: the server's status, and whether the document's schema (jsonschema, Draft 2020-12) admits
it; a 4xx must be a body the document refuses, a 2xx one it admits."""

from __future__ import annotations

import jsonschema
import pytest
from inproc_server import InProcServer

from mlaserve.entrypoints.llm import LLM
from mlaserve.entrypoints.openai.protocol import _KIND_SCHEMAS
from mlaserve.structured.spec import KINDS

MSG = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def server():
    srv = InProcServer(LLM())
    yield srv
    srv.stop()


def _validator(server, path: str):
    doc = server.get("/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": doc["components"]})  # refs: #/components/...


def _call(server, path, body, ok: bool):
    r = server.post(path, json=body)
    admitted = _validator(server, path).is_valid(body)
    assert (r.status_code == 200) == ok, (r.status_code, r.text[:300])
    assert admitted == ok, f"document {'admits' if admitted else 'refuses'} {body} (server {r.status_code})"
    return r


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
CASES = [
    (COMP, {"prompt": "x", "max_tokens": 1, "stop": "s"}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "stop": [""]}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "stop": ["s"] * 17}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "best_of": 1}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "best_of": 2}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": ["a"], "regex": None}}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": ["a"], "regex": "b"}}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"json_object": False}}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": ["a"], "structural_tag": False}}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, False),
    # llama.cpp's fields: never with ignore_eos, nor with each other or structured_outputs; a grammar non-empty
    (COMP, {"prompt": "x", "max_tokens": 1, "grammar": 'root ::= "a"'}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "grammar": 'root ::= "a"', "ignore_eos": True}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "json_schema": {"type": "string"}, "ignore_eos": True}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "grammar": ""}, False),
    # a tool's strict is a bool or null
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": [{**FN, "function": {**FN["function"], "strict": None}}]}, True),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": [{**FN, "function": {**FN["function"], "strict": {}}}]}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 1.5}}, True),
    (COMP, {"prompt": "x", "max_tokens": 1, "logit_bias": {"05": 1.5}}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "logit_bias": {"999999": 1.5}}, False),
    (COMP, {"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 101}}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": [FN]}, True),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": [{"type": "function", "function": {"name": "f", "parameters": None}}]}, True),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": []}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tools": [{"type": "function", "function": {"name": ""}}]}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tool_choice": "required"}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tool_choice": "none"}, True),
    (CHAT, {"messages": MSG, "max_tokens": 1, "tool_choice": "sometimes", "tools": [FN]}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "response_format": {"type": "text"}, "ignore_eos": True}, True),
    (CHAT, {"messages": MSG, "max_tokens": 1, "response_format": {"type": "json_object"}, "ignore_eos": True}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, False),
    (CHAT, {"messages": MSG, "max_tokens": 1, "response_format": {"type": "xml"}}, False),
    (CHAT, {"messages": [{"role": "assistant", "content": "a", "annotations": []}, *MSG], "max_tokens": 1}, True),
    (CHAT, {"messages": [{"role": "assistant", "content": "a", "annotations": [{}]}, *MSG], "max_tokens": 1}, False),
]  # fmt: skip


@pytest.mark.parametrize("path,body,ok", CASES)
def test_server_and_document_agree(server, path, body, ok):
    _call(server, path, body, ok)


@pytest.mark.parametrize("arguments", ["true", "[1]", "1", '"s"', "null", "not json"])
def test_tool_call_arguments_must_be_a_json_object(server, arguments):
    """A JSON `true` as an assistant call's arguments was a 500 (AttributeError in the formats that
    render the arguments' keys): now a 400 naming the call, on /tokenize and the chat endpoint alike."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for path, body in (("/tokenize", {"messages": messages}), (CHAT, {"messages": messages, "max_tokens": 1})):
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert r.json()["error"]["message"] == "messages: tool_call 'f': arguments are not a JSON object"
    good = {
        "messages": [*MSG, {"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": "{}"})]}]
    }
    assert server.post("/tokenize", json=good).status_code == 200


def test_every_structured_kind_is_in_the_document():
    assert tuple(_KIND_SCHEMAS) == KINDS  # a new kind must be stated in the OpenAPI document too

"""Schemathesis hooks for tests/server/test_server_openapi.py (loaded by the CLI through SCHEMATHESIS_HOOKS).

Every check runs, `positive_data_acceptance` (ST202: a schema-valid request must be accepted) included.
Two refusals of schema-valid data are right and no JSON Schema can state them:
- a prompt plus max_tokens over the context (a sum of a length and another field's value; for text, a
  length in tokens). Dropped after checking that the refusal is true: status 400 with code
  `context_length_exceeded`, its numbers over the context the test server runs with, and the prompt
  length it names equal to what the request's prompt measures (token-id lists by their length, text by
  the server's /tokenize);
- an assistant message's tool-call `arguments` that are not the text of a JSON object (the document
  says `contentMediaType: application/json`, which a schema states but cannot enforce). Dropped after
  checking that the named call's arguments in the request really are not one.
- two tools with one name (a JSON Schema's uniqueItems compares whole items, not one field of them).
  Dropped after checking the named tool really repeats an earlier one's name;
- a `tool_choice` that names a function not among the request's `tools` (a value that must equal one
  in another field). Dropped after checking the name is really absent from the tools;
- a regex, grammar, JSON schema or structural tag that does not compile, in structured_outputs,
  response_format or llama.cpp's grammar / json_schema fields (a schema can say "a string",
  not "a regular expression that parses"). Dropped after checking that xgrammar, called here on the
  request's own value, refuses it too.
- a JSON schema or structural tag given as text that is not JSON, or as JSON of another kind than an object (a
  schema can say "a string", not "the text of a JSON object"). Dropped after checking that the request's own value
  really does not parse, or parses to something else (a JSON schema may also be a bool).
- an integer at the edge of a 64-bit bound (`seed` < 2**63): the generator compares such values as doubles,
  in which 2**63 + 191 equals 2**63, so it sends one it takes for valid. Dropped after checking, in exact
  integer arithmetic, that the named field's value really is outside the bound the refusal states.
Each dropped failure is appended to $ST_DROPPED (JSON lines) so the test can count them; anything else
stays a failure.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import schemathesis

OVER = re.compile(r"(max_tokens|max_completion_tokens) (\d+) \+ prompt (\d+) tokens exceed the context of (\d+) tokens")
TWICE = re.compile(r"tools: tools\[(\d+)\]: tool name (.*) appears twice")
NOT_AMONG = re.compile(r"tool_choice: names the function (.*), which is not among the tools")
NOT_COMPILED = re.compile(
    r"(structured_outputs|response_format|grammar|json_schema): structured (\w+): cannot be compiled: .*", re.S
)
NOT_JSON = re.compile(r"messages: tool_call (.*): arguments are not a JSON object")
NOT_JSON_TEXT = re.compile(
    r"(structured_outputs|response_format|grammar|json_schema)(?:\.\w+)?: structured (json|structural_tag):? "
    r"(?:the schema )?(?:is not valid JSON: .*|not valid JSON: .*|must be a JSON object, got \w+)",
    re.S,
)
INT_BOUND = re.compile(r"(\w+): Input should be (less than|greater than or equal to) (-?\d+)")
TOO_LONG = re.compile(r"prompt of (\d+) tokens does not fit the context \((\d+) tokens, one left to generate\)")


def _prompt_lengths(base: str, path: str, body: dict) -> set[int] | None:
    """The token counts of the request's prompts as the server measures them (None: not measurable here)."""
    if path.endswith("/v1/completions"):
        prompt = body.get("prompt")
        items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        out = set()
        for p in items:
            if isinstance(p, list):
                out.add(len(p))
            else:
                r = httpx.post(base + "/tokenize", json={"prompt": p}, timeout=30)
                if r.status_code != 200:
                    return None
                out.add(r.json()["count"])
        return out
    if body.get("tools") or body.get("chat_template_kwargs") or body.get("add_generation_prompt") is False:
        return None  # rendered differently from /tokenize's messages: the arithmetic is checked only
    r = httpx.post(base + "/tokenize", json={"messages": body.get("messages")}, timeout=30)
    return {r.json()["count"]} if r.status_code == 200 else None


def _arguments_not_json(body: dict, name: str, message: str) -> bool:
    """Whether the request holds an assistant tool call named `name` whose arguments do not parse."""
    for msg in body.get("messages") or []:
        for call in (msg.get("tool_calls") or []) if isinstance(msg, dict) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and repr(fn.get("name")) == name and isinstance(fn.get("arguments"), str):
                try:
                    is_object = isinstance(json.loads(fn["arguments"]), dict)
                except ValueError:
                    is_object = False
                if not is_object:
                    _record({"message": message, "arguments": fn["arguments"]})
                    return True
    return False


def _constraint(body: dict, field: str, kind: str):
    """The request's own constraint value that an error names by field and kind (None: absent)."""
    if field == "response_format":
        rf = body.get("response_format") or {}
        return (rf.get("json_schema") or {}).get("schema") if rf.get("type") == "json_schema" else None
    if field in ("grammar", "json_schema"):  # llama.cpp's fields on /v1/completions
        return body.get(field)
    return (body.get("structured_outputs") or {}).get(kind)


def _not_json_text(body: dict, field: str, kind: str) -> bool:
    """Whether the request's own constraint is text that does not parse as JSON, or a value (given as text or not)
    that is no JSON object (a JSON schema may also be a bool)."""
    value = _constraint(body, field, kind)
    if value is None:
        return False
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return True
    return not isinstance(value, (dict, bool) if kind == "json" else dict)


def _does_not_compile(body: dict, field: str, kind: str) -> bool:
    """Whether xgrammar refuses the request's own constraint (parsed without a tokenizer)."""
    import xgrammar as xgr

    value = _constraint(body, field, kind)
    if value is None:
        return False
    as_text = value if isinstance(value, str) else json.dumps(value)
    parse = {
        "json": lambda: xgr.Grammar.from_json_schema(as_text, any_whitespace=False, strict_mode=True),
        "regex": lambda: xgr.Grammar.from_regex(value),
        "grammar": lambda: xgr.Grammar.from_ebnf(value),
        "structural_tag": lambda: xgr.Grammar.from_structural_tag(as_text),
    }.get(kind)
    if parse is None:
        return False
    try:
        parse()
    except Exception:
        return True
    return False


def _record(entry: dict) -> None:
    if os.environ.get("ST_DROPPED"):
        with open(os.environ["ST_DROPPED"], "a") as f:
            f.write(json.dumps(entry) + "\n")


@schemathesis.hook
def filter_failure(ctx, failure, case, response) -> bool:
    """True: keep the failure. False only for a verified context overflow (see the module docstring)."""
    if failure.code != "ST202" or response.status_code != 400 or not isinstance(case.body, dict):
        return True
    try:
        err = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return True
    if m := NOT_JSON.fullmatch(err.get("message", "")):
        return not _arguments_not_json(case.body, m.group(1), err.get("message"))
    if m := TWICE.fullmatch(err.get("message", "")):
        names = [repr((t.get("function") or {}).get("name")) for t in case.body.get("tools") or []]
        index = int(m.group(1))
        twice = index < len(names) and names[index] == m.group(2) and names.index(m.group(2)) < index
        if twice:
            _record({"message": err["message"], "tools": names})
        return not twice
    if m := NOT_AMONG.fullmatch(err.get("message", "")):
        names = [repr((t.get("function") or {}).get("name")) for t in case.body.get("tools") or []]
        choice = case.body.get("tool_choice")
        named = repr(choice["function"].get("name")) if isinstance(choice, dict) else None
        absent = named == m.group(1) and named not in names
        if absent:
            _record({"message": err["message"], "tools": names})
        return not absent
    if m := INT_BOUND.fullmatch(err.get("message", "")):
        value, bound = case.body.get(m.group(1)), int(m.group(3))
        exact = isinstance(value, int) and not isinstance(value, bool) and err.get("param") == m.group(1)
        outside = exact and (value >= bound if m.group(2) == "less than" else value < bound)
        if outside:
            _record({"message": err["message"], "value": str(value)})
        return not outside
    if m := NOT_JSON_TEXT.fullmatch(err.get("message", "")):
        refused = _not_json_text(case.body, m.group(1), m.group(2))
        if refused:
            _record({"message": err["message"][:200]})
        return not refused
    if m := NOT_COMPILED.fullmatch(err.get("message", "")):
        refused = _does_not_compile(case.body, m.group(1), m.group(2))
        if refused:
            _record({"message": err["message"][:200]})
        return not refused
    if err.get("code") != "context_length_exceeded":
        return True
    context = int(os.environ["ST_CONTEXT"])
    message = err.get("message", "")
    if m := OVER.fullmatch(message):
        field, requested, prompt, ctx_len = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        ok = ctx_len == context and requested + prompt > context and err.get("param") == field
        ok = ok and requested == (case.body.get(field) if case.body.get(field) is not None else requested)
    elif m := TOO_LONG.fullmatch(message):
        prompt, ctx_len = int(m.group(1)), int(m.group(2))
        ok = ctx_len == context and prompt >= context
    else:
        return True
    base = os.environ["ST_BASE_URL"]
    lengths = _prompt_lengths(base, case.path, case.body)
    ok = ok and (lengths is None or prompt in lengths)
    if ok:
        _record({"path": case.path, "message": message, "measured": sorted(lengths or ())})
    return not ok

"""Request fields that constrain sampling: response_format, structured_outputs (vLLM), grammar and json_schema
(llama.cpp's, on /v1/completions), logit_bias, best_of.

-> the SamplingParams keywords `structured` and `logit_bias`. Everything is checked here, before the
request reaches the engine: a malformed constraint, or a schema / regex / grammar the grammar engine
cannot compile, is a 400 whose `param` names the field it came from.
"""

from __future__ import annotations

import functools
import re

from mlaserve.entrypoints.openai.errors import APIError
from mlaserve.structured.spec import KINDS, StructuredOutputs

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


@functools.cache
def below(n: int) -> str:
    """A regular expression matching exactly the decimal numbers 0 .. n-1 (no leading zeros): a token
    id written as a JSON object key, which a JSON Schema can bound only through its spelling."""
    top = str(n - 1)
    alts = ["0"] if n >= 1 else []
    for width in range(1, len(top)):  # every number with fewer digits than n - 1
        alts.append("[1-9]" + "[0-9]" * (width - 1) if width > 1 else "[1-9]")
    # as many digits as n - 1: a prefix of it, one smaller digit, then any digits; or n - 1 itself
    for i, digit in enumerate(top):
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            alts.append(top[:i] + f"[{low}-{int(digit) - 1}]" + "[0-9]" * (len(top) - i - 1))
    alts.append(top)
    return "^(?:" + "|".join(dict.fromkeys(alts)) + ")$"


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", field.split(".")[0], "invalid_value")


def from_response_format(rf: dict | None) -> StructuredOutputs | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise _bad("response_format.type", f"must be one of {', '.join(_RESPONSE_FORMATS)}, got {kind!r}")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(rf) - allowed)
    if unknown:
        raise _bad(f"response_format.{unknown[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format.json_schema", "must be an object {name, schema, strict}")
    unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise _bad(f"response_format.json_schema.{unknown[0]}", "unknown field")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise _bad("response_format.json_schema.name", "is required (a non-empty string)")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise _bad("response_format.json_schema.strict", f"must be a bool, got {js['strict']!r}")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise _bad("response_format.json_schema.schema", "is required (a JSON schema object)")
    # strict (true or absent): the output validates, or the schema is refused here; false: OpenAI's best effort,
    # still generated under the grammar of the schema (what the engine enforces of it holds)
    try:
        return StructuredOutputs(json=schema, strict=js.get("strict") is not False)
    except ValueError as e:
        raise _bad("response_format.json_schema.schema", str(e).removeprefix("structured json: ")) from None


def from_structured_outputs(so: dict | None) -> StructuredOutputs | None:
    if so is None:
        return None
    unknown = sorted(set(so) - set(KINDS))
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]}", f"not supported (supported: {', '.join(KINDS)})")
    set_ = {k: v for k, v in so.items() if v is not None and v is not False}
    if len(set_) != 1:
        raise _bad("structured_outputs", f"needs exactly one of {', '.join(KINDS)}, got {sorted(set_) or 'none'}")
    try:
        return StructuredOutputs(**set_)
    except (ValueError, TypeError) as e:
        raise _bad(f"structured_outputs.{next(iter(set_))}", str(e)) from None


def sampling_extras(serving, req, n: int) -> dict:
    """-> {"structured": ..., "logit_bias": ...} for SamplingParams; APIError 400 naming the field."""
    if req.best_of is not None and req.best_of > 1:
        raise _bad("best_of", f"best_of {req.best_of} is not supported (ask for n samples and rank them yourself)")
    spec, field = from_structured_outputs(req.structured_outputs), "structured_outputs"
    llama = {k: getattr(req, k, None) for k in ("grammar", "json_schema") if getattr(req, k, None) is not None}
    if llama:  # llama.cpp's /completion fields
        name = sorted(llama)[0]
        if spec is not None or len(llama) > 1:
            raise _bad(name, "grammar, json_schema and structured_outputs cannot be combined")
        try:
            spec = StructuredOutputs(grammar=llama[name]) if name == "grammar" else StructuredOutputs(json=llama[name])
        except ValueError as e:
            raise _bad(name, str(e)) from None
        field = name
    rf = getattr(req, "response_format", None)
    if rf is not None:
        if spec is not None:
            raise _bad("response_format", "cannot be combined with structured_outputs")
        spec, field = from_response_format(rf), "response_format"
    if spec is not None:
        if req.ignore_eos:
            raise _bad(field, "cannot be combined with ignore_eos")
        try:
            serving.llm.engine.check_params_structured(spec)
        except ValueError as e:
            raise _bad(field, str(e)) from None
    bias = None
    if req.logit_bias:
        bias = {}
        vocab = serving.llm.config.model.vocab_size
        for key, value in req.logit_bias.items():
            if not re.fullmatch(below(vocab), key):  # as the OpenAPI document states: no sign, no leading 0
                raise _bad("logit_bias", f"keys must be token ids in [0, {vocab}), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise _bad("logit_bias", f"values must be in [-100, 100], got {value} for token {key}")
            bias[int(key)] = value
    return {"structured": spec, "logit_bias": bias}

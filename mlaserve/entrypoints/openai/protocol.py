"""Request bodies of the OpenAI-compatible API as pydantic models (OpenAI's names and ranges).

Validation here rejects what is wrong in the body alone (types, ranges, empty prompts); what
depends on the model (context length, vocabulary, model name) is checked in serving.py. An unknown
field is a 400 naming it (a field mlaserve would ignore must not look honoured); `user`, which OpenAI's
clients may send, is accepted and has no effect on the output. Types are strict (JSON's own: `"n": "2"`,
`"n": 1.5` or `"echo": 0` are refused, not coerced), so the OpenAPI document states exactly what is
accepted; rules between fields are stated there too (`if`/`then`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_N = 16  # samples per prompt
MAX_LOGPROBS = 20  # top-N logprobs per token (OpenAI's limit)


def _json_int(v):
    """JSON's integers include 1.0 (JSON Schema says so); strings and booleans stay refused (strict)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


JSONInt = BeforeValidator(_json_int)  # after the constraints, so the schema states them
TokenId = Annotated[int, Field(ge=0), JSONInt]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


# JSON types as they are, and an unknown field refused naming it (never silently ignored)
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


# What entrypoints/openai/constraints.py and structured/spec.py require, stated for a generic client. A
# JSON Schema cannot say whether a regex, grammar or schema compiles; those stay 400s described in words.
STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        {"type": "null"},
    ]
}
_NON_EMPTY = {"type": "string", "minLength": 1}
_KIND_SCHEMAS = {
    "json": {"anyOf": [{"type": "object"}, {"type": "boolean"}, _NON_EMPTY]},
    "json_object": {"type": "boolean"},
    "regex": _NON_EMPTY,
    "choice": {"type": "array", "items": _NON_EMPTY, "minItems": 1},
    "grammar": _NON_EMPTY,
    "structural_tag": {"anyOf": [{"type": "object"}, _NON_EMPTY]},
}
_UNSET = {"enum": [None, False]}  # a kind given as null (or json_object false) is not asked for
STRUCTURED_OUTPUTS_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: {"anyOf": [v, _UNSET]} for k, v in _KIND_SCHEMAS.items()},
            # exactly one kind asked for
            "oneOf": [{"required": [k], "properties": {k: {"not": _UNSET}}} for k in _KIND_SCHEMAS],
        },
        {"type": "null"},
    ]
}
RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "additionalProperties": False,
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "additionalProperties": False,
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["name", "schema"],
                    "additionalProperties": False,
                    "properties": {
                        "name": _NON_EMPTY,
                        "schema": {"type": "object"},
                        "strict": {"type": ["boolean", "null"]},
                        "description": {},
                    },
                },
            },
        },
        {"type": "null"},
    ]
}
# A constraint on the output cannot be combined with another one, nor with ignore_eos (it must end).
_NOT_NULL = {"not": {"type": "null"}}
_NO_IGNORE_EOS = {"properties": {"ignore_eos": {"const": False}}}
STRUCTURED_RULES = [
    {
        "if": {"properties": {"structured_outputs": _NOT_NULL}, "required": ["structured_outputs"]},
        "then": _NO_IGNORE_EOS,
    }
]
# llama.cpp's grammar / json_schema (on /v1/completions): at most one of them and structured_outputs, and
# like every constraint never with ignore_eos
_LLAMA_FIELDS = ("grammar", "json_schema", "structured_outputs")
LLAMA_CPP_RULES = [
    {
        "if": {"properties": {k: _NOT_NULL}, "required": [k]},
        "then": {
            **_NO_IGNORE_EOS,
            "properties": {
                **_NO_IGNORE_EOS["properties"],
                **{o: {"type": "null"} for o in _LLAMA_FIELDS if o != k},
            },
        },
    }
    for k in ("grammar", "json_schema")
]
RESPONSE_FORMAT_RULES = [
    {
        "if": {"properties": {"response_format": _NOT_NULL}, "required": ["response_format"]},
        "then": {"properties": {"structured_outputs": {"type": "null"}}},
    },
    {
        "if": {
            "properties": {
                "response_format": {
                    "properties": {"type": {"enum": ["json_object", "json_schema"]}},
                    "required": ["type"],
                }
            },
            "required": ["response_format"],
        },
        "then": _NO_IGNORE_EOS,
    },
]


class SamplingFields(BaseModel):
    """Fields both endpoints share; None = the model's generation_config.json, else OpenAI's default."""

    model_config = STRICT

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Annotated[int, Field(ge=-1), JSONInt] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    n: Annotated[int, Field(ge=1, le=MAX_N), JSONInt] = 1
    stop: str | list[str] | None = Field(None, json_schema_extra=STOP_SCHEMA)
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63), JSONInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # an end-user id for the client's own tracking; no effect on the output
    # {token id (as a string, as JSON keys are): bias in [-100, 100]} (sampling/sampler.py)
    logit_bias: dict[str, float] | None = None
    # refused above 1 (entrypoints/openai/constraints.py, with a message saying what to do instead)
    best_of: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})
    # vLLM's extra body: one of json / json_object / regex / choice / grammar (mlaserve/structured/)
    structured_outputs: dict | None = Field(None, json_schema_extra=STRUCTURED_OUTPUTS_SCHEMA)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(  # max_tokens 0 only with echo (prompt scoring)
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
                    "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                },
                *STRUCTURED_RULES,
                *LLAMA_CPP_RULES,
            ]
        }
    )
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText | TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0), JSONInt] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = None
    echo: bool = False
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})  # insertion is not supported
    # llama.cpp's server fields: a GBNF grammar, or a JSON schema, the output is generated under (structured/)
    grammar: str | None = Field(None, json_schema_extra={"minLength": 1})
    json_schema: dict | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


# An assistant message's tool call, as tools/request.py `_check_call` takes it: the arguments are a JSON
# text (contentMediaType says so; a JSON Schema cannot make a string parse).
TOOL_CALL_SCHEMA = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "contentMediaType": "application/json"},
            },
        }
    },
}


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # an assistant's calls, rendered back through the chat template (tools/request.py `_check_call`)
    tool_calls: list[dict] | None = Field(None, json_schema_extra={"items": TOOL_CALL_SCHEMA})
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None
    # What the openai client's ChatCompletionMessage.model_dump() carries back: accepted while empty.
    refusal: str | None = None
    annotations: list | None = Field(None, json_schema_extra={"maxItems": 0})  # refused when not empty
    audio: None = None
    function_call: None = None

    @field_validator("annotations")
    @classmethod
    def _no_annotations(cls, v):
        if v:
            raise ValueError("message annotations are not supported")
        return v

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v):
        parts = v.get("content") if isinstance(v, dict) else None
        kinds = [p.get("type") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
        other = sorted({k for k in kinds if isinstance(k, str) and k != "text"})  # others: the type check
        if other:
            raise ValueError(f"this model takes text only: content parts of type {', '.join(other)} are not supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


# What tools/request.py requires of `tools` and `tool_choice`, stated in the OpenAPI document so that a
# generic client knows it (a JSON Schema cannot say that names are unique or that a forced name is among
# the tools; those stay 400s the document describes in words).
_TOOL_NAME = {"type": "string", "minLength": 1, "pattern": '^[^<>":\\n]+$'}
TOOLS_SCHEMA = {
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["type", "function"],
        "additionalProperties": False,
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": _TOOL_NAME,
                    "description": {},
                    "parameters": {
                        "anyOf": [{"type": "object", "properties": {"type": {"const": "object"}}}, {"type": "null"}]
                    },
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
    },
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _TOOL_NAME}},
            },
        },
        {"type": "null"},
    ]
}


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(  # top_logprobs only with logprobs: true; a tool_choice but "none" needs tools
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
                    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                },
                {
                    "if": {
                        "properties": {"tool_choice": {"not": {"enum": ["none", None]}}},
                        "required": ["tool_choice"],
                    },
                    "then": {"properties": {"tools": {"type": "array"}}, "required": ["tools"]},
                },
                *STRUCTURED_RULES,
                *RESPONSE_FORMAT_RULES,
            ]
        }
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1), JSONInt] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), JSONInt] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = None
    add_generation_prompt: bool = True
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict, description}}
    response_format: dict | None = Field(None, json_schema_extra=RESPONSE_FORMAT_SCHEMA)
    # function tools (mlaserve/tools/): the call is generated under a grammar built from their schemas
    tools: list[dict] | None = Field(None, json_schema_extra=TOOLS_SCHEMA)
    # none | auto | required | {"type": "function", "function": {"name"}}
    tool_choice: str | dict | None = Field(None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (e.g. thinking)


class TokenizePrompt(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # exactly one of prompt / messages
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeMessages(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_special_tokens: bool = True


TokenizeRequest = TokenizePrompt | TokenizeMessages


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[TokenId]

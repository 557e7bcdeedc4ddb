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
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63), JSONInt] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # an end-user id for the client's own tracking; no effect on the output
    # {token id (as a string, as JSON keys are): bias in [-100, 100]} (sampling/sampler.py)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1)  # refused above 1 (entrypoints/openai/constraints.py)
    # vLLM's extra body: one of json / json_object / regex / choice / grammar (mlaserve/structured/)
    structured_outputs: dict | None = None

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
            "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
            "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
        }
    )
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText | TokenIds], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0), JSONInt] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = None
    echo: bool = False
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})  # insertion is not supported
    # llama.cpp's server fields: a GBNF grammar, or a JSON schema, the output is generated under (structured/)
    grammar: str | None = None
    json_schema: dict | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, rendered back through the chat template
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None
    # What the openai client's ChatCompletionMessage.model_dump() carries back: accepted while empty.
    refusal: str | None = None
    annotations: list | None = None
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


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(  # top_logprobs only with logprobs: true
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1), JSONInt] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), JSONInt] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = None
    add_generation_prompt: bool = True
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict, description}}
    response_format: dict | None = None
    # function tools (mlaserve/tools/): the call is generated under a grammar built from their schemas
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # none | auto | required | {"type": "function", "function": {"name"}}
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

"""Request bodies of the OpenAI-compatible API as pydantic models (OpenAI's names and ranges).

Validation here rejects what is wrong in the body alone (types, ranges, empty prompts); what
depends on the model (context length, vocabulary, model name) is checked in serving.py. An unknown
top-level field is a 400 naming it (a field mlaserve would ignore must not look honoured); `user`, which
OpenAI's clients may send, is accepted and has no effect on the output.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16  # samples per prompt
MAX_LOGPROBS = 20  # top-N logprobs per token (OpenAI's limit)

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; None = the model's generation_config.json, else OpenAI's default."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
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
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText | TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # An unknown field is a 400 naming it (a message part mlaserve would drop must not look read).
    model_config = ConfigDict(extra="forbid")
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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict, description}}
    response_format: dict | None = None
    # function tools (mlaserve/tools/): the call is generated under a grammar built from their schemas
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # none | auto | required | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (e.g. thinking)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

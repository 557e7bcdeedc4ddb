"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from mlaserve.sampling.params import SamplingParams

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_SAMPLING_FIELDS = tuple(SamplingParams.__dataclass_fields__)


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def from_value_error(e: ValueError, prompt_field: str = "prompt") -> APIError:
    """A ValueError from SamplingParams (its message starts with the field) or from
    Engine.add_request (about the prompt: empty, ids outside the vocabulary, too long) -> 400."""
    msg = str(e)
    body = msg.split(": ", 1)[1] if msg.startswith("request ") and ": " in msg else msg  # "request <id>: ..."
    field = next((f for f in _SAMPLING_FIELDS if body.startswith(f + " ")), None)
    return APIError(400, msg, field or prompt_field, "invalid_value")


def from_pydantic(errors: list[dict]) -> APIError:
    """FastAPI's RequestValidationError.errors() -> 400 naming the first bad field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if any(_is_branch(p) for e in errors for p in e.get("loc", ())):  # a union of bodies (/tokenize):
        # the branch the client meant is the one not merely missing its field
        first = next((e for e in errors if e.get("type") not in ("missing", "extra_forbidden")), first)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_branch(p)]
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return APIError(400, f"invalid JSON body: {first.get('msg')}", None, "invalid_json")
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {first.get('msg')}", param, "invalid_value")


def _is_branch(part) -> bool:
    """A union member's name in an error location (pydantic names each model branch)."""
    return isinstance(part, str) and part[:1].isupper()

"""Per-request sampling parameters (vLLM-compatible names, defaults and ranges).

A `SamplingParams` is immutable and validated once, when the request arrives,
so that the sampler and the detokenizer can trust every field. Invalid values
raise `ValueError` naming the field and the value, which the API layer can pass
straight back to the client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mlaserve.structured.spec import StructuredOutputs

# Temperatures below this are treated as greedy decoding (as in vLLM): dividing
# logits by a tiny temperature overflows float32 and means "argmax" anyway.
SAMPLING_EPS = 1e-5
# torch.Generator.manual_seed takes any int in [-2^63, 2^64); n > 1 samples use seed .. seed + n - 1.
SEED_MIN, SEED_END = -(2**63), 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    Normalisation done in `__post_init__` (the object is frozen afterwards):
      * `stop` becomes a tuple of strings (None -> ()); `stop_token_ids` a tuple of ints.
      * `top_k == -1` becomes 0 (both mean "off").
      * float fields become `float`.
      * greedy requests (temperature < 1e-5) get top_p=1, top_k=0, min_p=0:
        those filters cannot change an argmax, and resetting them keeps greedy
        rows on the sampler's fast path.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]; 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off; applies to prompt + output tokens
    presence_penalty: float = 0.0  # [-2, 2]; applies to output tokens
    frequency_penalty: float = 0.0  # [-2, 2]; applies to output tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None = until the context is full
    min_tokens: int = 0  # EOS / stop_token_ids are masked until this many tokens exist
    stop: None | str | Sequence[str] = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema / JSON object / regex / choice / grammar
    # (mlaserve.structured.StructuredOutputs, or a dict of its fields).
    structured: StructuredOutputs | None = None
    # {token id: bias in [-100, 100]} added to the logits before every other stage (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)

        _check_int("n", self.n, minimum=1)

        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail("top_k", self.top_k, "must be -1, 0 (off) or >= 1")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                _fail(name, value, "must be in [-2, 2]")

        if self.seed is not None:
            _check_int("seed", self.seed)
            if not (SEED_MIN <= self.seed and self.seed + self.n - 1 < SEED_END):
                _fail("seed", self.seed, f"must be in [-2**63, 2**64 - n) (the generator's range; n={self.n})")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")

        set_("stop", _normalise_stop(self.stop))
        set_("stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                _fail(name, value, "must be a bool")

        set_("structured", _normalise_structured(self.structured, self))
        set_("logit_bias", _normalise_logit_bias(self.logit_bias))

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            set_(name, float(getattr(self, name)))
        if self.top_k == -1:
            set_("top_k", 0)
        if self.greedy:
            set_("top_p", 1.0)
            set_("top_k", 0)
            set_("min_p", 0.0)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (of the penalised logits)."""
        return self.temperature < SAMPLING_EPS

    def all_stop_token_ids(self, eos_token_id: int | None | Iterable[int]) -> frozenset:
        """Token ids that end the request: stop_token_ids, plus the EOS id(s) unless ignore_eos.
        Models may have several EOS ids (GLM: <|endoftext|>, <|user|>, <|observation|>)."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        return frozenset(ids)


# --------------------------------------------------------------------------- helpers


def _fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"{name} {rule}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    # bool is an int subclass; True as a count is almost certainly a bug.
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(name, value, "must be an int")
    if minimum is not None and value < minimum:
        _fail(name, value, f"must be >= {minimum}")


def _check_float(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(name, value, "must be a number")
    if not math.isfinite(value):
        _fail(name, value, "must be finite")


def _normalise_stop(stop: Any) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        _fail("stop", stop, "must be a str, a list of str or None")
    for s in stop:
        if not isinstance(s, str) or not s:
            _fail("stop", stop, "must contain only non-empty strings")
    return tuple(stop)


def _normalise_structured(spec: Any, params: SamplingParams) -> StructuredOutputs | None:
    if spec is None:
        return None
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(StructuredOutputs.__dataclass_fields__))
        if unknown:
            _fail("structured", spec, f"has unknown field(s) {', '.join(unknown)}")
        spec = StructuredOutputs(**spec)
    if not isinstance(spec, StructuredOutputs):
        _fail("structured", spec, "must be a StructuredOutputs (or a dict of its fields)")
    # The grammar decides when the output may end (it allows EOS only once complete): a floor on the
    # length or an ignored EOS would force tokens the grammar does not allow.
    if params.min_tokens:
        _fail("structured", spec.kind, f"cannot be combined with min_tokens ({params.min_tokens})")
    if params.ignore_eos:
        _fail("structured", spec.kind, "cannot be combined with ignore_eos")
    return spec


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        _fail("logit_bias", bias, "must be a dict {token id: bias}")
    out = {}
    for tok, value in bias.items():
        if isinstance(tok, str) and tok.lstrip("-").isdigit():
            tok = int(tok)  # JSON object keys are strings
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            _fail("logit_bias", bias, f"keys must be non-negative token ids, got {tok!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
            _fail("logit_bias", bias, f"values must be numbers in [-100, 100], got {value!r} for token {tok}")
        out[tok] = float(value)
    return out or None


def _normalise_stop_token_ids(ids: Any) -> tuple:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        _fail("stop_token_ids", ids, "must be a list of int or None")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            _fail("stop_token_ids", ids, "must contain only non-negative ints")
    return tuple(ids)

"""A request's life: prompt, sampled tokens, pages, and what it reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from mlaserve.engine.spec_switch import SpecState
from mlaserve.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a request is an entity, equal only to itself. The scheduler's queues find and remove
# requests with `in` / `remove`; field-by-field equality made each finish() compare every field of
# every queued request (2.2 s of 7.4 s for 1,000 short requests) and could remove a look-alike.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose latent rows are in the cache
    pages: list[int] = field(default_factory=list)
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache on admission
    num_disk_cached: int = 0  # of those, tokens whose pages were loaded from the disk tier (prefix_cache_dir)
    num_registered: int = 0  # leading pages already named in the prefix cache
    state_slot: int | None = None  # its slot of the request-addressed cache states while running (SlotPool)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    error: str | None = None  # why it finished with finish_reason "error"
    # Speculative decoding: the MTP's drafts for the tokens after the last one, verified next step.
    draft_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    num_verify_steps: int = 0  # steps that verified at least one draft
    spec: SpecState | None = None  # the acceptance switch's state (engine/spec_switch.py)
    # Structured output: the request's position in its grammar (mlaserve/structured/backend.Matcher); it
    # follows output_ids, which preemption keeps, so it survives preemption and recompute unchanged.
    # Speculative decoding never feeds it a draft: verification takes tokens one position at a time
    # under the mask of the tokens taken so far, so a rejected draft leaves nothing to roll back.
    matcher: object | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong, for the caller to report


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    prompt_logprobs: list[dict] | None = None

"""The rollback protocol: how a model with request states takes back what rejected drafts did to them.

A speculative verify step runs each verifying sequence's [last token, d_1 .. d_k] through every layer as one chunk,
and a request-addressed state (config/layer_kinds.py: a recurrent state, a conv window, a sliding ring, a compressor
carry) advances through all k + 1 tokens before the verdict is known. A model that can undo that says so
(`rolls_back`) and supplies the two halves of the protocol; the runner (executor/model_runner.py) calls them and
knows nothing of what a tape holds:

  before the step   tape = model.verify_tape(step, cache, request_ids)   what the model needs to undo the step for
                    the verifying sequences (None when none verifies); run after the slots' reset / restore
  during the step   model(input_ids, step, cache, native, tape=tape)    the layers add to it what they compute
  after the verdict model.rollback(tape, kept, cache, page_size)         kept[j] tokens of the tape's sequence j
                    stay (1 + accepted drafts); the states of the rest are put back as if never seen

Implemented by DeepSeek-V4 (models/deepseek_v4/rollback.py: ring, carries, overlap halves saved, the state update
replayed over the kept rows) and GLM-5.3-Flash (models/kda/rollback.py: each KDA layer's recurrent and conv states
saved, the recurrence replayed over the kept tokens). A model without request states needs none of it: its rejected
rows are never read and the next step rewrites them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlaserve.cache.model_cache import ModelCache
    from mlaserve.executor.step_context import StepContext


class StateTape(Protocol):
    """What a verify step keeps; the runner reads only which requests it covers, in the tape's order."""

    request_ids: tuple[str, ...]


class RollsBack(Protocol):
    """A model whose request states can be rolled back after a verify step (`rolls_back` True)."""

    rolls_back: bool

    def verify_tape(self, step: StepContext, cache: ModelCache, request_ids: tuple[str, ...]) -> StateTape | None:
        """request_ids: per sequence of the step (batch order). None when no sequence verifies drafts."""
        ...

    def rollback(self, tape: StateTape, kept: list[int], cache: ModelCache, page_size: int) -> None: ...

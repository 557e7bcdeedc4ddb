"""What speculative decoding needs from the engine, as a Protocol: engine/speculative.py is written
against this, not against Engine, so engine.py can call it without an import circle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from mlaserve.config.engine import EngineConfig
    from mlaserve.engine.request import Request, RequestOutput
    from mlaserve.engine.scheduler import ScheduledChunk, Scheduler
    from mlaserve.engine.spec_switch import SpeculationSwitch
    from mlaserve.executor.forward_batch import ForwardBatch
    from mlaserve.executor.model_runner import ModelRunner
    from mlaserve.sampling.sampler import SamplerOutput, SamplingBatch


class SpeculativeHost(Protocol):
    """The engine as the speculative step sees it: its parts, and the bookkeeping a step does for each
    request exactly as a plain step does it (so the outputs cannot differ)."""

    runner: ModelRunner
    cfg: EngineConfig
    scheduler: Scheduler
    spec_switch: SpeculationSwitch
    requests: dict[str, Request]
    max_model_len: int

    def sampling_batch(self, reqs: list[Request], logits: torch.Tensor) -> SamplingBatch:
        """The rows' sampling parameters as tensors on the logits' device."""
        ...

    def record_prompt_logprobs(self, chunks: list[ScheduledChunk], batch: ForwardBatch, logits: torch.Tensor) -> None:
        """Prompt logprobs of the chunks that asked; an error fails that request only."""
        ...

    def take_tokens(self, reqs: list[Request], out: SamplerOutput, now: float) -> None:
        """Append row i of `out` to reqs[i] (logprobs, stop rules, max_tokens); an error fails that
        request only."""
        ...

    def fail(self, req: Request, message: str) -> RequestOutput:
        """Finish a request with finish_reason "error"."""
        ...

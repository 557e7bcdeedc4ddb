"""The offline API: LLM(model=PATH, ...).generate(prompts, params) and .prompt_logits(ids)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from mlaserve.config.engine import make_options
from mlaserve.engine.engine import Engine
from mlaserve.engine.request import RequestOutput
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.loading.model_loader import load_model
from mlaserve.observability.trace import make_tracer
from mlaserve.platform.allocator import keep_freed_memory
from mlaserve.platform.threads import apply_threads
from mlaserve.sampling.params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """The offline engine. `model`: a Hugging Face folder or a .gguf file; None runs the embedded
    default model. Every other keyword is an engine option (`mlaserve.EngineOptions`: dtype,
    attention, mla_path, page_size, max_num_batched_tokens, device, attention_backend, ...).
    `trace`: a JSONL path or "memory" for the route ledger; `progress(done, total)`: load progress."""

    def __init__(self, model: str | None = None, *, trace=None, progress=None, **options) -> None:
        from mlaserve.embedded import default_model_path

        opts = make_options(**options)
        self.loaded = load_model(model or default_model_path(), opts, progress)
        self.config = self.loaded.config
        if self.config.malloc_tuning:
            keep_freed_memory()
        apply_threads(self.config.threads)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded.model, self.config, make_tracer(trace))
        self.engine = Engine(self.runner, self.tokenizer)
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        groups = [self._add(p, sp) for p, sp in zip(prompts, params)]
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [self._merge(text, ids, finals) for text, ids in groups]

    def _add(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[str]]:
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        base, rids = f"llm-{self._counter}", []
        self._counter += 1
        for j in range(params.n):
            # n samples = n requests; seeded ones get seed + j so they differ yet stay reproducible
            sub = replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            rids.append(self.engine.add_request(ids, sub, request_id=f"{base}/{j}"))
        return text, rids

    def _merge(self, text: str | None, rids: list[str], finals: dict[str, RequestOutput]) -> RequestOutput:
        outs = [finals[r] for r in rids]
        comps = [replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
        return RequestOutput(
            rids[0].split("/")[0], text, outs[0].prompt_token_ids, comps, True, outs[0].metrics, outs[0].prompt_logprobs
        )

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.loaded.path} has no tokenizer: pass token ids instead of text")
        return self.tokenizer.encode(text)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every prompt position [len, vocab] (float32), through the paged cache,
        in chunks of max_num_batched_tokens like a real prefill."""
        pool = self.engine.pool
        pages = pool.allocate(-(-len(token_ids) // self.config.page_size))
        try:
            return self.runner.prompt_logits("prompt_logits", list(token_ids), pages)
        finally:
            pool.release(pages)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)

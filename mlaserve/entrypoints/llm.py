"""The offline API: LLM(model=PATH, ...).generate(prompts, params) and .prompt_logits(ids)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
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
    `trace`: a JSONL path or "memory" for the route ledger; `progress(done, total)`: load progress.

    Thread safety: one LLM may be called from several threads. Calls are serialised by a lock (one
    `generate` / `prompt_logits` runs at a time; the others wait), so outputs never mix; requests of
    different threads are not batched together (a server's engine loop does that).
    Every call is validated completely before anything is queued: a bad prompt or parameter raises
    ValueError and leaves the engine as it was. A request that fails inside a step comes back with
    finish_reason "error" and the message in `outputs[i].error`."""

    def __init__(self, model: str | None = None, *, trace=None, progress=None, **options) -> None:
        from mlaserve.embedded import default_model_path

        opts = make_options(**options)
        path, tracer = model or default_model_path(), make_tracer(trace)
        if opts.tensor_parallel_size * opts.expert_parallel_size > 1:
            from mlaserve.distributed.group import start_tensor_parallel

            self.loaded, self.runner = start_tensor_parallel(path, opts, tracer, progress)
            weakref.finalize(self, self.runner.close)
        else:
            self.loaded = load_model(path, opts, progress)
            self.runner = ModelRunner(self.loaded.model, self.loaded.config, tracer)
        self.config = self.runner.cfg  # the loaded config with the cache's rules applied (model_runner.py)
        if self.config.runtime.malloc_tuning:
            keep_freed_memory()
        apply_threads(self.config.runtime.threads)
        self.tokenizer = self.loaded.tokenizer
        self.engine = Engine(self.runner, self.tokenizer)
        self._counter = 0
        self._lock = threading.RLock()

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any); the LLM cannot run steps afterwards."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        with self._lock:
            prompts = _as_prompt_list(prompts)
            params = (
                sampling_params
                if isinstance(sampling_params, list)
                else [sampling_params or SamplingParams()] * len(prompts)
            )
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
            checked = [self._check(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]  # all, then queue
            queued: list[str] = []
            try:
                groups = [self._add(text, ids, sp, queued) for text, ids, sp in checked]
                finals = self._run()
            except BaseException:  # nothing of this call stays queued for the next one
                self._withdraw(queued)
                raise
            return [self._merge(text, ids, finals) for text, ids in groups]

    def _run(self) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return finals

    def _withdraw(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)
        self.engine.step()  # hands back the aborted outputs; the engine then forgets them

    def _check(self, i: int, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Validate one prompt of a call without touching the engine: (text, ids, params)."""
        self.engine.check_params(params, f"prompt {i}")
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if text is not None else prompt
        return text, self.engine.check_prompt(ids, f"prompt {i}"), params

    def _add(
        self, text: str | None, ids: list[int], params: SamplingParams, queued: list[str]
    ) -> tuple[str | None, list[str]]:
        base, rids = f"llm-{self._counter}", []
        self._counter += 1
        for j in range(params.n):
            # n samples = n requests; seeded ones get seed + j so they differ yet stay reproducible
            sub = replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            rids.append(self.engine.add_request(ids, sub, request_id=f"{base}/{j}"))
            queued.append(rids[-1])
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
        """Next-token logits at every prompt position [len, vocab] (float32, on the CPU whatever the engine's
        device: it is a result handed to the caller, like generate's token ids), through the paged cache,
        in chunks of max_num_batched_tokens like a real prefill. The prompt follows generate's rule
        (ints in the vocabulary, 1 <= len < max_model_len). Non-finite logits raise FloatingPointError,
        as generate fails such a request."""
        with self._lock:
            ids = self.engine.check_prompt(token_ids, "prompt_logits")
            pool = self.engine.pool
            pages = pool.allocate(-(-len(ids) // self.config.cache.page_size))
            slots = self.engine.slots  # a model with request states: a slot for the prompt, as generate's
            slot = slots.allocate("prompt_logits") if slots is not None else None
            try:
                logits = self.runner.prompt_logits("prompt_logits", ids, pages, slot).cpu()
            finally:
                pool.release(pages)
                if slot is not None:
                    slots.free(slot, "prompt_logits")
        # generate's rule: non-finite logits fail the request, never reach the caller as numbers
        bad = (~torch.isfinite(logits.float().sum(-1))).nonzero().flatten()
        if len(bad):
            raise FloatingPointError(
                f"prompt_logits: non-finite logits (NaN/Inf) from prompt position {int(bad[0])} on "
                f"({len(bad)} of {len(ids)} positions); the weights or config may hold NaN/Inf: "
                "run `mlaserve verify --check-tensors` on the model"
            )
        return logits


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(
            f"prompts must be a str, a list of token ids or a list of prompts, got {type(prompts).__name__}"
        )
    if len(prompts) and not any(isinstance(t, (str, Sequence, np.ndarray)) for t in prompts):
        return [list(prompts)]
    return list(prompts)

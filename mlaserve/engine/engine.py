"""The engine loop: add_request, step() -> outputs, abort. One forward pass per step for the
whole batch; sampling for every request that needs a token, in one batched call.

Lifecycle: a request's state (scheduler entry, pages, detokenizer) lives from add_request until
step() returns its final output (finished=True); then the engine forgets it. abort() frees the
pages at once, and the next step() returns the final output with finish_reason "abort". No caller
has to release anything, so a long-running server's dictionaries stay at the size of its live work.

Nothing silently wrong: a request is checked completely at the door (`check_prompt`, and
SamplingParams checks itself), so a bad one is refused before anything is queued. Inside a step, an
exception while handling one request's output (detokenizer, stop checks, logprobs) or a non-finite
logits row fails that request alone (finish_reason "error", the message in CompletionOutput.error,
its pages freed); an exception in the forward pass fails the requests of that step, and the engine
stays usable for the next.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from mlaserve.cache.page_pool import PagePool
from mlaserve.cache.slot_pool import SlotPool
from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.greedy_pick import argmax_finite
from mlaserve.engine.request import CompletionOutput, Request, RequestOutput, Status
from mlaserve.engine.scheduler import ScheduledChunk, SchedulePlan, Scheduler
from mlaserve.engine.spec_switch import SpeculationSwitch
from mlaserve.engine.speculative import speculative_step
from mlaserve.engine.tokenizer import Tokenizer
from mlaserve.executor.forward_batch import ForwardBatch
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.sampling.params import SamplingParams
from mlaserve.sampling.sampler import (
    SamplerOutput,
    SamplingBatch,
    gather_logprobs,
    make_generator,
    plain_greedy,
    sample,
)
from mlaserve.structured.backend import fill_bitmask

_GRAMMAR_LOCK = threading.Lock()


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None) -> None:
        cfg = runner.cfg
        self.runner, self.tokenizer, self.cfg = runner, tokenizer, cfg
        self.pool = PagePool(cfg.cache.num_pages, cfg.cache.enable_prefix_caching)
        # a state slot per running request when the model keeps request-addressed states (cache/slot_pool.py)
        self.slots = SlotPool(runner.cache.num_slots) if runner.cache.num_slots else None
        max_len = cfg.cache.num_pages * cfg.cache.page_size
        self.scheduler = Scheduler(
            self.pool,
            cfg.cache.page_size,
            cfg.scheduler.max_num_batched_tokens,
            cfg.scheduler.max_num_seqs,
            self.slots,
            runner.disk_tier,
        )
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, for the next step()
        eos = list(tokenizer.eos_token_ids) if tokenizer else list(cfg.model.eos_token_ids)
        self.eos_ids = frozenset(eos)
        self.max_model_len = min(max_len, cfg.model.max_position_embeddings)
        self.step_count = 0
        self._noted_context_limit = False
        self._grammar = None  # structured/backend.GrammarBackend, built at the first structured request
        # Speculative decoding's acceptance switch (per request state, an engine-wide prior).
        self.spec_switch = SpeculationSwitch(
            cfg.speculative.min_acceptance, cfg.speculative.probe_interval, cfg.speculative.acceptance_weight
        )

    def check_prompt(self, prompt_ids, request_id: str = "prompt") -> list[int]:
        """The one rule for every prompt (generate, prompt_logits, the server): a sequence of ints
        (numpy ints too; not bool, float or str), each in [0, vocab_size), 1 <= length < max_model_len
        (room for at least one more token). -> the ids as plain ints; ValueError naming the request."""
        return check_prompt(prompt_ids, self.cfg.model.vocab_size, self.max_model_len, request_id)

    def check_params(self, params: SamplingParams, who: str = "request") -> None:
        """The fields SamplingParams cannot judge alone: those bounded by this model's vocabulary."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{who}: sampling params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.cfg.model.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{who}: {name} must be <= the vocabulary size {vocab}, got {value}")
        bad = sorted(t for t in (params.logit_bias or {}) if t >= vocab)
        if bad:
            raise ValueError(f"{who}: logit_bias token id {bad[0]} outside the vocabulary [0, {vocab})")
        if params.structured is not None:
            try:
                self.check_params_structured(params.structured)
            except ValueError as e:
                raise ValueError(f"{who}: {e}") from None

    def check_params_structured(self, spec) -> None:
        """Whether this engine can run a StructuredOutputs: compiles it (cached); ValueError if not."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        self.grammar_backend().compile(spec)  # a spec that cannot compile is refused here

    def grammar_backend(self):
        """The grammar engine over this model's vocabulary (built once, on first use; any thread)."""
        with _GRAMMAR_LOCK:
            if self._grammar is None:
                from mlaserve.structured.backend import GrammarBackend

                self._grammar = GrammarBackend(self.tokenizer, self.cfg.model.vocab_size, sorted(self.eos_ids))
        return self._grammar

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ids = self.check_prompt(prompt_ids, f"request {rid}")
        self.check_params(params, f"request {rid}")
        req = Request(rid, ids, params)
        if params.structured is not None:  # compiled (or found in the cache) now: a bad spec never queues
            req.matcher = self.grammar_backend().matcher(params.structured)
        if params.seed is not None:
            req.generator = make_generator(params.seed)
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(
                self.tokenizer.tok,
                list(ids),
                params.skip_special_tokens,
                params.stop or (),
                params.include_stop_str_in_output,
            )
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages now; its final output (finish_reason "abort") comes
        with the next step(). False when the id is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._finish(req, "abort")
        self._aborted.append(self._output(req))
        self._forget(req.request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        aborted, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        # prefix pages read from disk fill their pages before anything reads them: also when the request that
        # found them could not be admitted (its pages stay named in the prefix cache, so they must hold the rows)
        if plan.disk_loads:
            self.runner.load_pages([d.page for d in plan.disk_loads], [d.parts for d in plan.disk_loads])
        if not plan.chunks:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not place any request: the page pool is too small")
            return aborted
        step_no, self.step_count = self.step_count, self.step_count + 1
        try:
            return aborted + self._step(plan, step_no)
        finally:
            self._write_new_pages()

    def _write_new_pages(self) -> None:
        """Hand the pages named this step to the disk tier: one gather per cache tensor (a copy), the file
        writes on its thread."""
        new = self.scheduler.drain_new_pages()
        if new and self.runner.disk_tier is not None:
            gathered = self.runner.gather_pages([p for p, _, _ in new])
            self.runner.disk_tier.submit([(h, ids) for _, h, ids in new], gathered)

    def _step(self, plan: SchedulePlan, step_no: int) -> list[RequestOutput]:
        aborted: list[RequestOutput] = []
        if self.runner.drafter is not None:  # verify the drafts, accept, draft again (engine/speculative.py)
            try:
                speculative_step(self, plan, step_no)
            except Exception as e:  # the whole step is lost: its requests fail, the engine goes on
                msg = f"step {step_no}: speculative step failed: {type(e).__name__}: {e}"
                return aborted + self._forget_finished([self.fail(r, msg) for r in self._touched(plan)])
            return aborted + self._forget_finished([self._final_or_output(r) for r in self._touched(plan)])
        chunks = [c.to_seq_chunk(self.cfg.cache.page_size) for c in plan.chunks]
        try:
            batch, logits = self.runner.execute(chunks, plan.preempted)
        except Exception as e:  # the whole step is lost: its requests fail, the engine goes on
            msg = f"step {step_no}: forward pass failed: {type(e).__name__}: {e}"
            return aborted + self._forget_finished([self.fail(r, msg) for r in self._touched(plan)])
        self.scheduler.advance(plan)
        by_id = {rid: row for row, (rid, _) in enumerate(batch.logits_owner)}  # last row per request
        self.record_prompt_logprobs(plan.chunks, batch, logits)
        sampling = [c.request for c in plan.chunks if c.completes_prompt and c.request.status is Status.RUNNING]
        if sampling:
            rows = [by_id[r.request_id] for r in sampling]
            if rows != list(range(logits.shape[0])):  # else every row in order (a decode step): no gather
                logits = logits[torch.tensor(rows, device=logits.device)]
            self._sample_finite(sampling, logits, step_no)
        return aborted + self._forget_finished([self._final_or_output(r) for r in self._touched(plan)])

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return outputs

    def _sample_finite(self, reqs: list[Request], logits: torch.Tensor, step_no: int) -> None:
        """Sample the rows that are finite; a row with NaN/Inf fails its request (never token 0 forever)."""
        # Rows that are all plain greedy take the argmax and the finite check in one pass (greedy_pick); else a NaN or
        # Inf anywhere in a row makes its sum non-finite (finite logits are far too small to overflow fp32): one
        # reduction instead of a [rows, vocab] bool tensor, ~9x cheaper on CPU.
        greedy = all(r.matcher is None and plain_greedy(r.params, len(r.output_ids)) for r in reqs)
        picked, finite = argmax_finite(logits) if greedy else (None, torch.isfinite(logits.float().sum(-1)).tolist())
        for req, ok in zip(reqs, finite):
            if not ok:
                self.fail(
                    req,
                    f"request {req.request_id}: non-finite logits (NaN/Inf) at step {step_no}; the weights or "
                    "config may hold NaN/Inf: run `mlaserve verify --check-tensors` on the model",
                )
        keep = [i for i, ok in enumerate(finite) if ok]
        if not keep:
            return
        reqs = [reqs[i] for i in keep]
        if picked is not None:  # what sample() gives these rows, without their parameter tensors
            self.take_token_ids(reqs, [picked[i] for i in keep], time.monotonic())
            return
        if len(keep) < len(finite):
            logits = logits[keep]
        try:
            out = self._sample(reqs, logits)
        except Exception as e:  # a batched sampler error cannot be pinned on one row
            for req in reqs:
                self.fail(req, f"step {step_no}: sampling failed: {type(e).__name__}: {e}")
            return
        self.take_tokens(reqs, out, time.monotonic())

    def _sample(self, reqs: list[Request], logits: torch.Tensor):
        # logprobs computed iff some row asked (batch.max_num_logprobs)
        return sample(logits, self.sampling_batch(reqs, logits))

    def sampling_batch(self, reqs: list[Request], logits: torch.Tensor) -> SamplingBatch:
        """The rows' sampling parameters as tensors on the logits' device (plain and speculative steps)."""
        return SamplingBatch.build(
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [r.generator for r in reqs],
            logits.shape[-1],
            eos_token_id=tuple(self.eos_ids),
            device=logits.device,
            token_bitmask=fill_bitmask([r.matcher for r in reqs], logits.shape[-1]),
        )

    # --- the per-request bookkeeping of a step, shared with speculative steps (engine/spec_host.py)

    def record_prompt_logprobs(self, chunks: list[ScheduledChunk], batch: ForwardBatch, logits: torch.Tensor) -> None:
        """Prompt logprobs of the chunks that asked; an error fails that request only."""
        for c in chunks:
            self._isolated(c.request, "prompt logprobs", self._prompt_logprobs, c, batch, logits)

    def take_tokens(self, reqs: list[Request], out: SamplerOutput, now: float) -> None:
        """Append row i of `out` to reqs[i] (logprobs, stop rules, max_tokens); an error fails that
        request only."""
        self.take_token_ids(reqs, out.token_ids.tolist(), now, out)  # one copy out, not two tensor ops per row

    def take_token_ids(self, reqs: list[Request], ids: list[int], now: float, out: SamplerOutput | None = None) -> None:
        """take_tokens with the tokens as ints; out: the sampler's output where a row asked for logprobs (None: no
        row did)."""
        for i, req in enumerate(reqs):
            self._isolated(req, "output", self._take_token, req, ids[i], out, i, now)

    def _take_token(self, req: Request, tok: int, out: SamplerOutput | None, i: int, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            req.logprobs.append(_logprob_entry(out.logprob_token_ids[i], out.logprobs[i], req.params.logprobs))
        self._append(req, tok)

    def _prompt_logprobs(self, c, batch, logits: torch.Tensor) -> None:
        """Logprob of each next prompt token (+ top-N) from the all-position logits of prompt chunks.
        Entry k is for prompt position k; a recomputed prefill (after preemption) appends only the
        positions not recorded yet."""
        req, n = c.request, c.request.params.prompt_logprobs
        if n is None or c.start >= len(req.prompt_ids):
            return
        rows = [row for row, (rid, _) in enumerate(batch.logits_owner) if rid == req.request_id]
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no context
        have = len(req.prompt_logprobs)  # entries for positions 0 .. have-1 exist
        positions = range(c.start, c.start + len(rows))
        keep = [(row, p) for row, p in zip(rows, positions) if have <= p + 1 < len(req.prompt_ids)]
        if not keep:
            return
        lp = logits[[row for row, _ in keep]].log_softmax(-1)
        nxt = torch.tensor([req.prompt_ids[p + 1] for _, p in keep], device=lp.device)
        values, ids, _ = gather_logprobs(lp, nxt, n)
        req.prompt_logprobs.extend(_logprob_entry(ids[j], values[j], n) for j in range(len(keep)))

    def _isolated(self, req: Request, what: str, fn, *args) -> None:
        """Run one request's share of the step's bookkeeping; an exception fails that request only."""
        if req.status is Status.FINISHED:
            return
        try:
            fn(*args)
        except Exception as e:
            self.fail(req, f"request {req.request_id}: {what} failed: {type(e).__name__}: {e}")

    def fail(self, req: Request, message: str) -> RequestOutput:
        """Finish a request with finish_reason "error": pages freed, state forgotten after its output."""
        if req.status is not Status.FINISHED:
            req.error = message
            self._detok.pop(req.request_id, None)  # it may be what broke
            req.finish_time = time.monotonic()
            self.scheduler.finish(req, "error")
        return self._output(req)

    def _final_or_output(self, req: Request) -> RequestOutput:
        try:
            return self._output(req)
        except Exception as e:
            return self.fail(req, f"request {req.request_id}: output failed: {type(e).__name__}: {e}")

    def _append(self, req: Request, tok: int) -> None:
        p = req.params
        if tok in p.all_stop_token_ids(self.eos_ids) and len(req.output_ids) >= p.min_tokens:
            self._finish(req, "stop")
            return
        if req.matcher is not None:
            req.matcher.accept(tok)  # a token the mask forbade fails the request (never a silent drift)
        req.output_ids.append(tok)
        detok = self._detok.get(req.request_id)
        if detok is not None:
            detok.add([tok])
            if detok.stopped_by is not None:
                self._finish(req, "stop")
                return
        if p.max_tokens is not None and len(req.output_ids) >= p.max_tokens:
            self._finish(req, "length")
        elif req.num_tokens >= self.max_model_len:
            self._note_context_limit(req)
            self._finish(req, "length")

    def _note_context_limit(self, req: Request) -> None:
        """finish_reason "length" alone reads as max_tokens: say once that the context limit cut it."""
        if self._noted_context_limit or req.params.max_tokens is None:  # None asked for the whole context
            return
        self._noted_context_limit = True
        warnings.warn(
            f"request {req.request_id} stopped at the context limit (max_model_len {self.max_model_len} tokens: "
            f"{len(req.prompt_ids)} prompt + {len(req.output_ids)} generated) before max_tokens "
            f"({req.params.max_tokens}); finish_reason is 'length' (noted once per engine)",
            stacklevel=2,
        )

    def _finish(self, req: Request, reason: str) -> None:
        detok = self._detok.get(req.request_id)
        if detok is not None and detok.stopped_by is None:
            try:
                detok.finish()
            except Exception as e:  # the pages are freed all the same (abort stays "abort")
                self._detok.pop(req.request_id, None)
                req.error = f"request {req.request_id}: detokenizer failed at finish: {type(e).__name__}: {e}"
                reason = reason if reason == "abort" else "error"
        req.finish_time = time.monotonic()
        self.scheduler.finish(req, reason)

    def _touched(self, plan: SchedulePlan) -> list[Request]:
        seen, out = set(), []
        for c in plan.chunks:
            if c.request.request_id not in seen:
                seen.add(c.request.request_id)
                out.append(c.request)
        return out

    def _output(self, req: Request) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        text = detok.output_text if detok is not None else ""
        done = req.status is Status.FINISHED
        comp = CompletionOutput(
            0,
            text,
            list(req.output_ids),
            req.finish_reason,
            list(req.logprobs) if req.params.logprobs is not None else None,
            req.error,
        )
        return RequestOutput(
            req.request_id,
            None,
            req.prompt_ids,
            [comp],
            done,
            _metrics(req),
            list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
        )

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)


def check_prompt(prompt_ids, vocab_size: int, max_model_len: int, who: str = "prompt") -> list[int]:
    """See Engine.check_prompt. Pure: the caller's engine is untouched when this raises."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (Sequence, np.ndarray)):
        raise ValueError(f"{who}: a prompt must be a list of token ids, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError(f"{who}: empty prompt")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"{who}: prompt of {len(prompt_ids)} tokens does not fit max_model_len {max_model_len} "
            "(a prompt needs room for at least one more token)"
        )
    ids = []
    for i, t in enumerate(prompt_ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{who}: token id at position {i} must be an int, got {type(t).__name__} {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{who}: token id {int(t)} outside the vocabulary [0, {vocab_size}) at position {i}")
        ids.append(int(t))
    return ids


def _logprob_entry(ids: torch.Tensor, values: torch.Tensor, n: int) -> dict[int, float]:
    """{token id: logprob} for the chosen token (column 0) and the top-n."""
    return {int(t): float(v) for t, v in zip(ids[: n + 1].tolist(), values[: n + 1].tolist())}


def _metrics(req: Request) -> dict:
    m = {
        "num_prompt_tokens": len(req.prompt_ids),
        "num_output_tokens": len(req.output_ids),
        "num_preemptions": req.num_preemptions,
        "num_cached_prompt_tokens": req.num_cached_prompt,
        "num_disk_cached_tokens": req.num_disk_cached,
    }
    if req.num_verify_steps:
        m["num_draft_tokens"] = req.num_draft_tokens
        m["num_accepted_tokens"] = req.num_accepted_tokens
        m["num_verify_steps"] = req.num_verify_steps
        m["acceptance_rate"] = req.num_accepted_tokens / max(req.num_draft_tokens, 1)
        m["mean_accepted_length"] = (req.num_accepted_tokens + req.num_verify_steps) / req.num_verify_steps
    if req.spec is not None and (req.spec.num_pauses or req.spec.num_paused_steps):
        m["num_spec_paused_steps"] = req.spec.num_paused_steps  # sampled without drafting (acceptance switch)
        m["num_spec_probes"] = req.spec.num_probes
    if req.first_token_time is not None:
        m["time_to_first_token"] = req.first_token_time - req.arrival
    if req.finish_time is not None and req.first_token_time is not None and len(req.output_ids) > 1:
        m["tokens_per_s"] = (len(req.output_ids) - 1) / max(req.finish_time - req.first_token_time, 1e-9)
    return m

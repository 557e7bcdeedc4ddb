"""The engine loop: add_request, step() -> outputs, abort. One forward pass per step for the
whole batch; sampling for every request that needs a token, in one batched call.

Lifecycle: a request's state (scheduler entry, pages, detokenizer) lives from add_request until
step() returns its final output (finished=True); then the engine forgets it. abort() frees the
pages at once, and the next step() returns the final output with finish_reason "abort". No caller
has to release anything, so a long-running server's dictionaries stay at the size of its live work.
"""

from __future__ import annotations

import itertools
import time

import torch

from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.page_pool import PagePool
from mlaserve.engine.request import CompletionOutput, Request, RequestOutput, Status
from mlaserve.engine.scheduler import SchedulePlan, Scheduler
from mlaserve.engine.tokenizer import Tokenizer
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.sampling.params import SamplingParams
from mlaserve.sampling.sampler import SamplingBatch, gather_logprobs, make_generator, sample


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None) -> None:
        cfg = runner.cfg
        self.runner, self.tokenizer, self.cfg = runner, tokenizer, cfg
        self.pool = PagePool(cfg.num_pages, cfg.enable_prefix_caching)
        max_len = cfg.num_pages * cfg.page_size
        self.scheduler = Scheduler(self.pool, cfg.page_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, for the next step()
        eos = list(tokenizer.eos_token_ids) if tokenizer else list(cfg.model.eos_token_ids)
        self.eos_ids = frozenset(eos)
        self.max_model_len = min(max_len, cfg.model.max_position_embeddings)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise ValueError(f"request {rid}: empty prompt")
        vocab = self.cfg.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt of {len(prompt_ids)} tokens does not fit max_model_len {self.max_model_len}"
            )
        req = Request(rid, list(prompt_ids), params)
        if params.seed is not None:
            req.generator = make_generator(params.seed)
        self.requests[rid] = req
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(
                self.tokenizer.tok,
                list(prompt_ids),
                params.skip_special_tokens,
                params.stop or (),
                params.include_stop_str_in_output,
            )
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
        if not plan.chunks:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not place any request: the page pool is too small")
            return aborted
        chunks = [c.to_seq_chunk(self.cfg.page_size) for c in plan.chunks]
        batch, logits = self.runner.execute(chunks, plan.preempted)
        self.scheduler.advance(plan)
        by_id = {rid: row for row, (rid, _) in enumerate(batch.logits_owner)}  # last row per request
        self._prompt_logprobs(plan, batch, logits)
        sampling = [c.request for c in plan.chunks if c.completes_prompt]
        if sampling:
            rows = torch.tensor([by_id[r.request_id] for r in sampling], device=logits.device)
            self._sample(sampling, logits[rows])
        outputs = [self._output(r) for r in self._touched(plan)]
        for out in outputs:
            if out.finished:
                self._forget(out.request_id)
        return aborted + outputs

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [r.generator for r in reqs],
            logits.shape[-1],
            eos_token_id=tuple(self.eos_ids),
        )
        out = sample(logits, batch)  # logprobs computed iff some row asked (batch.max_num_logprobs)
        now = time.monotonic()
        for i, req in enumerate(reqs):
            tok = int(out.token_ids[i])
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.logprobs is not None:
                req.logprobs.append(_logprob_entry(out.logprob_token_ids[i], out.logprobs[i], req.params.logprobs))
            self._append(req, tok)

    def _prompt_logprobs(self, plan: SchedulePlan, batch, logits: torch.Tensor) -> None:
        """Logprob of each next prompt token (+ top-N) from the all-position logits of prompt chunks."""
        for c in plan.chunks:
            req, n = c.request, c.request.params.prompt_logprobs
            if n is None or c.start >= len(req.prompt_ids):
                continue
            rows = [row for row, (rid, _) in enumerate(batch.logits_owner) if rid == req.request_id]
            positions = range(c.start, c.start + len(rows))
            keep = [(row, p) for row, p in zip(rows, positions) if p + 1 < len(req.prompt_ids)]
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first prompt token has no context
            if not keep:
                continue
            lp = logits[[row for row, _ in keep]].log_softmax(-1)
            nxt = torch.tensor([req.prompt_ids[p + 1] for _, p in keep], device=lp.device)
            values, ids, _ = gather_logprobs(lp, nxt, n)
            req.prompt_logprobs.extend(_logprob_entry(ids[j], values[j], n) for j in range(len(keep)))

    def _append(self, req: Request, tok: int) -> None:
        p = req.params
        if tok in p.all_stop_token_ids(self.eos_ids) and len(req.output_ids) >= p.min_tokens:
            self._finish(req, "stop")
            return
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
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str) -> None:
        detok = self._detok.get(req.request_id)
        if detok is not None and detok.stopped_by is None:
            detok.finish()
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


def _logprob_entry(ids: torch.Tensor, values: torch.Tensor, n: int) -> dict[int, float]:
    """{token id: logprob} for the chosen token (column 0) and the top-n."""
    return {int(t): float(v) for t, v in zip(ids[: n + 1].tolist(), values[: n + 1].tolist())}


def _metrics(req: Request) -> dict:
    m = {
        "num_prompt_tokens": len(req.prompt_ids),
        "num_output_tokens": len(req.output_ids),
        "num_preemptions": req.num_preemptions,
        "num_cached_prompt_tokens": req.num_cached_prompt,
    }
    if req.first_token_time is not None:
        m["time_to_first_token"] = req.first_token_time - req.arrival
    if req.finish_time is not None and req.first_token_time is not None and len(req.output_ids) > 1:
        m["tokens_per_s"] = (len(req.output_ids) - 1) / max(req.finish_time - req.first_token_time, 1e-9)
    return m

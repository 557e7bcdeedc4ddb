"""Continuous batching: each step spends a token budget on running decodes first, then on
prefill chunks of partial and waiting prompts (chunked prefill), within max_num_seqs.

When pages run out, the most recently arrived running request is preempted: its pages are
freed and it goes back to the front of the queue to be recomputed later (greedy output is
unchanged). schedule() -> SchedulePlan is plain data; update() applies the sampled tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .forward_batch import SeqChunk
from .kv_cache import PagePool
from .request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token index (== request.num_computed)
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens

    def to_seq_chunk(self, page_size: int) -> SeqChunk:
        r = self.request
        end = self.start + self.num_tokens
        return SeqChunk(r.request_id, tuple(r.all_ids[self.start : end]), self.start,
                        tuple(r.pages[: -(-end // page_size)]), needs_logits=self.completes_prompt)


@dataclass(frozen=True)
class SchedulePlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pool: PagePool, page_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.pool, self.page_size = pool, page_size
        self.budget, self.max_seqs, self.max_model_len = max_num_batched_tokens, max_num_seqs, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        budget, chunks, preempted = self.budget, [], []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._reserve(req, req.num_computed + n, preempted):
                continue
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        # Decodes first in the batch is ForwardBatch's job; keep arrival order here.
        return SchedulePlan(tuple(c for c in chunks if c.request.status is Status.RUNNING), tuple(preempted))

    def _reserve(self, req: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Pages for num_tokens, preempting the newest other running requests if needed."""
        while not self._grow(req, num_tokens):
            victim = max((r for r in self.running if r is not req and r.status is Status.RUNNING),
                         key=lambda r: r.arrival, default=None)
            if victim is None or victim.arrival < req.arrival:
                victim = req  # nothing newer to evict: this request yields itself
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.pages.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.pool.release(req.pages)
        req.pages, req.num_computed = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def advance(self, plan: SchedulePlan) -> None:
        """The forward pass wrote these tokens' rows into the cache."""
        for c in plan.chunks:
            c.request.num_computed = c.start + c.num_tokens

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.pages)
        req.pages = []

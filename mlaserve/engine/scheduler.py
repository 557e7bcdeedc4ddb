"""Continuous batching: each step spends a token budget on running decodes first, then on
prefill chunks of partial and waiting prompts (chunked prefill), within max_num_seqs.

When pages run out, the most recently arrived running request is preempted: its pages are
freed and it goes back to the front of the queue to be recomputed later (greedy output is
unchanged). schedule() -> SchedulePlan is plain data; advance() records what the forward pass
computed; finish() frees a request's pages.

Models that declare "request"-addressed cache states (config/layer_kinds.py) also get a SlotPool: a
request takes a state slot when it is admitted (admission waits while none is free) and gives it back
whenever it leaves the running set (finish, abort, failure, preemption). The chunk that starts a
sequence (start == 0: first admission, or re-admission after preemption without a prefix hit, which
recomputes from token 0) says reset_state, and the runner zeroes the slot before that step. With prefix
caching on (every request state snapshotted at page boundaries or empty there), an admission that hits the
prefix cache starts at the hit: its first chunk names the hit's last page (restore_page) and the runner
restores the slot from that page's snapshot rows. A preempted request is re-admitted the same way: its
registered pages stay cached (evictable) after the preemption, so it resumes from the last of them that
survived instead of token 0 (with prefix caching off it recomputes from 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlaserve.cache.disk_tier import DiskLoad, DiskTier
from mlaserve.cache.page_pool import PagePool, page_hashes
from mlaserve.cache.slot_pool import SlotPool
from mlaserve.engine.request import Request, Status
from mlaserve.executor.forward_batch import SeqChunk


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token index (== request.num_computed)
    num_tokens: int  # including num_draft speculative tokens
    num_draft: int = 0  # the request's draft_ids[:num_draft] follow its last token (speculative verification)

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens - self.num_draft == self.request.num_tokens

    def to_seq_chunk(self, page_size: int) -> SeqChunk:
        r = self.request
        end = self.start + self.num_tokens
        ids = r.all_ids[self.start : end - self.num_draft] + r.draft_ids[: self.num_draft]
        return SeqChunk(
            r.request_id,
            tuple(ids),
            self.start,
            tuple(r.pages[: -(-end // page_size)]),
            needs_logits=self.completes_prompt,
            # a verification needs the target's logits after the last token and after every draft
            all_logits=self.num_draft > 0 or (r.params.prompt_logprobs is not None and self.start < len(r.prompt_ids)),
            num_cached=r.num_cached_prompt if self.start == r.num_cached_prompt else 0,
            state_slot=r.state_slot,
            # the sequence starts here, so its request states start from zero ...
            reset_state=r.state_slot is not None and self.start == 0,
            # ... or at a prefix hit, from the snapshot row of the hit's last page (hits are whole pages, and a
            # page is named in the prefix cache only once full, by the step that wrote its snapshot row)
            restore_page=r.pages[self.start // page_size - 1] if self._starts_at_hit else None,
            num_draft=self.num_draft,
        )

    @property
    def _starts_at_hit(self) -> bool:
        r = self.request
        return r.state_slot is not None and self.start > 0 and self.start == r.num_cached_prompt


@dataclass(frozen=True)
class Preemption:
    request_id: str
    pages_freed: int  # pages that went back to the pool (shared prefix pages another request holds do not)


@dataclass(frozen=True)
class SchedulePlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Preemption, ...]  # requests sent back to the queue this step (in the route ledger)
    disk_loads: tuple[DiskLoad, ...] = ()  # pages to fill from the disk tier before this step's forward


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        slots: SlotPool | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """slots: the state-slot pool when the model declares request states, else None (no slots).
        disk: the prefix cache's disk tier (prefix_cache_dir), else None."""
        self.pool, self.page_size, self.slots, self.disk = pool, page_size, slots, disk
        self._disk_loads: list[DiskLoad] = []
        self.new_pages: list[tuple[int, int, list[int]]] = []  # (page, chain hash, token ids) named since drained
        self.budget, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulePlan:
        budget, chunks, preempted = self.budget, [], []
        self._disk_loads = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            d = min(len(req.draft_ids), budget - n) if req.num_tokens - req.num_computed == 1 else 0
            if d and not self._grow(req, req.num_computed + n + d):
                d = 0  # drafts only fill free pages: speculation never preempts anyone
            if not self._reserve(req, req.num_computed + n + d, preempted):
                continue
            chunks.append(ScheduledChunk(req, req.num_computed, n + d, d))
            budget -= n + d
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not preempted:
            req = self.waiting[0]
            if self.slots is not None and self.slots.num_free == 0:
                break  # every state slot is held: admission waits for a running request to leave
            # prompt_logprobs need logits at every prompt position, so such requests recompute them all.
            if not req.pages and self.pool.prefix_caching and req.params.prompt_logprobs is None:
                self._reuse_prefix(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                self._drop_pages(req)
                break
            self.waiting.popleft()
            if self.slots is not None:
                req.state_slot = self.slots.allocate(req.request_id)
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        # Decodes first in the batch is ForwardBatch's job; keep arrival order here.
        live = tuple(c for c in chunks if c.request.status is Status.RUNNING)
        return SchedulePlan(live, tuple(preempted), tuple(self._disk_loads))

    def _reserve(self, req: Request, num_tokens: int, preempted: list[Preemption]) -> bool:
        """Pages for num_tokens, preempting the newest other running requests if needed."""
        while not self._grow(req, num_tokens):
            victim = max(
                (r for r in self.running if r is not req and r.status is Status.RUNNING),
                key=lambda r: r.arrival,
                default=None,
            )
            if victim is None or victim.arrival < req.arrival:
                victim = req  # nothing newer to evict: this request yields itself
            # Pages another request still references (a shared prefix) are not freed by this preemption.
            freed = sum(self.pool.ref[p] == 1 for p in victim.pages)
            preempted.append(Preemption(victim.request_id, freed))
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _reuse_prefix(self, req: Request) -> None:
        """Start after the longest cached run of full pages, leaving >= 1 token to compute (for logits)."""
        ps = self.page_size
        hashes = page_hashes(req.all_ids, ps, (req.num_tokens - 1) // ps)
        req.pages = self.pool.lookup(hashes)
        if self.disk is not None and len(req.pages) < len(hashes):
            self._reuse_from_disk(req, hashes)
        req.num_computed = len(req.pages) * ps
        req.num_cached_prompt = req.num_computed
        req.num_registered = len(req.pages)

    def _reuse_from_disk(self, req: Request, hashes: list[int]) -> None:
        """Extend the memory hit with the pages the disk tier holds next in the chain (verified files read
        now, their rows copied into free pages before the step's forward: SchedulePlan.disk_loads). Such a
        page is named in the prefix cache at once; it stays a hit even if the forward fails."""
        ps, loads = self.page_size, []
        # one free page stays for the rest of the prompt; without one the request waits like any other
        for i in range(len(req.pages), len(hashes)):
            if len(loads) + 1 >= self.pool.num_free:
                break
            parts = self.disk.read(hashes[i], req.all_ids[i * ps : (i + 1) * ps])
            if parts is None:
                break
            loads.append((hashes[i], parts))
        if not loads:
            return
        pages = self.pool.allocate(len(loads))
        for page, (h, parts) in zip(pages, loads):
            self.pool.register(page, h)
            self._disk_loads.append(DiskLoad(page, self.disk.path(h), parts))
        req.pages = req.pages + pages
        req.num_disk_cached = len(pages) * ps

    def drain_new_pages(self) -> list[tuple[int, int, list[int]]]:
        """Pages named in the prefix cache since the last call (the disk tier writes them)."""
        out, self.new_pages = self.new_pages, []
        return out

    def _drop_pages(self, req: Request) -> None:
        self.pool.release(req.pages)
        req.pages, req.num_computed, req.num_registered = [], 0, 0

    def _register_full_pages(self, req: Request) -> None:
        full = req.num_computed // self.page_size
        if not self.pool.prefix_caching or full <= req.num_registered:
            return
        ps, hashes = self.page_size, page_hashes(req.all_ids, self.page_size, full)
        for k in range(req.num_registered, full):
            if self.pool.register(req.pages[k], hashes[k]) and self.disk is not None:
                self.new_pages.append((req.pages[k], hashes[k], req.all_ids[k * ps : (k + 1) * ps]))
        req.num_registered = full

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.pages.extend(self.pool.allocate(need))
        return True

    def _free_slot(self, req: Request) -> None:
        if req.state_slot is not None:
            self.slots.free(req.state_slot, req.request_id)
            req.state_slot = None

    def _preempt(self, req: Request) -> None:
        self._drop_pages(req)
        self._free_slot(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def advance(self, plan: SchedulePlan) -> None:
        """The forward pass wrote these tokens' rows into the cache."""
        for c in plan.chunks:
            # Draft rows are written but not yet trusted: commit_drafts counts the accepted ones.
            c.request.num_computed = c.start + c.num_tokens - c.num_draft
            self._register_full_pages(c.request)

    def commit_drafts(self, req: Request, accepted: int) -> None:
        """Speculative verification accepted `accepted` drafts: their cache rows are the request's."""
        if req.status is Status.RUNNING and accepted:
            req.num_computed += accepted
            self._register_full_pages(req)

    def grow_for_drafts(self, req: Request, num_tokens: int) -> int:
        """Pages for up to num_tokens rows without preempting anyone -> the rows the request now has."""
        self._grow(req, num_tokens)
        return len(req.pages) * self.page_size

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._drop_pages(req)
        self._free_slot(req)

"""Speculative decoding with the MTP layer: draft, verify, accept -- as plain functions.

Notation (one decoding request; n tokens t_0..t_{n-1} known, rows 0..n-2 in the trunk's cache)
  verify   the trunk runs [t_{n-1}, d_1..d_k] at positions n-1..n-1+k (one step, k + 1 logits rows);
           row j decides token t_{n+j} exactly as plain decoding would, given t_{..n-1+j}
  accept   walk j = 0..k: the token chosen at row j is kept; it continues only while it equals d_{j+1}
           (greedy) or the rejection rule accepts d_{j+1} (sampling), so a step adds a + 1 tokens for
           a accepted drafts (a + 1 = the "accepted length"); rows after the first rejection are dropped
  draft    the MTP layer runs at the positions verified this step, i = n-1..n-1+a, on (h_i, t_{i+1}),
           and its last row drafts d'_1; deeper drafts re-run it on (g_{i}, d'_{j-1}) one position on
Rejected rows in either cache are never read: attention is causal and the next step rewrites them.
Drafts are greedy (q one-hot), so sampling keeps the target distribution exactly (sampling/rejection.py).
Known limit: a prefix-cached page's MTP row at its last position was computed with the next token of
the request that filled it; another request reusing the page may draft worse, never differently output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from mlaserve.engine.request import Request, Status
from mlaserve.engine.spec_switch import Decision, keep_pending, take_pending
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.sampling.rejection import one_hot, rejection_sample, target_probs
from mlaserve.sampling.sampler import SamplerOutput, SamplingBatch, gather_logprobs, sample

if TYPE_CHECKING:
    from mlaserve.engine.scheduler import ScheduledChunk, SchedulePlan
    from mlaserve.engine.spec_host import SpeculativeHost


# --------------------------------------------------------------------------- accept


def choose(
    logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[int | None]
) -> tuple[list[int], list[bool], tuple | None]:
    """One verify position for each row: -> (token, accepted, logprobs (values, ids) or None).
    A row with draft None takes the token as plain sampling does (the bonus token). Greedy rows take
    `sample`'s argmax -- the very function plain decoding uses -- and accept iff it equals the draft."""
    out = sample(logits, batch)
    tokens = out.token_ids.clone()
    accepted = [d is not None and int(tokens[i]) == d for i, d in enumerate(drafts)]
    greedy = batch.is_greedy.tolist()
    rnd = [i for i, d in enumerate(drafts) if d is not None and not greedy[i]]
    if rnd:
        sub = batch.select(rnd)
        p = target_probs(logits[rnd], sub)
        d = torch.tensor([drafts[i] for i in rnd], device=logits.device)
        tok, ok = rejection_sample(p, one_hot(d, p.shape[-1]), d, sub.generators)
        for j, i in enumerate(rnd):
            tokens[i], accepted[i] = tok[j], bool(ok[j])
    lps = None
    if batch.max_num_logprobs is not None:
        values, ids, _ = gather_logprobs(logits.float().log_softmax(-1), tokens, batch.max_num_logprobs)
        lps = (values, ids)
    return tokens.tolist(), accepted, lps


def logits_rows(batch: ForwardBatch) -> dict[str, list[int]]:
    """request id -> its logits rows, in query order."""
    rows: dict[str, list[int]] = {}
    for row, (rid, _) in enumerate(batch.logits_owner):
        rows.setdefault(rid, []).append(row)
    return rows


def verify(
    engine: SpeculativeHost, chunks: list[ScheduledChunk], batch: ForwardBatch, logits: torch.Tensor
) -> dict[str, int]:
    """Choose each request's tokens position by position (batched across requests), appending as plain
    decoding does (stop tokens, stop strings, max_tokens apply per token; a request whose bookkeeping
    fails, or whose logits are not finite, fails alone). -> accepted drafts per request."""
    rows = logits_rows(batch)
    live = [(c, rows[c.request.request_id][-(c.num_draft + 1) :]) for c in chunks]
    accepted = {c.request.request_id: 0 for c in chunks}
    j = 0
    while live:
        live = _finite_rows(engine, live, logits, j)
        if not live:
            break
        reqs = [c.request for c, _ in live]
        drafts = [c.request.draft_ids[j] if j < c.num_draft else None for c, _ in live]
        sb = engine.sampling_batch(reqs, logits)
        idx = torch.tensor([r[j] for _, r in live], device=logits.device)
        tokens, ok, lps = choose(logits[idx], sb, drafts)
        out = SamplerOutput(torch.tensor(tokens), *(lps or (None, None)))
        engine.take_tokens(reqs, out, time.monotonic())
        nxt = []
        for i, (c, r) in enumerate(live):
            if ok[i] and c.request.status is Status.RUNNING:
                accepted[c.request.request_id] += 1
                nxt.append((c, r))
        live, j = nxt, j + 1
    for c in chunks:
        if c.num_draft:
            c.request.num_draft_tokens += c.num_draft
            c.request.num_accepted_tokens += accepted[c.request.request_id]
            c.request.num_verify_steps += 1
    return accepted


def _finite_rows(engine: SpeculativeHost, live: list, logits: torch.Tensor, j: int) -> list:
    """Plain decoding's rule: a request whose logits row has NaN/Inf fails (never token 0 forever)."""
    # As plain decoding checks: a NaN/Inf anywhere makes the row's sum non-finite (one reduction).
    finite = torch.isfinite(logits[[r[j] for _, r in live]].sum(-1)).tolist()
    for (c, _), ok in zip(live, finite):
        if not ok:
            engine.fail(c.request, f"request {c.request.request_id}: non-finite logits (NaN/Inf) in verification")
    return [x for x, ok in zip(live, finite) if ok]


# --------------------------------------------------------------------------- draft


def first_draft_chunk(c: ScheduledChunk, sampled: bool, accepted: int, page_size: int) -> SeqChunk | None:
    """The MTP's work for one scheduled chunk: every position the trunk just verified, with the next
    token; logits (a draft) only where the step sampled (the chunk ended the known tokens).
    None: nothing to draft (the request finished)."""
    req = c.request
    if req.status is not Status.RUNNING:
        return None
    m = c.num_tokens - c.num_draft + accepted if sampled else c.num_tokens
    ids = req.all_ids[c.start + 1 : c.start + m + 1]
    end = c.start + m
    slot = req.state_slot
    return SeqChunk(
        req.request_id,
        tuple(ids),
        c.start,
        tuple(req.pages[: -(-end // page_size)]),
        sampled,
        # a model with request states (DeepSeek-V4): the MTP's own states in the request's slot, starting empty
        # where the request's MTP rows start (position 0, or a prefix hit: no MTP state is cached with pages)
        state_slot=slot,
        reset_state=slot is not None and (c.start == 0 or c.start == req.num_cached_prompt),
    )


def draft_budget(req: Request, k: int, max_model_len: int) -> int:
    """Drafts worth proposing: none past max_tokens or max_model_len (they could never be kept)."""
    left = k
    if req.params.max_tokens is not None:
        left = min(left, req.params.max_tokens - len(req.output_ids) - 1)
    return max(0, min(left, max_model_len - req.num_tokens))


def draft(
    engine: SpeculativeHost, plan: SchedulePlan, batch: ForwardBatch, hidden: torch.Tensor, accepted: dict
) -> None:
    """Run the MTP layer: depth 1 over this step's verified positions, then k - 1 single-token passes.
    accepted: request id -> accepted drafts, for every request that sampled this step.
    First this step's verdicts update the acceptance switch; then, per sampling request, the switch
    (or speculative_max_seqs) decides whether it drafts (engine/spec_switch.py), and the decisions go to
    the ledger. Sets every scheduled request's draft_ids (empty when it has nothing to draft)."""
    runner, cfg, ps, switch = engine.runner, engine.cfg, engine.cfg.cache.page_size, engine.spec_switch
    starts = {s.request_id: s.query_start for s in batch.seqs}
    changes = {}
    for c in plan.chunks:
        c.request.draft_ids = []
        if c.request.spec is None:
            c.request.spec = switch.new_state()
        rid = c.request.request_id
        if c.num_draft and rid in accepted:
            changes[rid] = switch.observe(c.request.spec, c.num_draft, accepted[rid])
    # Off-switch by batch size: a large batch is compute-bound (speculative_max_seqs).
    over = cfg.speculative.max_seqs is not None and len(accepted) > cfg.speculative.max_seqs
    chunks, decisions, extra, offset = [], [], [], hidden.shape[0]
    for c in plan.chunks:
        req, rid = c.request, c.request.request_id
        x = first_draft_chunk(c, rid in accepted, accepted.get(rid, 0), ps)
        if x is None:
            continue
        rows = hidden[starts[rid] : starts[rid] + x.query_len]
        if rid in accepted:
            d = _batch_decision(len(accepted), cfg.speculative.max_seqs) if over else switch.decide(req.spec)
            decisions.append((req, d, changes.get(rid)))
            if not d.draft:
                keep_pending(req.spec, x.context_len, rows)  # its MTP rows are written when it drafts again
                continue
        elif over:
            keep_pending(req.spec, x.context_len, rows)
            continue
        first, pending = take_pending(req.spec, x.context_len)
        if pending is not None:  # catch up: the MTP rows of the positions it skipped, then this step's
            ids = req.all_ids[first + 1 : x.context_len + x.query_len + 1]
            x = replace(x, token_ids=tuple(ids), context_len=first)
            extra.append(torch.cat([pending, rows]))
            starts[rid], offset = offset, offset + extra[-1].shape[0]
        chunks.append(x)
    if runner.tracer.enabled and decisions:
        runner.tracer.record(switch_record(runner.step_count - 1, decisions))
    if not chunks:
        return
    if extra:
        hidden = torch.cat([hidden, *extra])
    step_no = runner.step_count - 1
    mbatch, logits, g = runner.drafter.forward(chunks, hidden, starts, step_no, draft_ledger(1))
    by_id = engine.requests
    want = {}
    # One argmax and one host transfer per pass (not one per request).
    for (rid, _), tok in zip(mbatch.logits_owner, logits.argmax(-1).tolist()):
        req = by_id[rid]
        req.draft_ids = [tok]
        want[rid] = draft_budget(req, cfg.speculative.num_tokens, engine.max_model_len)
    last = {s.request_id: s.query_start + s.query_len - 1 for s in mbatch.seqs}
    deeper_slots = [by_id[rid].state_slot for rid, n in want.items() if n > 1 and by_id[rid].state_slot is not None]
    runner.drafter.hold(deeper_slots)  # states a deeper pass advances are put back below (end_draft)
    for depth in range(2, cfg.speculative.num_tokens + 1):
        deeper = _deeper_chunks(engine, want, depth, ps)
        if not deeper:
            break
        mbatch, logits, g = runner.drafter.forward(deeper, g, last, step_no, draft_ledger(depth))
        for (rid, _), tok in zip(mbatch.logits_owner, logits.argmax(-1).tolist()):
            by_id[rid].draft_ids.append(tok)
        last = {s.request_id: s.query_start for s in mbatch.seqs}
    runner.drafter.end_draft()
    for rid, n in want.items():
        del by_id[rid].draft_ids[n:]


def _batch_decision(num_sampling: int, max_seqs: int) -> Decision:
    return Decision(False, "batch", f"no drafts: {num_sampling} sampling requests > speculative_max_seqs {max_seqs}")


def _deeper_chunks(engine: SpeculativeHost, want: dict[str, int], depth: int, page_size: int) -> list[SeqChunk]:
    """Position P + depth - 1 (P = the last verified position), input the previous draft, where the
    request wants this many drafts and has (or can get, without preempting) a page for the row."""
    out = []
    for rid, n in want.items():
        req = engine.requests[rid]
        pos = req.num_tokens - 2 + depth - 1
        if n < depth:
            continue
        if engine.scheduler.grow_for_drafts(req, pos + 1) <= pos:
            want[rid] = depth - 1  # no free page for the row: stop this request's drafts here
            continue
        pages = tuple(req.pages[: -(-(pos + 1) // page_size)])
        out.append(SeqChunk(rid, (req.draft_ids[-1],), pos, pages, state_slot=req.state_slot))
    return out


# --------------------------------------------------------------------------- ledger


def verify_ledger(plan: SchedulePlan) -> Callable[[ForwardBatch, object], dict]:
    """Fields of a target step's record: which requests verify how many drafts, down which route."""
    proposed = {c.request.request_id: c.num_draft for c in plan.chunks if c.num_draft}

    def fields(batch: ForwardBatch, route) -> dict:
        where = {rid: seg for seg in route.segments for rid in seg.request_ids}
        entries = [
            {
                "id": s.request_id,
                "proposed": proposed[s.request_id],
                "query_len": s.query_len,
                "phase": where[s.request_id].phase,
                "path": where[s.request_id].path,
            }
            for s in batch.seqs
            if s.request_id in proposed
        ]
        return {
            "spec_phase": "verify" if entries else "target",
            "verify": entries,
            "num_verify_tokens": sum(e["query_len"] for e in entries),
            "num_proposed_tokens": sum(proposed.values()),
        }

    return fields


def draft_ledger(depth: int) -> Callable[[ForwardBatch, object], dict]:
    """Fields of an MTP pass's record (its route and requests come from step_record)."""

    def fields(batch: ForwardBatch, route) -> dict:
        return {"spec_phase": "draft", "draft_depth": depth}

    return fields


def switch_record(step_no: int, decisions: list) -> dict:
    """The record written before the MTP pass: per request that sampled this step, whether it drafts
    for the next step and why (the acceptance switch, or speculative_max_seqs). decisions:
    (request, Decision, change) with change "paused" / "resumed" when this step's verdict flipped it."""
    entries = [
        {
            "id": req.request_id,
            "draft": d.draft,
            "decision": d.kind,
            "acceptance": round(req.spec.acceptance, 4),
            "reason": d.reason,
            **({"change": change} if change else {}),
        }
        for req, d, change in decisions
    ]
    return {
        "step": step_no,
        "spec_phase": "switch",
        "requests": entries,
        "num_drafting": sum(e["draft"] for e in entries),
        "num_paused": sum(e["decision"] == "paused" for e in entries),
        "num_probes": sum(e["decision"] == "probe" for e in entries),
        "num_pauses": sum(e.get("change") == "paused" for e in entries),
        "num_resumes": sum(e.get("change") == "resumed" for e in entries),
    }


def accept_record(step_no: int, plan: SchedulePlan, accepted: dict[str, int]) -> dict:
    """The record written after verification: per verifying request, drafts proposed and accepted."""
    entries = [
        {"id": c.request.request_id, "proposed": c.num_draft, "accepted": accepted.get(c.request.request_id, 0)}
        for c in plan.chunks
        if c.num_draft
    ]
    return {
        "step": step_no,
        "spec_phase": "accept",
        "requests": entries,
        "num_proposed_tokens": sum(e["proposed"] for e in entries),
        "num_accepted_tokens": sum(e["accepted"] for e in entries),
    }


def acceptance_summary(records: Sequence[dict]) -> dict:
    """From a ledger: drafts proposed and accepted, the acceptance rate, and the mean accepted length
    (tokens a verifying request gains per step: accepted drafts + the one token plain decoding makes)."""
    accepts = [r for r in records if r.get("spec_phase") == "accept"]
    proposed = sum(r["num_proposed_tokens"] for r in accepts)
    accepted = sum(r["num_accepted_tokens"] for r in accepts)
    verifies = sum(len(r["requests"]) for r in accepts)
    return {
        "num_proposed_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": (accepted + verifies) / verifies if verifies else 0.0,
    }


def speculative_step(engine: SpeculativeHost, plan: SchedulePlan, step_no: int) -> None:
    """One engine step with speculation: verify (one trunk forward for the whole batch), accept, draft.
    The engine builds the touched requests' outputs."""
    runner = engine.runner
    chunks = [c.to_seq_chunk(engine.cfg.cache.page_size) for c in plan.chunks]
    batch, logits, hidden = runner.execute_with_hidden(chunks, plan.preempted, verify_ledger(plan))
    engine.scheduler.advance(plan)
    engine.record_prompt_logprobs(plan.chunks, batch, logits)
    sampling = [c for c in plan.chunks if c.completes_prompt and c.request.status is Status.RUNNING]
    accepted = verify(engine, sampling, batch, logits) if sampling else {}
    if runner.tracer.enabled and any(c.num_draft for c in plan.chunks):
        runner.tracer.record(accept_record(runner.step_count - 1, plan, accepted))
    # request states (DeepSeek-V4): the rejected drafts' advances put back before anything reads them again
    runner.rollback(
        {c.request.request_id: 1 + accepted.get(c.request.request_id, 0) for c in plan.chunks if c.num_draft}
    )
    for c in sampling:
        engine.scheduler.commit_drafts(c.request, accepted[c.request.request_id])
    draft(engine, plan, batch, hidden, accepted)

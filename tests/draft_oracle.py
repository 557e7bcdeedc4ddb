"""The speculative tests' probes: oracle_drafts (drafts right two times in three, so that acceptance, partial
acceptance and rejection all happen: random MTP weights are almost never right), record_drafts and
capture_mtp_logits (what each draft pass proposed and computed), top_logprob_error (two runs' outputs compared)."""

from __future__ import annotations

import mlaserve.engine.speculative as spec


def oracle_drafts(monkeypatch, reference: dict[tuple, list[int]], vocab: int) -> None:
    """After the real MTP pass (which still runs: its rows and states are what is tested), replace each request's
    drafts by the reference's next tokens, every third one wrong. reference: prompt ids -> the plain greedy output.
    Under tensor or expert parallelism rank 0 decides: the other ranks see the drafts only as the next verify step's
    tokens."""
    real = spec.draft

    def draft(engine, plan, batch, hidden, accepted):
        real(engine, plan, batch, hidden, accepted)
        for c in plan.chunks:
            req = c.request
            n, ref = len(req.output_ids), reference[tuple(req.prompt_ids)]
            truth = (ref + [3] * 8)[n : n + len(req.draft_ids)]
            req.draft_ids = [t if (n + j) % 3 != 2 else (t + 1) % vocab for j, t in enumerate(truth)]

    monkeypatch.setattr(spec, "draft", draft)


def record_drafts(monkeypatch) -> list:
    """Every draft pass's proposals, per step: [(prompt, output length, draft ids)], sorted."""
    seen, real = [], spec.draft

    def draft(engine, plan, batch, hidden, accepted):
        real(engine, plan, batch, hidden, accepted)
        reqs = [c.request for c in plan.chunks]
        seen.append(sorted((tuple(r.prompt_ids), len(r.output_ids), tuple(r.draft_ids)) for r in reqs))

    monkeypatch.setattr(spec, "draft", draft)
    return seen


def capture_mtp_logits(monkeypatch, llm) -> list:
    """Every MTP pass's logits [n, V] on rank 0, in order (the drafts are their argmax; the logits also show a
    worker whose MTP ring or experts' rows differ, which an argmax may not)."""
    seen, real = [], llm.runner.drafter.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[1].clone())
        return out

    monkeypatch.setattr(llm.runner.drafter, "forward", forward)
    return seen


def top_logprob_error(a, b) -> float:
    """Max |difference| of the top-20 logprobs at every generated position of two runs' outputs (the same tokens
    ranked at each position)."""
    worst = 0.0
    for x, y in zip(a, b):
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert set(da) == set(db)
            worst = max(worst, max(abs(da[t] - db[t]) for t in da))
    return worst

"""Drafts that are right two times in three: the speculative tests' way to make acceptance, partial acceptance
and rejection all happen (random MTP weights are almost never right), whatever the model."""

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

"""When to draft: an acceptance-based off-switch for speculative decoding, per request.

A speculative step costs more than a plain one even when every draft fails: the MTP pass with its
full-vocabulary head, and a verification of k + 1 rows per request (on a CPU a GEMM of 2 rows costs
about twice one of 1; routed experts grow with the distinct experts the rows pick). It pays only
while enough drafts are accepted, and that depends on the text a request writes (and on the head),
so the switch is per request:

  acceptance  an exponential moving average of accepted / proposed over the request's verifications:
              a <- (1 - w_n) a + w_n (accepted / proposed), w_n = max(w, 1 / (n + 2)) at the n-th
              verification (n = 0, 1, ...), w = speculative_acceptance_weight: the start value counts
              as one verification, so the first few weigh as in a plain mean (a head that fails from
              the start is paused after two verifications, not after the ~1/w an average from 1.0 takes)
  paused      a < speculative_min_acceptance: the request decodes plainly (no MTP pass, no drafts)
  probe       after speculative_probe_interval steps of a pause the request drafts once; the probe's
              verification updates a like any other, so a request whose drafts are good again resumes.
              A probe that leaves it paused doubles the wait (up to MAX_BACKOFF x the interval): a
              head that keeps failing costs ever fewer probes; a resume starts again from the interval
  start       a new request starts at 1.0 (drafting), and nothing of another request enters its
              average: a request's drafts -- and so its seeded sampled output, which rejection sampling
              draws with its own generator -- depend on that request alone, not on the other traffic

While a request is paused its MTP cache rows are not written; the trunk's hidden states of those
positions are kept (at most MAX_PENDING_ROWS) and the next MTP pass over the request runs them first,
so a probe drafts from the same cache rows as uninterrupted speculation would.
Every decision is plain data (Decision), made before the MTP pass, and written to the route ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Hidden-state rows kept per paused request for its MTP cache catch-up: bounded memory (rows x
# hidden_size floats); older positions of a longer pause keep stale MTP rows, which can only make
# later drafts worse, never the output different.
MAX_PENDING_ROWS = 64
# Longest wait between probes, in multiples of speculative_probe_interval.
MAX_BACKOFF = 8


@dataclass
class SpecState:
    """One request's speculation bookkeeping (mutable; lives on the Request)."""

    acceptance: float  # moving average of accepted / proposed
    wait: int  # steps of a pause before the next probe (doubles after each failed probe)
    verifications: int = 0
    paused: bool = False
    idle: int = 0  # steps without drafts since the pause or the last probe
    probing: bool = False  # the drafts being verified next are a probe
    pending_start: int = 0  # first position of `pending`
    pending: torch.Tensor | None = None  # [n, D] trunk hidden states of positions without MTP rows
    num_paused_steps: int = 0  # steps this request sampled without drafting because of the switch
    num_probes: int = 0
    num_pauses: int = 0  # times the switch turned drafting off
    num_resumes: int = 0  # times a probe turned it back on


@dataclass(frozen=True)
class Decision:
    """Whether a request drafts for its next step, and why (the ledger's words)."""

    draft: bool
    kind: str  # "on" | "probe" | "paused" | "batch" (speculative_max_seqs) | "switch off" (min_acceptance 0)
    reason: str


class SpeculationSwitch:
    def __init__(self, min_acceptance: float, probe_interval: int, weight: float) -> None:
        self.min_acceptance, self.probe_interval, self.weight = min_acceptance, probe_interval, weight

    @property
    def enabled(self) -> bool:
        return self.min_acceptance > 0

    def new_state(self) -> SpecState:
        return SpecState(acceptance=1.0, wait=self.probe_interval)

    def observe(self, state: SpecState, proposed: int, accepted: int) -> str | None:
        """A verification of `proposed` drafts kept `accepted`. -> "paused" / "resumed" on a change."""
        w = max(self.weight, 1 / (state.verifications + 2))
        state.acceptance = (1 - w) * state.acceptance + w * (accepted / proposed)
        state.verifications += 1
        was, probed, state.probing = state.paused, state.probing, False
        state.paused = self.enabled and state.acceptance < self.min_acceptance
        if state.paused and not was:
            state.num_pauses += 1
            state.idle, state.wait = 0, self.probe_interval
            return "paused"
        if was and not state.paused:
            state.num_resumes += 1
            return "resumed"
        if state.paused and probed:
            state.wait = min(2 * state.wait, MAX_BACKOFF * self.probe_interval)
        return None

    def decide(self, state: SpecState) -> Decision:
        """Before the MTP pass of a step in which the request sampled: draft for the next step?"""
        a, t = state.acceptance, self.min_acceptance
        if not self.enabled:
            return Decision(True, "switch off", "drafting (speculative_min_acceptance 0: the switch is off)")
        if not state.paused:
            return Decision(True, "on", f"drafting: acceptance {a:.2f} >= {t:g}")
        state.idle += 1
        if state.idle >= state.wait:
            state.idle, state.probing = 0, True
            state.num_probes += 1
            return Decision(True, "probe", f"probe: acceptance {a:.2f} < {t:g}, paused {state.wait} steps")
        state.num_paused_steps += 1
        left = state.wait - state.idle
        return Decision(False, "paused", f"speculation paused: acceptance {a:.2f} < {t:g} (probe in {left} steps)")


def keep_pending(state: SpecState, start: int, rows: torch.Tensor) -> None:
    """Append the hidden states of positions start.. (no MTP rows written for them this step)."""
    if state.pending is not None and state.pending_start + state.pending.shape[0] == start:
        rows = torch.cat([state.pending, rows])
        start = state.pending_start
    if rows.shape[0] > MAX_PENDING_ROWS:
        start, rows = start + rows.shape[0] - MAX_PENDING_ROWS, rows[-MAX_PENDING_ROWS:]
    state.pending_start, state.pending = start, rows.clone()


def take_pending(state: SpecState, start: int) -> tuple[int, torch.Tensor | None]:
    """-> (first position, rows) of the kept hidden states that end right before `start`, or
    (start, None); either way the state forgets them (a preempted request's are stale: dropped)."""
    pending, first = state.pending, state.pending_start
    state.pending = None
    if pending is None or first + pending.shape[0] != start:
        return start, None
    return first, pending

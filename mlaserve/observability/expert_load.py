"""An expert-parallel ledger's per-rank totals over a run (`mlaserve trace summarize FILE`, after the route
blocks): which experts each process holds, the (token, expert) pairs its experts ran and the token rows they
came in, and the all-reduces it took part in. The ledger's fields are described in docs/LEDGER.md.

Read from
  expert_holdings   the load's first record: per process its experts per MoE layer, bytes held, bytes read
  expert_load       one per forward pass: per process `pairs`, `tokens`, `identity` (pass "trunk" or "mtp")
  comm              the workers' step and draft records (rank >= 1): all-reduce count, payload bytes, ms;
                    rank 0 writes none, so its column is empty
Balance: a rank's pairs over the mean of all ranks' (1.00 = an even share). Under TP x EP the T processes of
one expert-parallel rank run the same pairs (each on its units), so the mean over every process is the mean
over the expert-parallel ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PASSES = ("trunk", "mtp")


@dataclass
class RankLoad:
    """One process's totals over the run."""

    rank: int
    held: str = "-"  # its experts, e.g. "[0, 4) of 2 layers"
    held_bytes: int = 0
    read_bytes: int | None = None
    pairs: Counter = field(default_factory=Counter)  # pass -> (token, expert) pairs its experts ran
    tokens: Counter = field(default_factory=Counter)  # pass -> token rows those pairs came in
    identity: int = 0  # pairs routed to identity experts (LongCat-Flash; every rank counts the same)
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_ms: float = 0.0
    has_comm: bool = False

    def to_json(self) -> dict:
        out = {
            "rank": self.rank,
            "experts": self.held,
            "held_bytes": self.held_bytes,
            "read_bytes": self.read_bytes,
            "pairs": {p: self.pairs[p] for p in PASSES},
            "tokens": {p: self.tokens[p] for p in PASSES},
            "identity": self.identity,
        }
        if self.has_comm:
            out["all_reduces"] = self.all_reduces
            out["all_reduce_bytes"] = self.all_reduce_bytes
            out["all_reduce_ms"] = round(self.all_reduce_ms, 3)
        return out


@dataclass
class ExpertLoadSummary:
    ranks: dict[int, RankLoad] = field(default_factory=dict)
    passes: Counter = field(default_factory=Counter)  # pass kind -> forward passes with an expert_load record

    def rank(self, r: int) -> RankLoad:
        return self.ranks.setdefault(r, RankLoad(r))

    def add(self, rec: dict) -> None:
        if "expert_holdings" in rec:
            for h in rec["expert_holdings"]:
                mine = self.rank(h["rank"])
                mine.held = _held(h["routed_experts"])
                mine.held_bytes = sum(x["bytes"] for x in h["routed_experts"])
                mine.read_bytes = h.get("file_bytes_read")
        elif "expert_load" in rec:
            self.passes[rec["pass"]] += 1
            for x in rec["expert_load"]:
                mine = self.rank(x["rank"])
                mine.pairs[rec["pass"]] += x["pairs"]
                mine.tokens[rec["pass"]] += x["tokens"]
                mine.identity += x.get("identity", 0)
        elif "comm" in rec and "rank" in rec:
            mine = self.rank(rec["rank"])
            mine.has_comm = True
            mine.all_reduces += rec["comm"]["all_reduces"]
            mine.all_reduce_bytes += rec["comm"]["all_reduce_bytes"]
            mine.all_reduce_ms += rec["comm"]["all_reduce_ms"]

    def balance(self, r: int) -> float | None:
        """Rank r's pairs (all passes) over the mean of every rank's; None when no pair ran."""
        totals = [sum(x.pairs.values()) for x in self.ranks.values()]
        mean = sum(totals) / len(totals)
        return sum(self.ranks[r].pairs.values()) / mean if mean else None

    def to_json(self) -> dict:
        ranks = [self.ranks[r].to_json() | {"balance": self.balance(r)} for r in sorted(self.ranks)]
        return {"passes": {p: self.passes[p] for p in PASSES}, "ranks": ranks}


def _held(layers: list[dict]) -> str:
    """A process's experts: "[0, 4) in 2 layers" when every MoE layer holds the same range, else per layer."""
    ranges = {tuple(x["experts"]) for x in layers}
    if len(ranges) == 1:
        (a, b), n = ranges.pop(), len(layers)
        return f"[{a}, {b}) in {n} layer{'s' if n != 1 else ''}"
    return ", ".join(f"[{x['experts'][0]}, {x['experts'][1]})" for x in layers)


def summarize_expert_load(records) -> ExpertLoadSummary | None:
    """The per-rank totals of an expert-parallel ledger; None for a ledger without expert records."""
    records = list(records)
    if not any("expert_load" in r or "expert_holdings" in r for r in records):
        return None
    out = ExpertLoadSummary()
    for rec in records:
        out.add(rec)
    return out


def format_expert_load(s: ExpertLoadSummary) -> str:
    passes = ", ".join(f"{s.passes[p]} {p}" for p in PASSES if s.passes[p]) or "none"
    lines = [
        f"expert parallel, per rank over the run ({passes} passes; pairs = (token, expert) pairs its experts ran):",
        f"  {'rank':>4}  {'experts':<22} {'held B':>10} {'pairs':>9} {'mtp pairs':>9} {'token rows':>10} "
        f"{'balance':>7} {'identity':>8} {'all-reduces':>11} {'bytes':>12} {'ms':>9}",
    ]
    for r in sorted(s.ranks):
        x, bal = s.ranks[r], s.balance(r)
        comm = (
            f"{x.all_reduces:>11} {x.all_reduce_bytes:>12} {x.all_reduce_ms:>9.1f}"
            if x.has_comm
            else f"{'-':>11} {'-':>12} {'-':>9}"
        )
        lines.append(
            f"  {r:>4}  {x.held:<22} {x.held_bytes:>10} {x.pairs['trunk']:>9} {x.pairs['mtp']:>9} "
            f"{sum(x.tokens.values()):>10} {'-' if bal is None else f'{bal:.2f}':>7} {x.identity:>8} {comm}"
        )
    return "\n".join(lines)

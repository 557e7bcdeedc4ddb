"""A route ledger summarised: what ran where over a whole run (`mlaserve trace summarize FILE`, and the
table `mlaserve generate --trace FILE` ends with). The ledger's fields are described in docs/LEDGER.md.

Counts
  steps             records (one per engine step that ran a forward pass)
  tokens            per (phase, path, attention mode), summed over segments; the mode is the segment's
                    own where it records `sparse` (layer kinds of one step differ), else the step's:
                      dense             the segment (step) ran without index selection
                      sparse top-k      a sparse step whose indexer selected (needs_selection)
                      sparse all rows   a sparse step where every sequence fit in index_topk (no selection)
  prefix-cache hits requests whose first chunk started after cached pages (cached_tokens > 0), and
                    the tokens they skipped
  preemptions       entries of the per-step `preempted` lists, and the pages they freed
  effective top-k   sparse steps per effective_topk value (min(index_topk, longest sequence))
  speculative       (ledgers of speculative="mtp") trunk steps that verified drafts and their verify
                    tokens; drafts proposed and accepted (the `accept` records), the acceptance rate and
                    the mean accepted length (tokens a verifying request gains per step); the MTP's
                    own passes (`draft` records) are counted apart, not as steps or route tokens; the
                    acceptance switch's decisions (`switch` records): (request, step) pairs that drafted,
                    sat paused or probed, and how often it paused and resumed a request
  per rank          records with a "rank" field are summarised per rank (tensor parallel ledgers);
                    a ledger without one is one rank, shown without a rank header
Expert parallelism's `expert_holdings` and `expert_load` records carry no route: not steps; their per-rank
totals are observability/expert_load.py's, printed after the rank blocks.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mlaserve.observability.expert_load import ExpertLoadSummary, format_expert_load

MODES = ("dense", "sparse top-k", "sparse all rows")
# The acceptance switch's counts: (request, step) pairs per decision (engine/spec_switch.py), then how
# often it turned a request's drafting off and back on.
SWITCH_COUNTS = ("on", "probe", "paused", "batch", "switch off", "pauses", "resumes")


@dataclass
class LedgerSummary:
    steps: int = 0
    tokens: Counter = field(default_factory=Counter)  # (phase, path, mode) -> tokens
    decode_tokens: int = 0
    requests: set = field(default_factory=set)
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    preempted_pages: int = 0
    effective_topk: Counter = field(default_factory=Counter)  # value -> sparse steps
    backends: Counter = field(default_factory=Counter)  # backend name -> tokens
    verify_steps: int = 0  # trunk steps that verified drafts
    verify_tokens: int = 0  # [last token, d_1..d_k] query tokens of verifying requests
    verifications: int = 0  # (request, step) pairs that verified drafts
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    draft_passes: int = 0  # MTP forward passes
    draft_tokens: int = 0  # tokens through the MTP layer
    switch: Counter = field(default_factory=Counter)  # acceptance switch: decision kind / change -> count

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def add(self, rec: dict) -> None:
        if "expert_load" in rec or "expert_holdings" in rec:  # expert parallelism's records: no route, not a step
            return
        phase = rec.get("spec_phase")
        if phase == "accept":
            self.verifications += len(rec["requests"])
            self.drafts_proposed += rec["num_proposed_tokens"]
            self.drafts_accepted += rec["num_accepted_tokens"]
            return
        if phase == "draft":
            self.draft_passes += 1
            self.draft_tokens += rec["num_tokens"]
            return
        if phase == "switch":
            for e in rec["requests"]:
                self.switch[e["decision"]] += 1
                if e.get("change"):
                    self.switch[{"paused": "pauses", "resumed": "resumes"}[e["change"]]] += 1
            return
        if phase == "verify":
            self.verify_steps += 1
            self.verify_tokens += rec["num_verify_tokens"]
        self.steps += 1
        self.decode_tokens += rec["num_decode_tokens"]
        for seg in rec["segments"]:
            self.tokens[(seg["phase"], seg["path"], _mode(rec, seg))] += seg["num_tokens"]
            self.backends[seg.get("backend", "torch")] += seg["num_tokens"]
        for r in rec["requests"]:
            self.requests.add(r["id"])
            if r["cached_tokens"] > 0:
                self.prefix_hits += 1
                self.prefix_hit_tokens += r["cached_tokens"]
        for p in rec.get("preempted", []):
            self.preemptions += 1
            self.preempted_pages += p["pages_freed"]
        if rec["sparse"]:
            self.effective_topk[rec["effective_topk"]] += 1

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "requests": len(self.requests),
            "tokens": self.total_tokens,
            "decode_tokens": self.decode_tokens,
            "tokens_by_route": [
                {"phase": ph, "path": pa, "mode": mo, "tokens": n} for (ph, pa, mo), n in sorted(self.tokens.items())
            ],
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_tokens": self.prefix_hit_tokens,
            "preemptions": self.preemptions,
            "preempted_pages": self.preempted_pages,
            "effective_topk": {str(k): n for k, n in sorted(self.effective_topk.items())},
            "backends": dict(sorted(self.backends.items())),
            **({"speculative": self.speculative()} if self.draft_passes or self.verify_steps else {}),
        }

    def speculative(self) -> dict:
        n, acc = self.verifications, self.drafts_accepted
        return {
            "verify_steps": self.verify_steps,
            "verify_tokens": self.verify_tokens,
            "drafts_proposed": self.drafts_proposed,
            "drafts_accepted": acc,
            "acceptance_rate": acc / self.drafts_proposed if self.drafts_proposed else 0.0,
            "mean_accepted_length": (acc + n) / n if n else 0.0,
            "draft_passes": self.draft_passes,
            "draft_tokens": self.draft_tokens,
            # (request, step) pairs by the switch's decision, and the pauses / resumes it made
            "switch": {k: self.switch[k] for k in SWITCH_COUNTS},
        }


def _mode(rec: dict, seg: dict) -> str:
    """The segment's own mode where it records one (a step whose layer kinds differ: DeepSeek-V4's window and
    HCA layers beside its CSA layers, which alone select), else the step's."""
    if not seg.get("sparse", rec["sparse"]):
        return "dense"
    return "sparse top-k" if rec["needs_selection"] else "sparse all rows"


def summarize(records) -> dict:
    """rank (None for a ledger without ranks) -> LedgerSummary, ranks in order."""
    out: dict = {}
    for rec in records:
        if "expert_load" in rec or "expert_holdings" in rec:  # no rank and no route: expert_load.py's
            continue
        out.setdefault(rec.get("rank"), LedgerSummary()).add(rec)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))


def read_ledger(path: str | Path, offset: int = 0) -> list[dict]:
    """The records of a JSONL ledger (from byte `offset` on: a run's own records in a shared file)."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: record {n} (after byte {offset}) is not JSON: {e}") from None
            need = ("segments", "requests", "sparse", "num_decode_tokens")
            if rec.get("spec_phase") == "accept":  # speculative decoding's verdict record
                need = ("requests", "num_proposed_tokens", "num_accepted_tokens")
            if rec.get("spec_phase") == "switch":  # the acceptance switch's decisions
                need = ("requests", "num_drafting", "num_paused")
            if "expert_load" in rec:  # expert parallelism: a pass's (token, expert) pairs per rank
                need = ("step", "pass")
            if "expert_holdings" in rec:  # expert parallelism: which rank holds which experts
                need = ()
            missing = [k for k in need if k not in rec]
            if missing:
                raise ValueError(f"{path}: record {n} is not a route ledger record (no {', '.join(missing)})")
            records.append(rec)
    return records


def format_summary(by_rank: dict, experts: ExpertLoadSummary | None = None) -> str:
    """The route blocks (one per rank), then an expert-parallel ledger's per-rank totals when given."""
    blocks = [] if by_rank else ["route ledger: no steps"]
    for rank, s in by_rank.items():
        head = "route ledger" if rank is None else f"route ledger, rank {rank}"
        blocks.append(f"{head}:\n" + _format_one(s))
    if experts is not None:
        blocks.append(format_expert_load(experts))
    return "\n".join(blocks)


def _format_one(s: LedgerSummary) -> str:
    lines = [
        f"  steps {s.steps}, requests {len(s.requests)}, tokens {s.total_tokens} "
        f"({s.decode_tokens} decode, {s.total_tokens - s.decode_tokens} prefill)",
        f"  {'phase':<8} {'path':<13}" + "".join(f"{m:>16}" for m in MODES),
    ]
    for phase, path in sorted({(ph, pa) for ph, pa, _ in s.tokens}):
        lines.append(f"  {phase:<8} {path:<13}" + "".join(f"{s.tokens[(phase, path, m)]:>16}" for m in MODES))
    lines.append(f"  prefix-cache hits {s.prefix_hits} ({s.prefix_hit_tokens} tokens not recomputed)")
    lines.append(f"  preemptions {s.preemptions} ({s.preempted_pages} pages freed)")
    if s.effective_topk:
        topk = ", ".join(f"{k} on {n} step{'s' if n != 1 else ''}" for k, n in sorted(s.effective_topk.items()))
        lines.append(f"  effective top-k: {topk}")
    else:
        lines.append("  effective top-k: - (no sparse step)")
    lines.append("  backends: " + ", ".join(f"{b} {n} tokens" for b, n in sorted(s.backends.items())))
    if s.draft_passes or s.verify_steps:
        sp = s.speculative()
        lines.append(
            f"  speculative (MTP): {sp['verify_steps']} verify steps ({sp['verify_tokens']} verify tokens), "
            f"drafts {sp['drafts_accepted']}/{sp['drafts_proposed']} accepted ({sp['acceptance_rate']:.1%}), "
            f"mean accepted length {sp['mean_accepted_length']:.2f}; {sp['draft_passes']} MTP passes "
            f"({sp['draft_tokens']} tokens)"
        )
        if s.switch:
            sw = sp["switch"]
            lines.append(
                f"  acceptance switch: {sw['on'] + sw['switch off']} drafting, {sw['paused']} paused, "
                f"{sw['probe']} probes (request-steps); {sw['pauses']} pauses, {sw['resumes']} resumes"
                + (f"; {sw['batch']} without drafts by speculative_max_seqs" if sw["batch"] else "")
            )
    return "\n".join(lines)

"""benchmarks/offline.py keeps the load average at the start of every phase of a run (offline_phases.py run_engines,
`res["loadavg"]`): on a
shared machine a figure is quoted with the load it was measured under. Checked with stand-in engines (no
model, no worker process) and a scripted load average, so the records can be compared exactly."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    """offline.py (the settings, the command line) and offline_phases.py (the run), freshly imported."""
    monkeypatch.syspath_prepend(str(BENCH))
    names = ("offline", "offline_phases", "offline_report", "offline_engines")
    for n in names:
        sys.modules.pop(n, None)
    import offline
    import offline_phases

    yield offline, offline_phases
    for n in names:
        sys.modules.pop(n, None)


class StandIn:
    """What run_engines and the phases touch of an Engine; every call answers "failed" (None)."""

    def __init__(self, spec: str, path: Path) -> None:
        self.spec, self.path, self.load, self.last_rss = spec, path, {}, {}
        self.calls: list[str] = []

    def start(self) -> bool:
        return True

    def stop(self) -> None:
        pass

    def call(self, op: str, *args):
        self.calls.append(op)
        return None


def _run(bench, monkeypatch, tmp_path, sequential: bool):
    offline, run = bench
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"x")
    engines = [StandIn("a", weights), StandIn("b", weights)]
    counter = itertools.count(1)
    monkeypatch.setattr(run.os, "getloadavg", lambda: (float(next(counter)), 0.5, 0.25))
    s = offline.QUICK
    P = run.prompts_for(s, 1000)
    res, _ = run.run_engines(engines, s, P, sequential)
    names = [name for name, _ in run.phases(s, P, {}, {})]
    return res, names


def test_one_load_record_per_phase_in_run_order(bench, monkeypatch, tmp_path):
    res, names = _run(bench, monkeypatch, tmp_path, sequential=False)
    assert [r["phase"] for r in res["loadavg"]] == names
    # the n-th reading of the scripted clock belongs to the n-th phase: read when the phase starts
    assert [r["loadavg"] for r in res["loadavg"]] == [[float(i), 0.5, 0.25] for i in range(1, len(names) + 1)]
    assert all("engine" not in r for r in res["loadavg"])


def test_sequential_runs_record_each_engine_phase(bench, monkeypatch, tmp_path):
    res, names = _run(bench, monkeypatch, tmp_path, sequential=True)
    assert [(r["engine"], r["phase"]) for r in res["loadavg"]] == [(e, n) for e in ("a", "b") for n in names]
    assert [r["loadavg"][0] for r in res["loadavg"]] == [float(i) for i in range(1, 2 * len(names) + 1)]


def test_phases_picks_the_named_measurements(bench, monkeypatch, tmp_path):
    """`--phases prefill c16`: the warm-up, the two asked for, the info call; nothing else is run."""
    offline, run = bench
    s, P = offline.QUICK, run.prompts_for(offline.QUICK, 1000)
    every = [name for name, _ in run.phases(s, P, {}, {})]
    picked = [name for name, _ in run.phases(s, P, {}, {}, ["prefill", "c16"])]
    assert len(every) == len(run.PHASES) + 2
    assert picked == ["warm-up", f"prefill {s['prefill_len']}", "16 concurrent (32+8)", "info"]
    assert offline.parse_args(["--phases", "decode", "c16"]).phases == ["decode", "c16"]
    with pytest.raises(SystemExit):
        offline.parse_args(["--phases", "c8"])
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"x")
    e = StandIn("a", weights)
    monkeypatch.setattr(run.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    res, _ = run.run_engines([e], s, P, False, ["decode"])
    assert [r["phase"] for r in res["loadavg"]] == ["warm-up", "decode batch 1 (32+8)", "info"]
    assert e.calls == ["generate", "generate", "info"]  # warm-up, the one decode prompt of QUICK, info

    # with the prefill measured, the warm-up adds one prompt of its length (as llama-bench's), timed apart
    class Timed(StandIn):
        def call(self, op: str, *args):
            self.calls.append(op)
            return {"wall_s": 0.5, "first_s": 0.5} if op == "generate" and len(args[0][0]) == s["prefill_len"] else None

    e = Timed("b", weights)
    res, _ = run.run_engines([e], s, P, False, ["prefill"])
    assert e.calls == ["generate"] * (2 + s["prefill_reps"]) + ["info"]
    assert len(P["warmup_prefill"]) == s["prefill_len"] and P["warmup_prefill"] not in P["prefill"]
    assert res["b"]["prefill_warmup_s"] == 0.5 and res["b"]["prefill_s"] == [0.5] * s["prefill_reps"]

"""`mlaserve trace plot FILE -o PNG`: the route chart of a real ledger (the embedded DSA model with a small
pool: sparse top-k steps, a prefix-cache hit and a preemption), held to `trace summarize`'s counts of the
same file: the bars drawn add up to its tokens per (phase, path, mode), the markers to its hits and
preemptions, the top-k line to its sparse steps. matplotlib is an optional extra: the drawing tests skip
without it, and the command then names the extra to install."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from mlaserve.entrypoints.cli import main
from mlaserve.entrypoints.llm import LLM
from mlaserve.observability.route_plot import route_series
from mlaserve.observability.summary import read_ledger, summarize
from mlaserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    path = tmp_path_factory.mktemp("ledger") / "route.jsonl"
    # 10 pages of 4 tokens for three 14-15-token prompts of 8 tokens each: the newest is preempted; the
    # second shares the first's prompt (a prefix-cache hit); index_topk 8 < the prompts: the indexer selects
    llm = LLM(page_size=4, num_pages=10, index_topk=8, trace=str(path))
    prompt = list(range(5, 19))
    llm.generate([prompt, prompt + [3], [7] * 14], SamplingParams(max_tokens=8, temperature=0))
    llm.runner.tracer.close()
    return path


def test_the_series_are_what_trace_summarize_counts(ledger):
    records = read_ledger(ledger)
    summary = summarize(records)[None]
    series = route_series(records)[None]
    drawn = {cat: sum(row) for cat, row in series.tokens.items()}
    assert drawn == {k: v for k, v in summary.tokens.items() if v}
    assert summary.tokens[("prefill", "absorbed", "sparse top-k")] > 0  # the ledger has what the chart shows
    assert summary.preemptions == len(series.preemptions) == 1
    assert summary.prefix_hits == len(series.hits) >= 1
    assert Counter(k for _, k in series.topk) == summary.effective_topk
    assert len(series.steps) == summary.steps and all(len(r) == summary.steps for r in series.tokens.values())


def test_trace_plot_writes_the_png_with_those_bars(ledger, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="`mlaserve trace plot` needs the [plot] extra (matplotlib)")
    from mlaserve.observability.route_plot import plot_route

    out = tmp_path / "route.png"
    assert main(["trace", "plot", str(ledger), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out
    # the figure's own bars, read back: per legend label, the heights add up to summarize's tokens
    records = read_ledger(ledger)
    fig = plot_route(records)
    bars = {tuple(c.get_label().split(" ", 2)): [p.get_height() for p in c.patches] for c in fig.axes[0].containers}
    assert {k: sum(v) for k, v in bars.items()} == {k: v for k, v in summarize(records)[None].tokens.items() if v}
    # and step by step, each bar is that step's segment in the ledger (step order, as written)
    trunk = [r for r in records if r.get("spec_phase") is None]
    for cat, heights in bars.items():
        expected = [sum(s["num_tokens"] for s in r["segments"] if (s["phase"], s["path"]) == cat[:2]) for r in trunk]
        assert heights == expected, cat


def test_trace_plot_without_matplotlib_names_the_extra(ledger, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["trace", "plot", str(ledger), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install 'mlaserve[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_trace_plot_refuses_a_missing_folder_and_a_file_that_is_not_a_ledger(ledger, tmp_path, capsys):
    assert main(["trace", "plot", str(ledger), "-o", str(tmp_path / "nope" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n')
    assert main(["trace", "plot", str(bad)]) == 2
    assert "record 1 is not a route ledger record" in capsys.readouterr().err

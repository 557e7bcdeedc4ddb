"""`mlaserve trace summarize` over an expert-parallel ledger: per rank, the experts it holds, the (token, expert)
pairs its experts ran and their token rows over the run (trunk and MTP passes apart), its balance against the
mean, and the all-reduces it took part in (the workers' `comm`). A ledger written here by hand, in the layout
docs/LEDGER.md gives (2 ranks, 2 MoE layers of 8 experts, k = 2); the expected totals are added up below from
the numbers written, record by record. The spawned check (a real EP=2 ledger: pairs == tokens x k x MoE layers,
bytes == tokens x hidden x 4 x MoE layers) is in tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import json

from mlaserve.entrypoints.cli import main
from mlaserve.observability.expert_load import summarize_expert_load
from mlaserve.observability.summary import read_ledger

HOLDINGS = {
    "expert_holdings": [
        {
            "rank": r,
            "routed_experts": [
                {"layer": f"model.layers.{n}.mlp", "experts": [4 * r, 4 * r + 4], "bytes": b}
                for n, b in ((1, 59392), (2, 71680))
            ],
            "file_bytes_read": 803392,
            "peak_rss_bytes": 1,
        }
        for r in (0, 1)
    ]
}


def _step(step: int, rank: int, tokens: int, comm_ms: float, phase: str | None = None) -> dict:
    rec = {"rank": rank, "step": step, "num_tokens": tokens, "num_decode_tokens": 0, "sparse": False}
    rec |= {"segments": [{"phase": "prefill", "path": "decompressed", "num_tokens": tokens}], "requests": []}
    if phase:
        rec["spec_phase"] = phase
    if rank:  # a worker's record: its all-reduces this step (2 MoE layers, hidden 256, fp32)
        rec["comm"] = {"all_reduces": 2, "all_reduce_bytes": tokens * 256 * 4 * 2, "all_reduce_ms": comm_ms}
    return rec


def _load(step: int, kind: str, pairs: tuple[int, int], tokens: tuple[int, int]) -> dict:
    return {
        "step": step,
        "pass": kind,
        "expert_load": [
            {"rank": r, "pairs": p, "tokens": t, "identity": 0} for r, (p, t) in enumerate(zip(pairs, tokens))
        ],
    }


def _ledger(tmp_path):
    # two trunk steps (9 then 1 tokens: 36 and 4 pairs over both ranks), one MTP pass (1 token, 1 MoE layer: 2 pairs)
    records = [HOLDINGS]
    records += [_step(0, 0, 9, 0), _step(0, 1, 9, 10.5), _load(0, "trunk", (14, 22), (7, 11))]
    records += [_step(1, 0, 1, 0), _step(1, 1, 1, 8.25), _load(1, "trunk", (4, 0), (2, 0))]
    records += [_step(2, 0, 1, 0, "draft"), _step(2, 1, 1, 1.0, "draft"), _load(2, "mtp", (0, 2), (0, 1))]
    path = tmp_path / "ep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_per_rank_totals_over_the_run(tmp_path):
    s = summarize_expert_load(read_ledger(_ledger(tmp_path))).to_json()
    assert s["passes"] == {"trunk": 2, "mtp": 1}
    r0, r1 = s["ranks"]
    assert (r0["experts"], r1["experts"]) == ("[0, 4) in 2 layers", "[4, 8) in 2 layers")
    assert r0["held_bytes"] == r1["held_bytes"] == 59392 + 71680 and r0["read_bytes"] == 803392
    assert (r0["pairs"], r0["tokens"]) == ({"trunk": 14 + 4, "mtp": 0}, {"trunk": 7 + 2, "mtp": 0})
    assert (r1["pairs"], r1["tokens"]) == ({"trunk": 22 + 0, "mtp": 2}, {"trunk": 11 + 0, "mtp": 1})
    # 18 and 24 pairs against their mean 21; the pairs add up to what one process routes: tokens x k x layers
    assert (r0["balance"], r1["balance"]) == (18 / 21, 24 / 21)
    assert 18 + 24 == (9 + 1) * 2 * 2 + 1 * 2 * 1
    assert "all_reduces" not in r0  # rank 0 writes no comm
    assert (r1["all_reduces"], r1["all_reduce_bytes"]) == (6, (9 + 1 + 1) * 256 * 4 * 2)
    assert r1["all_reduce_ms"] == 10.5 + 8.25 + 1.0


def test_trace_summarize_prints_them_after_the_rank_blocks(tmp_path, capsys):
    path = _ledger(tmp_path)
    assert main(["trace", "summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "route ledger:\n" not in out  # the expert records make no rank-less block of 0 steps
    head, table = out.split("expert parallel, per rank over the run (2 trunk, 1 mtp passes;")
    assert "route ledger, rank 0:" in head and "route ledger, rank 1:" in head
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows[0][:3] == ["0", "[0,", "4)"] and rows[0][7:] == ["18", "0", "9", "0.86", "0", "-", "-", "-"]
    assert rows[1][7:] == ["22", "2", "12", "1.14", "0", "6", str(11 * 256 * 4 * 2), "19.8"]
    assert main(["trace", "summarize", str(path), "--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["expert_parallel"]
    assert [r["pairs"]["trunk"] for r in ep["ranks"]] == [18, 22]


def test_a_ledger_without_expert_records_has_no_such_table(tmp_path, capsys):
    path = tmp_path / "tp.jsonl"
    path.write_text("".join(json.dumps(_step(0, r, 3, 1.0)) + "\n" for r in (0, 1)))
    assert summarize_expert_load(read_ledger(path)) is None
    assert main(["trace", "summarize", str(path)]) == 0
    assert "expert parallel" not in capsys.readouterr().out

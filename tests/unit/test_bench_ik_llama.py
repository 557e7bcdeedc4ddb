"""ik_llama.cpp as a benchmark engine (benchmarks/ik_llama_worker.py): what it runs of its tools for each
measure and how it reads their output, worked against stand-in tools (shell scripts printing the tools'
output formats and recording their arguments), so the mapping is checked without an ik_llama.cpp build.
Also the IQ-mix file's commands (benchmarks/iq_mix.py) and a matrix cell measured in parts."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# llama-batched-bench's table (its printf format), one result row: PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S
BATCHED_OUT = """main: n_kv_max = 4352, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    127 |   16 |   4080 |    8.000 |   256.00 |   20.000 |   101.60 |   28.000 |   145.71 |

llama_print_timings: load time = 1.0 ms
"""


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    names = (
        "ik_llama_worker",
        "iq_mix",
        "matrix_table",
        "offline",
        "offline_engines",
        "offline_phases",
        "offline_report",
        "offline_workers",
        "common",
    )
    for n in names:
        sys.modules.pop(n, None)
    import ik_llama_worker
    import iq_mix
    import matrix_table
    import offline
    import offline_engines

    yield ik_llama_worker, iq_mix, matrix_table, offline, offline_engines
    for n in names:
        sys.modules.pop(n, None)


def _tools(tmp_path: Path, bench_ts: float) -> Path:
    """Stand-ins for llama-bench (-o json: one test, avg_ts = bench_ts) and llama-batched-bench (BATCHED_OUT);
    each appends its arguments to calls.txt."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "batched.txt").write_text(BATCHED_OUT)
    log = d / "calls.txt"
    (d / "llama-bench").write_text(
        f'#!/bin/sh\necho "llama-bench $*" >> {log}\necho "model load..."\n'
        f'echo \'[{{"n_prompt": 0, "avg_ts": {bench_ts}, "stddev_ts": 0.0}}]\'\n'
    )
    (d / "llama-batched-bench").write_text(f'#!/bin/sh\necho "llama-batched-bench $*" >> {log}\ncat {d}/batched.txt\n')
    for t in ("llama-bench", "llama-batched-bench"):
        (d / t).chmod(0o755)
    return d


def test_parse_batched_reads_the_one_result_row(bench):
    ik = bench[0]
    r = ik.parse_batched(BATCHED_OUT)
    assert (r["pp"], r["tg"], r["b"], r["n_kv"]) == (128, 127, 16, 4080)
    assert (r["t_pp_s"], r["t_tg_s"], r["t_s"], r["s_tg"]) == (8.0, 20.0, 28.0, 101.6)
    nan_row = BATCHED_OUT.replace("101.60", "   nan").replace("20.000", " 0.000")
    assert ik.parse_batched(nan_row)["s_tg"] is None  # a rate over 0 tokens
    with pytest.raises(RuntimeError, match="printed 0 result rows"):
        ik.parse_batched("main: error: failed to load model")


def test_parse_bench_reads_avg_ts(bench):
    ik = bench[0]
    assert ik.parse_bench('loading...\n[{"avg_ts": 12.5}]') == 12.5
    with pytest.raises(RuntimeError, match="printed 2 tests"):
        ik.parse_bench('[{"avg_ts": 1}, {"avg_ts": 2}]')


def test_worker_maps_each_measure_to_its_tool(bench, tmp_path):
    ik = bench[0]
    bin_dir = _tools(tmp_path, 40.0)
    w = ik.IkLlamaWorker("m.gguf", "float32", 1, {"ik_llama_bin": str(bin_dir)}, {"rtr": True})
    pre = w.generate([list(range(512))], 1)  # prefill 512: llama-bench -p 512 -n 0 at 40 tok/s
    assert pre["wall_s"] == pytest.approx(512 / 40.0) and pre["rate_b1"] is None and pre["ids"] is None
    dec = w.generate([list(range(4096))], 16)  # batch-1 decode at context 4096: -gp 4096,15
    assert dec["rate_b1"] == 40.0
    c16 = w.generate([list(range(128))] * 16, 128)  # 16 concurrent: batched-bench, 127 steps after the prompts
    assert (c16["wall_s"], c16["first_s"]) == (28.0, 8.0)
    calls = (bin_dir / "calls.txt").read_text().splitlines()
    # the model by its absolute path: the tools run in a folder of their own (their llama.log stays out of the cwd)
    assert (
        calls[0].startswith(f"llama-batched-bench -m {os.path.abspath('m.gguf')} -t 1 ")
        and "-npp 1 -ntg 1 -npl 1" in calls[0]
    )
    assert os.path.abspath(w.workdir) != os.getcwd()
    assert "-p 512 -n 0 -mla 3 -fa 1 -fmoe 1 -rtr 1" in calls[1]
    assert "-p 0 -n 0 -gp 4096,15 -mla 3 -fa 1 -fmoe 1 -rtr 1" in calls[2]
    assert "-c 4096 -b 2048 -ub 512 -npp 128 -ntg 127 -npl 16 -mla 3 -fa on -rtr" in calls[3]
    rss = w.rss()  # the tools' own peak (ru_maxrss of each child), not the worker's
    # > 0 only: on Linux a child's ru_maxrss also counts the spawning process's resident set (its memory is recorded
    # when the child execs), so under a test process that has loaded models it is that process's size, not the tool's
    assert rss["vmhwm_gib"] > 0 and rss["vmhwm_gib"] == max(r["maxrss_gib"] for r in w.runs)
    assert w.info()["options"] == {"mla": 3, "fa": True, "fmoe": True, "rtr": True}
    assert all("m.gguf" not in " ".join(r["args"]) for r in w.runs)  # no paths in what the JSON keeps
    workdir = Path(w.workdir)
    assert workdir.is_dir()
    del w
    gc.collect()
    assert not workdir.exists()  # the tools' folder goes with the worker


def test_worker_refuses_a_missing_tool_and_unknown_options(bench, tmp_path):
    ik = bench[0]
    with pytest.raises(RuntimeError, match="no llama-bench there"):
        ik.IkLlamaWorker("m.gguf", "float32", 1, {"ik_llama_bin": str(tmp_path)}, {})
    bin_dir = _tools(tmp_path, 1.0)
    with pytest.raises(RuntimeError, match="not repack"):
        ik.IkLlamaWorker("m.gguf", "float32", 1, {"ik_llama_bin": str(bin_dir)}, {"repack": False})


def test_offline_engine_spec_and_skip(bench):
    offline, engines = bench[3], bench[4]
    assert engines.parse_spec("ik_llama.cpp@iq_mix:mla=3,fmoe=false") == (
        "ik_llama.cpp",
        "iq_mix",
        {"mla": 3, "fmoe": False},
    )
    with pytest.raises(SystemExit, match="ik_llama.cpp takes only mla, fa, fmoe, rtr"):
        engines.parse_spec("ik_llama.cpp:repack=false")
    args = offline.parse_args(["--engines", "ik_llama.cpp@q8_0", "--gguf", "none"])
    assert args.ik_llama_bin is None
    _, _, skipped = offline.resolve_engines(args, Path("folder"))
    assert "no --ik-llama-bin" in skipped["ik_llama.cpp@q8_0"]


def test_iq_mix_commands(bench, tmp_path):
    iq = bench[1]
    (tmp_path / "llama-quantize").write_text("")
    (tmp_path / "llama-imatrix").write_text("")
    q = iq.quantize_command(tmp_path, Path("m-q8_0.gguf"), Path("m.imatrix"), Path("m-iq_mix.gguf"), 2)
    assert q[1:4] == ["--allow-requantize", "--imatrix", "m.imatrix"]
    pairs = [q[i + 1] for i, a in enumerate(q) if a == "--tensor-type"]
    assert pairs == ["ffn_down_exps=iq3_xxs", "attn_=iq4_xs", "_shexp=iq4_xs", r"blk\.0\.ffn_=iq4_xs"]
    assert q[-4:] == ["m-q8_0.gguf", "m-iq_mix.gguf", "IQ2_XXS", "2"]
    im = iq.imatrix_command(tmp_path, Path("m-q8_0.gguf"), Path("t.txt"), Path("m.imatrix"), 8, 2)
    assert "--no-repack" in im and im[im.index("--chunks") + 1] == "8"
    with pytest.raises(SystemExit, match="no llama-imatrix there"):
        iq.imatrix_command(tmp_path / "none", Path("a"), Path("b"), Path("c"), 1, 1)


def _part(phases: list[str], ours: dict, theirs: dict, load: float, complete: bool = True, date: str = "") -> dict:
    return {
        "model_name": "standard",
        "env": {"date": date, "cpu_simd": ["avx2", "avx512_bf16", "amx_bf16"]},  # an AMX CPU: prefill's 2x
        "complete": complete,
        "phases": phases,
        "settings": {"long_prompt": 4096 if "long" in phases else 2048},
        "results": {
            "mlaserve-gguf@q8_0": ours,
            "llama.cpp@q8_0:repack=false": theirs,
            "ik_llama.cpp@q8_0:mla=3,fa=true,fmoe=true": {"prefill_tok_s": 50.0} if "prefill" in phases else {},
            "loadavg": [{"phase": phases[0], "loadavg": [load, 1, 1]}],
        },
    }


def test_a_cell_in_parts_is_one_row(bench, tmp_path):
    mt = bench[2]
    a = _part(
        ["prefill", "decode"],
        {"prefill_tok_s": 100.0, "peak_rss_gib": 1.0, "load_s": 9.0},
        {"prefill_tok_s": 50.0, "peak_rss_gib": 0.8, "load_s": 2.0},
        12.0,
    )
    b = _part(
        ["long", "c16"],
        {"decode_tok_s_long": 3.0, "peak_rss_gib": 1.5, "load_s": 7.0},
        {"decode_tok_s_long": 2.0, "peak_rss_gib": 0.9, "load_s": 3.0},
        14.0,
        complete=False,
    )
    (tmp_path / "matrix-2026-12-02-standard-q8_0-a.json").write_text(json.dumps(a))
    (tmp_path / "matrix-2026-12-02-standard-q8_0-b.json").write_text(json.dumps(b))
    rows = mt.load_rows(sorted(tmp_path.glob("*.json")))
    assert len(rows) == 1
    m, r = rows[0]["metrics"], rows[0]
    assert m["prefill_tok_s"]["ratio"] == 2.0 and m["prefill_tok_s"]["ratio_ik"] == 2.0
    assert m["decode_tok_s_long"]["ratio"] == 1.5 and m["decode_tok_s_long"]["met"] is True
    assert (m["peak_rss_gib"]["ours"], m["peak_rss_gib"]["theirs"]) == (1.5, 0.9)  # the larger part's peak
    assert (m["load_s"]["ours"], m["load_s"]["theirs"]) == (7.0, 2.0)  # each engine's quickest start of the parts
    assert r["partial"] and r["parts"] == 2 and r["loadavg_1min"] == (12.0, 14.0) and r["long_prompt"] == 4096
    table = mt.markdown(rows)
    assert "| decode b1 at 4096 tok/s | 3.0 | 2.0 | - | 1.50x ok | - | >= 1.2x |" in table
    # a phase measured again later (after a fix, under another tag) replaces the earlier figure, whatever the names
    again = _part(["long"], {"decode_tok_s_long": 4.0}, {"decode_tok_s_long": 2.0}, 1.0, date="2026-12-02 20:00:00")
    b["env"]["date"] = "2026-12-02 10:00:00"
    (tmp_path / "matrix-2026-12-02-standard-q8_0-b.json").write_text(json.dumps(b))
    (tmp_path / "matrix-2026-12-02-standard-q8_0-0-again.json").write_text(json.dumps(again))
    m = mt.load_rows(sorted(tmp_path.glob("*.json")))[0]["metrics"]
    assert (m["decode_tok_s_long"]["ours"], m["decode_tok_s_long"]["ratio"]) == (4.0, 2.0)
    assert (
        "Not measured (no engine has a figure): standard Q8_0 run 1 (partial): prefill 4096 tok/s; "
        "standard Q8_0 run 1 (partial): decode b1 at 128 tok/s; "
    ) in table
    assert table.splitlines()[-3].endswith("standard Q8_0 run 1 (partial): 16 concurrent tok/s.")
    assert "16 concurrent tok/s |" not in table and "token 0 at every position" in table


def test_compact_table_has_one_line_per_file_type(bench, tmp_path):
    mt = bench[2]
    a = _part(["prefill", "decode"], {"prefill_tok_s": 100.0}, {"prefill_tok_s": 50.0}, 12.0)
    a2 = _part(["prefill", "decode"], {"prefill_tok_s": 60.0}, {"prefill_tok_s": 50.0}, 12.0)
    (tmp_path / "matrix-2026-12-02-standard-q8_0-a.json").write_text(json.dumps(a))
    (tmp_path / "matrix-2026-12-02-standard-q8_0-a-run2.json").write_text(json.dumps(a2))
    lines = mt.compact(mt.load_rows(sorted(tmp_path.glob("*.json")))).splitlines()
    assert lines[0].startswith(
        "| model | file | prefill 512 tok/s (>= 2x with bf16 units, else 1.2x) | prefill 2048 tok/s (>= 2x with bf16 units, else 1.2x) | decode b1 at 128 tok/s (>= 1.2x) |"
    )
    assert len(lines) == 3 and lines[2].startswith("| standard | Q8_0 | 2.00x / 1.20x **miss** | - / - | - / - |")


def test_latest_unites_the_runs_of_a_cell(bench, tmp_path):
    """--latest: one row per (model, type); a metric measured in a later run replaces the earlier run's, the
    metrics a later run did not measure keep the earlier figures."""
    mt = bench[2]
    run2 = _part(
        ["prefill", "decode"],
        {"prefill_tok_s": 100.0, "decode_tok_s_b1": 30.0},
        {"prefill_tok_s": 50.0, "decode_tok_s_b1": 40.0},
        1.0,
        date="2026-12-03 10:00:00",
    )
    run4 = _part(["decode"], {"decode_tok_s_b1": 48.0}, {"decode_tok_s_b1": 40.0}, 1.0, date="2026-12-03 15:00:00")
    (tmp_path / "matrix-2026-12-03-standard-q8_0-run2.json").write_text(json.dumps(run2))
    (tmp_path / "matrix-2026-12-03-standard-q8_0-decode-run4.json").write_text(json.dumps(run4))
    files = sorted(tmp_path.glob("*.json"))
    assert len(mt.load_rows(files)) == 2  # runs are rows of their own by default
    (row,) = mt.load_rows(files, latest=True)
    assert row["metrics"]["decode_tok_s_b1"]["ratio"] == 1.2 and row["metrics"]["decode_tok_s_b1"]["met"] is True
    assert row["metrics"]["prefill_tok_s"]["ratio"] == 2.0 and row["parts"] == 2

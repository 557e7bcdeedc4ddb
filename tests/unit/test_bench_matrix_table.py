"""The benchmark matrix's pieces (benchmarks/matrix.py, matrix_table.py): each cell's ratios against issue #31's
targets from an offline.py result, the table line, the file names, and the options the cell's engines take.
Worked from hand-made results whose ratios are known exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    names = ("matrix_table", "matrix", "offline", "offline_engines", "offline_phases", "offline_report", "common")
    for n in names:
        sys.modules.pop(n, None)
    import common
    import matrix
    import matrix_table
    import offline
    import offline_engines
    import offline_phases

    yield matrix_table, matrix, offline, common, offline_engines, offline_phases
    for n in names:
        sys.modules.pop(n, None)


AMX = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # a CPU with bf16 matrix units: prefill's target 2x


def doc(ours: dict, theirs: dict, qtype: str = "q4_k_m", simd: tuple[str, ...] = AMX) -> dict:
    return {
        "model_name": "glm-real",
        "env": {"cpu_simd": list(simd)},
        "results": {
            f"mlaserve-gguf@{qtype}": ours,
            f"llama.cpp@{qtype}:repack=false": theirs,
            "loadavg": [
                {"phase": "prefill 512", "loadavg": [14.5, 15, 16]},
                {"phase": "c16", "loadavg": [12.25, 1, 1]},
            ],
            "greedy_agreement_b1": {},
        },
    }


def test_cell_ratios_against_targets(bench):
    mt = bench[0]
    ours = {"prefill_tok_s": 300.0, "decode_tok_s_b1": 30.0, "output_tok_s_c16": 50.0, "peak_rss_gib": 1.2}
    theirs = {"prefill_tok_s": 100.0, "decode_tok_s_b1": 40.0, "output_tok_s_c16": 25.0, "peak_rss_gib": 1.0}
    row = mt.cell(doc(ours, theirs), run="2")
    m = row["metrics"]
    assert (row["model"], row["type"], row["run"]) == ("glm-real", "q4_k_m", "2")
    assert m["prefill_tok_s"]["ratio"] == 3.0 and m["prefill_tok_s"]["met"] is True  # >= 2x
    assert m["decode_tok_s_b1"]["ratio"] == 0.75 and m["decode_tok_s_b1"]["met"] is False  # < 1.2x
    assert m["output_tok_s_c16"]["ratio"] == 2.0 and m["output_tok_s_c16"]["met"] is True  # exactly the target
    assert m["peak_rss_gib"]["ratio"] == pytest.approx(1.2) and m["peak_rss_gib"]["met"] is False  # > 1.15x
    assert row["loadavg_1min"] == (12.25, 14.5)
    lines = mt.markdown([row]).splitlines()
    assert (
        lines[2]
        == "| glm-real | Q4_K_M | 2 | prefill 512 tok/s | 300.0 | 100.0 | not run | 3.00x ok | - | >= 2.0x | 12.2-14.5 |"
    )
    assert "| decode b1 at 128 tok/s | 30.0 | 40.0 | not run | 0.75x **miss** | - | >= 1.2x |" in lines[3]
    assert "| peak RSS GiB | 1.20 | 1.00 | not run | 1.20x **miss** | - | <= 1.15x |" in lines[5]
    assert (
        lines[-1]
        == "Not measured (no engine has a figure): glm-real Q4_K_M run 2: prefill 2048 tok/s; glm-real Q4_K_M run 2: "
        "decode b1 at 2048 tok/s; glm-real Q4_K_M run 2: start s."
    )


def test_prefill_target_follows_the_runs_cpu(bench):
    """Issue #31's prefill target is 2x on a CPU with AMX-BF16 or AVX512-BF16 and 1.2x elsewhere: the same 1.5x
    misses on the first and meets on an AVX2-only CPU (its JSON's env.cpu_simd); the other targets do not move."""
    mt = bench[0]
    ours, theirs = {"prefill_tok_s": 150.0, "decode_tok_s_b1": 30.0}, {"prefill_tok_s": 100.0, "decode_tok_s_b1": 30.0}
    amx = mt.cell(doc(ours, theirs))["metrics"]
    avx2 = mt.cell(doc(ours, theirs, simd=("avx", "avx2", "fma", "f16c")))["metrics"]
    assert (amx["prefill_tok_s"]["target"], amx["prefill_tok_s"]["met"]) == (2.0, False)
    assert (avx2["prefill_tok_s"]["target"], avx2["prefill_tok_s"]["met"]) == (1.2, True)
    assert amx["decode_tok_s_b1"]["target"] == avx2["decode_tok_s_b1"]["target"] == 1.2


def test_a_long_prefill_part_is_its_own_column(bench, tmp_path):
    """matrix.py --long-prefill: a part whose prefill took the long prompt fills the long prefill column, and the
    512-token part's figures stay in theirs whichever was measured last."""
    mt, matrix = bench[0], bench[1]
    short = doc({"prefill_tok_s": 300.0}, {"prefill_tok_s": 100.0})
    long = doc({"prefill_tok_s": 80.0}, {"prefill_tok_s": 16.0})
    short["settings"] = {"prefill_len": 512, "long_prompt": 4096}
    long["settings"] = {"prefill_len": 4096, "long_prompt": 4096}
    short["env"], long["env"] = {"date": "2026-12-04T21:00"}, {"date": "2026-12-04T22:00"}
    (tmp_path / "matrix-x-glm-real-q4_k_m-prefill.json").write_text(json.dumps(short))
    (tmp_path / "matrix-x-glm-real-q4_k_m-prefill4096.json").write_text(json.dumps(long))
    (row,) = mt.load_rows(sorted(tmp_path.glob("*.json")))
    m = row["metrics"]
    assert (m["prefill_tok_s"]["ours"], m["prefill_tok_s"]["ratio"]) == (300.0, 3.0)
    assert (m["prefill_tok_s_long"]["ours"], m["prefill_tok_s_long"]["ratio"]) == (80.0, 5.0)
    assert "| prefill 4096 tok/s | 80.0 | 16.0 | not run | 5.00x ok |" in mt.markdown([row])
    cmd = matrix.cell_command("glm-real", "q4_k_m", ["prefill"], Path("x.json"), long_prefill=True)
    assert cmd[cmd.index("--prefill-len") + 1] == "4096"
    assert "--prefill-len" not in matrix.cell_command("glm-real", "q4_k_m", ["prefill"], Path("x.json"))


def test_cell_with_a_failed_engine_has_no_ratio(bench):
    mt = bench[0]
    row = mt.cell(doc({"prefill_tok_s": 300.0}, {}), run="")
    m = row["metrics"]["prefill_tok_s"]
    assert (m["ours"], m["theirs"], m["ik"], m["ratio"], m["met"], m["target"]) == (300.0, None, None, None, None, 2.0)
    assert row["metrics"]["prefill_tok_s"]["ratio_ik"] is None
    assert "| prefill 512 tok/s | 300.0 | - | not run | - | - | >= 2.0x |" in mt.markdown([row])


def test_partial_run_is_marked_and_run_again(bench, tmp_path):
    mt, matrix = bench[0], bench[1]
    d = doc({"prefill_tok_s": 300.0}, {"prefill_tok_s": 100.0})
    d["complete"] = False
    row = mt.cell(d)
    assert row["partial"] and "| glm-real | Q4_K_M | 1 (partial) | prefill 512 tok/s | 300.0 | 100.0 |" in mt.markdown(
        [row]
    )
    f = tmp_path / "cell.json"
    assert not matrix.cell_done(f)
    f.write_text('{"complete": false}')
    assert not matrix.cell_done(f)
    f.write_text('{"complete": true}')
    assert matrix.cell_done(f)


def test_cell_needs_one_engine_of_each(bench):
    mt = bench[0]
    d = doc({}, {})
    d["results"]["mlaserve-gguf@q8_0"] = {}
    with pytest.raises(ValueError, match="one mlaserve and one llama.cpp engine"):
        mt.cell(d)
    d = doc({}, {})
    d["results"]["ik_llama.cpp@q4_k_m"] = d["results"]["ik_llama.cpp@q4_k_m:rtr=true"] = {}
    with pytest.raises(ValueError, match="at most one ik_llama.cpp"):
        mt.cell(d)


def test_file_type_and_cell_files(bench):
    mt, matrix, offline, common = bench[:4]
    assert mt.file_type("mlaserve-gguf@q6_k") == "q6_k"
    assert mt.file_type("llama.cpp@q4_0:repack=false") == "q4_0"
    assert mt.file_type("mlaserve-gguf") == "q8_0"
    assert (
        str(matrix.cell_path("2026-12-02", "standard", "q8_0", 1))
        == "docs/results/matrix-2026-12-02-standard-q8_0.json"
    )
    assert matrix.cell_path("2026-12-02", "ds-real", "q4_0", 3).name == "matrix-2026-12-02-ds-real-q4_0-run3.json"
    cmd = matrix.cell_command("ds-real", "q6_k", ["prefill"], Path("x.json"))
    assert cmd[cmd.index("--engines") + 1 : cmd.index("--phases")] == [
        "mlaserve-gguf@q6_k",
        "llama.cpp@q6_k:repack=false",
    ]
    cmd = matrix.cell_command("ds-real", "q6_k", ["decode"], Path("x.json"), llama_repack=True)
    assert cmd[cmd.index("--engines") + 2] == "llama.cpp@q6_k:repack=true"
    # offline.py names the models without importing torch; the names are common.MODELS' keys
    assert set(offline.MODEL_NAMES) == set(common.MODELS)


def test_llama_cpp_engine_takes_repack_only(bench):
    engines = bench[4]
    assert engines.parse_spec("llama.cpp@q4_k_m:repack=false") == ("llama.cpp", "q4_k_m", {"repack": False})
    with pytest.raises(SystemExit, match="llama.cpp takes only repack"):
        engines.parse_spec("llama.cpp:kernels=torch")
    with pytest.raises(SystemExit, match="only mlaserve, llama.cpp and ik_llama.cpp engines take options"):
        engines.parse_spec("transformers:repack=false")


def test_real_shape_models_keep_the_released_widths(bench):
    common = bench[3]
    ds, glm, dsa = (common.model_config(k, quick=False) for k in ("ds-real", "glm-real", "glm-real-dsa"))
    assert (ds["hidden_size"], ds["kv_lora_rank"], ds["q_lora_rank"], ds["n_routed_experts"]) == (2048, 512, 1536, 64)
    assert (ds["num_experts_per_tok"], ds["n_shared_experts"], ds["num_hidden_layers"]) == (6, 2, 4)
    assert (glm["q_lora_rank"], glm["kv_lora_rank"], glm["qk_nope_head_dim"], glm["v_head_dim"]) == (768, 512, 192, 256)
    assert (glm["num_attention_heads"], glm["n_routed_experts"], glm["num_experts_per_tok"]) == (20, 64, 4)
    assert dsa["model_type"] == "glm_moe_dsa" and dsa["index_topk"] == 2048
    assert {k: v for k, v in dsa.items() if not k.startswith("index_")} | {
        "model_type": glm["model_type"],
        "architectures": glm["architectures"],
        "max_position_embeddings": glm["max_position_embeddings"],
    } == glm
    assert common.model_folder("glm-real", quick=False).name == "mla-glm-real-l4-seed0"
    assert common.model_folder("standard", quick=False).name == "mla-std-l12-seed0"  # unchanged


class _Engine:
    """What run_engines touches of offline_engines.Engine; every call answers "failed" (None)."""

    def __init__(self, spec: str, path: Path) -> None:
        self.spec, self.path, self.load, self.last_rss, self.status = spec, path, {}, {}, None

    def start(self) -> bool:
        return True

    def stop(self) -> None:
        pass

    def call(self, op: str, *args):
        return None


@pytest.mark.parametrize("sequential", [False, True])
def test_offline_hands_over_the_results_after_every_phase(bench, tmp_path, sequential):
    """offline.py writes its JSON after each phase (a cell stopped on a loaded machine keeps what it measured):
    run_engines calls on_phase once per phase (per engine and phase with --sequential), with the load records
    of the phases run so far."""
    offline, run = bench[2], bench[5]
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"x")
    s = offline.QUICK
    P = run.prompts_for(s, 1000)
    seen: list[int] = []
    engines = [_Engine("a", weights), _Engine("b", weights)]
    run.run_engines(engines, s, P, sequential, ["prefill"], lambda res: seen.append(len(res["loadavg"])))
    n = 3 * (2 if sequential else 1)  # warm-up, prefill, info
    assert seen == list(range(1, n + 1))


def test_results_keep_no_machine_paths(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import common

    doc = {
        "kernels": ["avx512 kernels, /home/u/.cache/mlaserve/kernels/mls-1.so"],
        "error": {"tool": "aborted at /src/ik/llama-hparams.cpp:1097: Fatal error", "rate": "12 tok/s, 3 GB/s"},
        "weights": "benchmarks/models/m-q8_0.gguf",
    }
    common.write_json(tmp_path / "r.json", doc)
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["kernels"] == ["avx512 kernels, mls-1.so"]
    assert got["error"] == {"tool": "aborted at llama-hparams.cpp:1097: Fatal error", "rate": "12 tok/s, 3 GB/s"}
    assert got["weights"] == "benchmarks/models/m-q8_0.gguf"  # relative to the checkout: kept


def test_parts_with_llama_cpp_under_two_settings_unite(bench):
    """matrix.py --llama-repack true for some phases, false for others: one llama.cpp engine per cell, each metric
    from the part that measured it, and its peak RSS the smaller of the two (its better setting for memory), not
    the larger that the parts of one setting take."""
    mt = bench[0]
    pf = doc({"prefill_tok_s": 300.0, "peak_rss_gib": 0.8}, {"prefill_tok_s": 150.0, "peak_rss_gib": 0.5})
    rp = doc({"decode_tok_s_b1": 30.0, "peak_rss_gib": 1.0}, {"decode_tok_s_b1": 40.0, "peak_rss_gib": 0.75})
    rp["results"]["llama.cpp@q4_k_m:repack=true"] = rp["results"].pop("llama.cpp@q4_k_m:repack=false")
    merged = mt.merge_parts([pf, rp])
    assert merged["settings"]["engines"] == [
        "llama.cpp@q4_k_m:repack=false",
        "llama.cpp@q4_k_m:repack=true",
        "mlaserve-gguf@q4_k_m",
    ]
    m = mt.cell(merged)["metrics"]
    assert (m["prefill_tok_s"]["ratio"], m["decode_tok_s_b1"]["ratio"]) == (2.0, 0.75)
    assert (m["peak_rss_gib"]["ours"], m["peak_rss_gib"]["theirs"]) == (1.0, 0.5)  # ours the largest, theirs the least
    same = mt.merge_parts([pf, doc({}, {"peak_rss_gib": 0.75})])  # one setting in every part: the largest
    assert mt.cell(same)["metrics"]["peak_rss_gib"]["theirs"] == 0.75

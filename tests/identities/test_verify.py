"""`mlaserve verify` passes on a correct model and catches a broken route."""

from __future__ import annotations

import re

import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.entrypoints.cli import main
from mlaserve.entrypoints.verify import run_checks
from mlaserve.models.deepseek import MLAAttention


def test_verify_passes_on_dsa_model(hf_model_dir):
    folder, _ = hf_model_dir("glm_dsa")
    checks = run_checks(LLM(str(folder)), random_ids(40))
    assert [c.passed for c in checks] == [True] * 7
    assert any("sparse vs dense" in c.name for c in checks)
    assert checks[-1].name == "torch vs reference backend, sparse top-16"  # top-k lowered below 40 tokens


def test_verify_catches_a_broken_absorbed_path(hf_model_dir, monkeypatch):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    original = MLAAttention.w_uk_uv

    def wrong_w_uk(self, kv_b=None):  # a W_UK from the wrong head: the bug class a mis-split kv_b produces
        w_uk, w_uv = original(self, kv_b)
        return torch.roll(w_uk, 1, dims=0), w_uv

    monkeypatch.setattr(MLAAttention, "w_uk_uv", wrong_w_uk)
    checks = {c.name: c for c in run_checks(llm, random_ids(24))}
    assert not checks["absorbed vs decompressed"].passed
    assert not checks["token-by-token decode vs one pass"].passed


def test_verify_cli_exit_code(hf_model_dir, capsys):
    folder, _ = hf_model_dir("v2_noq")
    assert main(["verify", str(folder), "--prompt", "ab"]) == 2  # this folder has no tokenizer: clear error
    assert "no tokenizer" in capsys.readouterr().err


def test_verify_cli_on_gguf_fixture(capsys):
    from conftest import fixture_dir

    path = fixture_dir("ds32") / "model-q8_0.gguf"
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    # the prompt selects (longer than the fixture's index_topk): the token-by-token check names its decode layers
    assert len(re.findall(r"%   ok[ :]", out)) == 7 and "FAIL" not in out
    assert "token-by-token decode vs one pass" in out and "per-op decode layers" in out


def test_verify_cli_judges_in_float32_when_auto_would_pick_bfloat16(capsys, monkeypatch):
    """dtype=auto is bfloat16 for float weights on AVX512-BF16/AMX CPUs; verify's identities are judged in
    float32 unless --dtype asks otherwise."""
    from conftest import fixture_dir

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    assert main(["verify", str(fixture_dir("ds3")), "--prompt", "Hello world"]) == 0
    out = capsys.readouterr().out
    assert "info" not in out and "FAIL" not in out and " ok " in out


def test_verify_cli_judges_lossy_auto_switches_exact(capsys, monkeypatch):
    """On a CPU where auto takes int8 activations and bf16 prefill products for a Q4_K_M file (forced here), verify
    pins them (and dtype, index_scores) to their exact values, says so, and judges the identities at fp32 grade;
    a switch given explicitly is kept (commands/verification.py EXACT_SWITCHES)."""
    from conftest import fixture_dir

    from mlaserve.entrypoints.commands import verification

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    monkeypatch.setenv("MLASERVE_INT8_ROWS", "1")
    path = fixture_dir("ds32") / "model-q4_k_m.gguf"
    assert main(["verify", str(path), "--prompt", "Hello world, hello again"]) == 0
    out = capsys.readouterr().out
    assert "judged with exact compute (dtype=float32, activations=float, prefill_matmul=float, index_scores=fp32" in out
    assert "FAIL" not in out and " ok " in out
    args = type("Args", (), {"dtype": "auto", "activations": "int8", "prefill_matmul": None, "index_scores": "auto"})()
    assert verification._exact_switches(args) == ["dtype=float32", "prefill_matmul=float", "index_scores=fp32"]
    assert args.activations == "int8"  # given explicitly: kept


def test_run_checks_reports_routes_it_cannot_judge_under_lossy_switches(monkeypatch):
    """run_checks on an engine that runs lossy switches (here int8 activations and int8 / bf16 prefill products on
    the ds32 Q4_K_M fixture, forced on as a VNNI / AVX512-BF16 CPU would choose them) reports its routes with the
    switches named instead of failing them (`serve --verify` refused to serve such files); on the same file with
    exact compute it judges them (and they pass)."""
    from conftest import fixture_dir

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    monkeypatch.setenv("MLASERVE_INT8_ROWS", "1")
    path = str(fixture_dir("ds32") / "model-q4_k_m.gguf")
    llm = LLM(path)
    ids = llm.encode("Hello world, hello again")
    checks = run_checks(llm, ids)
    assert checks and all(c.tolerance is None and "activations" in c.note for c in checks), checks
    exact = run_checks(LLM(path, activations="float", prefill_matmul="float"), ids)
    assert exact and all(c.tolerance == 1e-4 and c.passed for c in exact), exact

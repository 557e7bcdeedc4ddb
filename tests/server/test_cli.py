"""The command line and the default model a fresh install runs."""

from __future__ import annotations

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.embedded import build_random_tiny
from mlaserve.entrypoints.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_random_tiny(tmp_path_factory.mktemp("tiny") / "random-tiny")


def test_generate_streams_text_and_writes_the_trace(tiny, tmp_path, capsys):
    trace = tmp_path / "route.jsonl"
    assert main(["generate", "--model", str(tiny), "--max-tokens", "6", "--trace", str(trace), "Hello"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello") and len(out) > len("Hello\n")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["segments"][0]["phase"] == "prefill" and records[0]["num_mha_tokens"] == 6  # <bos> Hello
    assert all(r["segments"][0]["phase"] == "decode" and r["num_mqa_tokens"] == 1 for r in records[1:])
    assert {"step", "layers", "num_mqa_tokens", "num_mha_tokens", "num_sparse_tokens"} <= set(records[0])


def test_inspect_prints_provenance(tiny, capsys):
    assert main(["inspect", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "is_sparse" in out and "attention='auto': deepseek_v3 has no indexer" in out
    assert "latent_norm_eps" in out


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("generate", "inspect", "verify", "convert"):
        assert cmd in out


def test_bad_model_path_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/nonexistent/model", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_stop_string_is_excluded_from_text(tiny):
    llm = LLM(str(tiny))
    full = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    stop = full[4:6]
    assert stop and 0 < full.index(stop) <= 4  # its first occurrence: the text before it is kept, and is not empty
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == full[: full.index(stop)] and out.outputs[0].finish_reason == "stop"

"""Schemathesis against the server's own /openapi.json: no request shape gets a 5xx, and the answers
agree with the document (status codes, content types, error bodies, undeclared methods).

Bounded: a fixed seed, few examples per operation and a time limit. The context is cut to 48 tokens
so a generated request that runs to the end of the context stays short. One check is left out:
`positive_data_acceptance` (a schema-valid request is accepted), as whether a prompt plus max_tokens
fits the context depends on the tokenizer, which no schema states."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inproc_server import InProcServer

from mlaserve.entrypoints.llm import LLM

pytest.importorskip("schemathesis")
CONTEXT = 48
EXCLUDED = "positive_data_acceptance"


@pytest.fixture(scope="module")
def server():
    llm = LLM()
    llm.engine.max_model_len = CONTEXT
    srv = InProcServer(llm, max_queued=16)
    yield srv
    srv.stop()


def _st() -> str:
    exe = Path(sys.executable).with_name("st")
    return str(exe) if exe.exists() else (shutil.which("st") or pytest.skip("the schemathesis CLI (st) is absent"))


def test_schemathesis_finds_nothing(server, tmp_path):
    cmd = [
        _st(), "run", server.url + "/openapi.json",
        "--checks", "all", "--exclude-checks", EXCLUDED,
        "--mode", "all", "--max-examples", "12", "--seed", "7", "--max-time", "75",
        "--workers", "1", "--request-timeout", "30", "--output-truncate", "true",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "generated" in out  # it ran cases
    assert server.wait_idle() == 0 and server.serving.in_flight == 0

"""Schemathesis against the server's own /openapi.json: no request shape gets a 5xx, and the answers
agree with the document (status codes, content types, error bodies, undeclared methods).

Bounded: a fixed seed, few examples per operation and a time limit. The context is cut to 48 tokens
so a generated request that runs to the end of the context stays short. Every check runs, including
`positive_data_acceptance` (ST202: a schema-valid request is accepted). The one refusal of schema-valid
data that no JSON Schema can state, a prompt plus max_tokens over the context, is dropped by the
`filter_failure` hook in tests/st_hooks.py only after it checked the refusal is true (code, numbers, the
prompt's measured length); every dropped one is listed, so the test sees how many there were."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inproc_server import InProcServer

from mlaserve.entrypoints.llm import LLM

pytest.importorskip("schemathesis")
CONTEXT = 48
TESTS = Path(__file__).resolve().parents[1]


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
        "--checks", "all",
        "--mode", "all", "--max-examples", "12", "--seed", "7", "--max-time", "40",
        "--workers", "1", "--request-timeout", "30", "--output-truncate", "true",
        "--report", "junit", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    dropped = tmp_path / "dropped.jsonl"
    env = dict(
        os.environ,
        SCHEMATHESIS_HOOKS="st_hooks",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        ST_CONTEXT=str(CONTEXT),
        ST_BASE_URL=server.url,
        ST_DROPPED=str(dropped),
    )
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "generated" in out  # it ran cases
    for line in dropped.read_text().splitlines() if dropped.exists() else []:
        message = json.loads(line)["message"]  # only the verified kinds (tests/st_hooks.py) were dropped
        verified = ("context of 48", "context (48", "arguments are not a JSON object", "appears twice")
        verified += ("which is not among the tools", "cannot be compiled", "not valid JSON", "must be a JSON object")
        verified += ("Input should be",)
        assert any(v in message for v in verified), message
    assert server.wait_idle() == 0 and server.serving.in_flight == 0

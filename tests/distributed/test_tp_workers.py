"""Tensor-parallel workers are fresh `python` processes that never re-import the caller's main
module: TP=2 works from `python -` (stdin) and from a script without a `__main__` guard (both
failed with "rank 1 died (exit code 1)" when workers were multiprocessing children), and a worker
that dies before it can report is named with its stderr's last words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.distributed.group import TensorParallelError
from mlaserve.distributed.spawn import live_workers

OPTS = dict(page_size=8, max_num_batched_tokens=24)
RUN_TIMEOUT_S = 240  # a hang becomes a failure

SCRIPT = """
import sys
import torch
from mlaserve import LLM

torch.set_num_threads(1)
llm = LLM({folder!r}, tensor_parallel_size=2, page_size=8, max_num_batched_tokens=24)
torch.save(llm.prompt_logits({ids!r}), {out!r})
llm.close()
print("done")
"""


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


@pytest.fixture(scope="module")
def tp1_logits(hf_model_dir):
    folder, _ = hf_model_dir("v3_odd")
    ids = random_ids(30)
    with LLM(str(folder), **OPTS) as llm:
        return str(folder), ids, llm.prompt_logits(ids)


def _check(out: Path, ref: torch.Tensor, proc: subprocess.CompletedProcess) -> torch.Tensor:
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout + proc.stderr
    got = torch.load(out)
    assert (got - ref).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    return got


def test_tp2_from_stdin_and_from_a_script_without_main_guard(tp1_logits, tmp_path):
    folder, ids, ref = tp1_logits
    from_stdin, from_file = tmp_path / "stdin.pt", tmp_path / "file.pt"
    script_dir = tmp_path / "elsewhere"
    script_dir.mkdir()
    script = script_dir / "run_tp.py"
    script.write_text(SCRIPT.format(folder=folder, ids=ids, out=str(from_file)))
    # both callers at once: each is an interpreter + torch import, then a worker's, one core busy at a time
    # (run one after the other they cost twice the wall time on 2 cores)
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    stdin_proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, **kw)
    file_proc = subprocess.Popen([sys.executable, str(script)], **kw)
    done = []
    for proc, text in ((stdin_proc, SCRIPT.format(folder=folder, ids=ids, out=str(from_stdin))), (file_proc, None)):
        try:
            out, err = proc.communicate(text, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in (stdin_proc, file_proc):
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    a = _check(from_stdin, ref, done[0])
    b = _check(from_file, ref, done[1])
    assert torch.equal(a, b)  # the same group either way


def test_a_worker_that_fails_at_import_is_named_with_its_reason(hf_model_dir, tmp_path, monkeypatch):
    """A `torch` that cannot be imported, seen only by the worker (this process imported torch
    long ago): the worker dies before it joins, and its traceback's last line is in the error."""
    folder, _ = hf_model_dir("v3_odd")
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torch.py").write_text('raise ImportError("this torch is broken for the test")\n')
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    before = set(live_workers())
    with pytest.raises(TensorParallelError) as err:
        LLM(str(folder), tensor_parallel_size=2, **OPTS)
    msg = str(err.value)
    assert "tensor-parallel rank 1 died (exit code 1)" in msg, msg
    assert "ImportError: this torch is broken for the test" in msg, msg
    assert not set(live_workers()) - before

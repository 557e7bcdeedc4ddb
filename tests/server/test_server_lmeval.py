"""lm-eval's `local-completions` model against `mlaserve serve`, offline, on a shipped task.

tests/data/serve_mc.jsonl: 31 multiple-choice items (held-out KJV verses: context, four 4-word
continuations, the true one gold). lm-eval asks the server for echo logprobs of context +
continuation; the reference computes the same log-likelihoods from LLM.prompt_logits, tokenized
the way lm-eval does (context and context+continuation encoded without special tokens, the
continuation = the tokens past the context's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
DATA = Path(__file__).parents[1] / "data" / "serve_mc.jsonl"

TASK = """task: mlaserve_serve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def reference(llm, hf_tok, items) -> tuple[float, list[list[float]]]:
    """Accuracy and per-choice log-likelihoods from the offline engine's prompt logits."""
    correct, lls = 0, []
    for item in items:
        ctx = hf_tok(item["context"], add_special_tokens=False).input_ids
        row = []
        for choice in item["choices"]:
            whole = hf_tok(item["context"] + " " + choice, add_special_tokens=False).input_ids
            lp = torch.log_softmax(llm.prompt_logits(whole), -1)
            cont = torch.tensor(whole[len(ctx) :])
            row.append(lp[len(ctx) - 1 : len(whole) - 1].gather(1, cont[:, None]).sum().item())
        lls.append(row)
        correct += int(max(range(len(row)), key=row.__getitem__) == item["gold"])
    return correct / len(items), lls


def test_lm_eval_local_completions_matches_prompt_logits(tmp_path, embedded_server):
    from transformers import AutoTokenizer

    from mlaserve.embedded import default_model_path
    from mlaserve.entrypoints.llm import LLM

    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "serve_mc.yaml").write_text(TASK.format(data=DATA))
    srv = embedded_server  # the session's (conftest.py): it must exit cleanly at the session's end
    try:
        args = (
            f"model={srv.model},base_url={srv.url}/v1/completions,tokenizer={default_model_path()},"
            "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
        )
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--tasks",
            "mlaserve_serve_mc",
        ]
        cmd += ["--include_path", str(tmp_path / "task"), "--output_path", str(tmp_path / "out"), "--log_samples"]
        run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        assert srv.proc.poll() is None, srv.logs()  # still serving after lm-eval's run
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    items = [json.loads(line) for line in DATA.read_text().splitlines()]
    acc, lls = reference(LLM(), AutoTokenizer.from_pretrained(str(default_model_path())), items)
    assert results["results"]["mlaserve_serve_mc"]["acc,none"] == pytest.approx(acc, abs=1e-12)
    worst = 0.0
    for s in samples:
        got = [float(r[0]) for r in s["filtered_resps"]]
        worst = max([worst] + [abs(g - w) for g, w in zip(got, lls[s["doc_id"]])])
        # a sum of ~5 logprobs, each off by fp32 rounding of the same forward batched otherwise (<= 1e-5);
        # measured 5.0e-6
        assert got == pytest.approx(lls[s["doc_id"]], abs=5e-5)
    print(f"lm-eval log-likelihoods vs offline: max {worst:.2e}")
    assert 0.25 < acc  # the trained model beats chance on held-out verses

"""What the expert-parallel tests share (tests/distributed/test_expert_parallel.py, test_tp_x_ep.py): a parallel
LLM against one process on the same checkpoint, and the float kimi_k2 folder whose 5 routed experts split unevenly
over 2 ranks (3 + 2).

Bound: FP32_LOGITS_TOL (conftest.py); each test module writes what it measured against it and why."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import FP32_LOGITS_TOL, compare_logits
from hf_models import make_config, random_ids, reinit_

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams

OPTS = dict(max_num_batched_tokens=40)  # both sides' scheduling: several steps for the prompts below


def assert_equals_one_process(
    one: LLM, many: LLM, ids: list[int], ref: torch.Tensor | None, max_tokens: int, what: str
) -> list[dict]:
    """`many` (a parallel LLM made with trace="memory") == `one` (one process): prompt logits of `ids` within the
    bound with the same top-1 (and of `ref`, a reference's logits, when given); greedy tokens of three prompts
    identical. -> `many`'s ledger records of the greedy run."""
    a, b = one.prompt_logits(ids), many.prompt_logits(ids)
    diff, top1 = compare_logits(b, a)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (what, diff)
    if ref is not None:
        diff, top1 = compare_logits(b, ref)
        assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (what, diff)
    prompts = [random_ids(n, seed=n) for n in (12, 5, 9)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    before = len(many.runner.tracer.records)
    assert [o.outputs[0].token_ids for o in many.generate(prompts, params)] == want, what
    return list(many.runner.tracer.records)[before:]


def save_uneven_experts(folder: Path):
    """kimi_k2 with 5 routed experts (3 + 2 over 2 ranks), float32, saved by transformers' save_pretrained to
    `folder` (its head_dim key dropped, as tests/hf_models.py save_hf_model does: real DeepSeek configs have
    none). -> the transformers model, the reference."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("kimi_k2")
    cfg.n_routed_experts = 5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    reinit_(model, 0)
    model.eval().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config))
    return model

"""What the expert-parallel tests share (tests/distributed/test_expert_parallel.py, test_tp_x_ep.py,
test_parallel_bf16.py): a parallel LLM against one process on the same checkpoint, and the float (fp32 or bf16)
kimi_k2 folder whose 5 routed experts split unevenly over 2 ranks (3 + 2).

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


def save_uneven_experts(folder: Path, dtype: torch.dtype = torch.float32):
    """kimi_k2 with 5 routed experts (3 + 2 over 2 ranks), stored in `dtype` (float32, or bfloat16: the weights
    rounded once), saved by transformers' save_pretrained to `folder` (its head_dim key dropped, as
    tests/hf_models.py save_hf_model does: real DeepSeek configs have none). -> the transformers model in float32
    holding the stored weights (bf16 widens exactly), the reference."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("kimi_k2")
    cfg.n_routed_experts = 5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    reinit_(model, 0)
    with torch.no_grad():  # the parameters rounded to the stored dtype in place (buffers such as RoPE's stay)
        for p in model.parameters():
            p.copy_(p.to(dtype))
    stored = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.eval().save_pretrained(folder, state_dict=stored)
    config = json.loads((folder / "config.json").read_text())
    config.pop("head_dim", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config))
    return model

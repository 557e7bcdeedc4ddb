"""LongCat-Flash under expert parallelism (CPU, gloo, 2 processes): the real experts spread (5 over 2 ranks:
[0, 3) and [3, 5)), the identity (zero-computation) experts held by no rank and added by every rank after the
real experts' all-reduce (distributed/expert_parallel.py says why that is exact and counted once).
EP=2 == one process == transformers (longcat_flash) on the same random fp32 weights.

Bound: conftest's fp32_logits_tol (1e-5 at these logits, |max| < 8): transformers' own fp32 run of this model is
7.8e-6 from fp64 (tests/models/test_longcat_flash.py measures it), and EP=2 only reorders fp32 additions (each
rank's partial, the all-reduce, then the identity share). Measured: EP=2 vs one process 1.1e-6, EP=2 vs
transformers 1.1e-6 (one process vs transformers 0); greedy tokens identical. Broken on purpose: every rank
adding the identity share twice (as two ranks each adding it to their partial would) is 0.79 off.
One spawn serves every check."""

from __future__ import annotations

import pytest
import torch
from conftest import compare_logits, fp32_logits_tol
from hf_models import hf_logits, random_ids, reinit_

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=96,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=12,
    moe_topk=3,
    n_routed_experts=5,  # uneven: 3 + 2
    zero_expert_num=2,  # identity experts 5 and 6
    expert_ffn_hidden_size=24,
    routed_scaling_factor=2.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
E, K = CONFIG["n_routed_experts"], CONFIG["moe_topk"]
OPTS = dict(max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("longcat_flash", **CONFIG), dtype=torch.float32, attn_implementation="eager"
    )
    reinit_(model, 0)  # random correction bias: tokens pick real and identity experts (checked below)
    folder = tmp_path_factory.mktemp("longcat_ep")
    model.eval().save_pretrained(folder)
    return str(folder), model


def _routes(llm: LLM, ids: list[int]) -> list[torch.Tensor]:
    got = []
    hooks = [
        layer.mlp.router.register_forward_hook(lambda m, i, out: got.append(out[1]))
        for layer in llm.loaded.model.model.layers
    ]
    try:
        llm.prompt_logits(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_longcat_ep2_equals_one_process_and_transformers(longcat):
    path, ref_model = longcat
    ids = random_ids(24, seed=7)
    ref = hf_logits(ref_model, ids)
    one = LLM(path, **OPTS)
    with LLM(path, expert_parallel_size=2, trace="memory", **OPTS) as two:
        # the prompt exercises every kind of pair: identity experts, real experts on rank 0 and on rank 1
        routes = torch.cat(_routes(one, ids))
        assert (routes >= E).any() and (routes < 3).any() and ((routes >= 3) & (routes < E)).any(), routes
        a, b = one.prompt_logits(ids), two.prompt_logits(ids)
        bound = fp32_logits_tol(ref)
        for got, want in ((b, a), (b, ref), (a, ref)):
            diff, top1 = compare_logits(got, want)
            assert diff <= bound and top1 == 1.0, diff

        prompts = [random_ids(n, seed=n) for n in (12, 5, 9)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        before = len(two.runner.tracer.records)
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        assert got == want
        records = list(two.runner.tracer.records)

        # which rank holds which experts: the echo, the load notes (inspect prints them) and the ledger's first record
        echoes = two.runner.rank_echoes
        for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
            held = [next(h for h in echo["routed_experts"] if h["layer"] == layer) for echo in echoes]
            assert [tuple(h["experts"]) for h in held] == [(0, 3), (3, 5)]
            assert held[0]["bytes"] * 2 == held[1]["bytes"] * 3  # per expert stacks: 3 vs 2 experts
        assert any("experts [3, 5) of 5 (+ 2 identity experts, added by every rank)" in n for n in echoes[1]["notes"])
        assert any("expert_holdings" in r for r in records)

        # every step's pairs accounted: the real ones on the rank holding the expert, the identity ones on every
        # rank (each adds them), so real pairs summed over ranks + identity pairs once == tokens x k x layers
        new = records[before:]
        trunk = [r for r in new if r.get("rank") == 0 and "num_tokens" in r and "mtp" not in r.get("layers", "")]
        steps = {r["step"]: r["num_tokens"] for r in trunk}  # the MTP passes' records (layers "mtp (N)") left out
        loads = [r for r in new if "expert_load" in r]
        assert loads and len(loads) == len(steps)
        identity_seen = 0
        for rec in loads:
            load = rec["expert_load"]
            assert load[0]["identity"] == load[1]["identity"], rec
            identity_seen += load[0]["identity"]
            assert sum(x["pairs"] for x in load) + load[0]["identity"] == steps[rec["step"]] * K * 2, rec
        assert identity_seen > 0

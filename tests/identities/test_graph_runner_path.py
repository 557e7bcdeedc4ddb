"""The runner's graph path on the CPU: with graphs planned on, every pure decode step goes to the graphs object
(DecodeGraphs' interface: run(plan, padded) -> real rows' logits and hidden states) and every other step runs eagerly;
here the graphs object runs the captured body (padded_decode.run_padded) eagerly, so the plumbing - the plan per
step, the padded step, the rows handed back, the ledger's graph field - is checked without CUDA, and greedy tokens
equal the eager engine's (the padded step differs from the eager one by fp32 rounding only, <= 1.4e-6 measured in
test_padded_decode.py)."""

from __future__ import annotations

from dataclasses import replace

from hf_models import random_ids

from mlaserve import LLM, SamplingParams
from mlaserve.executor.padded_decode import run_padded

PROMPTS = [random_ids(n, seed=n) for n in (5, 17, 9, 33, 12)]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 14, 20, 24)]


class EagerGraphs:
    """DecodeGraphs without CUDA: the body a capture records, run eagerly at each 'replay'."""

    def __init__(self, model, cache) -> None:
        self.model, self.cache, self.keys = model, cache, []

    def captured(self, plan) -> bool:
        return plan.key in self.keys

    def run(self, plan, padded):
        self.keys.append(plan.key)
        logits, hidden = run_padded(self.model, self.cache, padded)
        return logits[: plan.real_rows], hidden[: plan.real_rows]


def test_pure_decode_steps_take_the_graph_path(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    want = [o.outputs[0].token_ids for o in LLM(str(folder), kernels="torch").generate(PROMPTS, PARAMS)]
    llm = LLM(str(folder), kernels="torch", trace="memory", page_size=8)
    runner = llm.runner
    # the fp32 experts' grouped GEMM is not capturable on a GPU (model_blocker); here the body runs eagerly
    runner.graph_settings = replace(runner.graph_settings, enabled=True, model_blocker=None)
    runner.graphs = EagerGraphs(runner.model, runner.cache)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == want
    recs = runner.tracer.records
    replayed = [r for r in recs if r["graph"]["replayed"]]
    eager = [r for r in recs if not r["graph"]["replayed"]]
    assert len(runner.graphs.keys) == len(replayed) > 0
    # the batch shrinks 5 -> 1 as requests finish: buckets 8, 4, 2, 1
    assert {r["graph"]["bucket"] for r in replayed} == {8, 4, 2, 1}
    assert all(r["graph"]["rows"] == len(r["requests"]) == r["num_decode_tokens"] == r["num_tokens"] for r in replayed)
    # the first step of each key captures (here: the first time run() saw it), the others replay
    assert sum(r["graph"]["capture"] for r in replayed) == len(set(runner.graphs.keys))
    assert eager and all(r["num_tokens"] > r["num_decode_tokens"] for r in eager)
    assert all(r["graph"]["reason"].startswith("prefill or mixed step") for r in eager)
    assert not any(layer.latent[runner.cache.pad_slot].any() for layer in runner.cache.layers)

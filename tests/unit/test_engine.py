"""Continuous batching, chunked prefill and preemption leave greedy output unchanged; pages are
accounted for after every test; greedy output equals transformers' generate."""

from __future__ import annotations

import pytest
import torch
from engine_drain import drain
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [random_ids(n, seed=n) for n in (5, 17, 1, 33, 9)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_pool_clean(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages and all(r == 0 for r in pool.ref)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def alone(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    return [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def test_batch_equals_alone(hf_model_dir, alone):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), trace="memory")
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone
    mixed = [r for r in llm.runner.tracer.records if r["num_mqa_tokens"] and r["num_mha_tokens"]]
    assert not mixed or all(len(r["segments"]) == 2 for r in mixed)
    _assert_pool_clean(llm)


def test_small_budget_chunked_prefill_equals_alone(hf_model_dir, alone):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), max_num_batched_tokens=7, page_size=4, trace="memory")
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == alone
    # Some step mixed running decodes with a prefill chunk in one forward pass.
    assert any(r["num_decode_tokens"] and r["num_tokens"] > r["num_decode_tokens"] for r in llm.runner.tracer.records)
    assert max(r["num_tokens"] for r in llm.runner.tracer.records) <= 7
    _assert_pool_clean(llm)


def test_preemption_keeps_greedy_output(hf_model_dir, alone):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), page_size=4, num_pages=14)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == alone
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    _assert_pool_clean(llm)


def test_abort_frees_pages(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), page_size=4)
    ids = [llm.engine.add_request(p, GREEDY) for p in PROMPTS]
    finals = {}

    def step():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})

    step()
    assert llm.engine.abort(ids[1]) and not llm.engine.abort("no-such-request")
    step()
    assert llm.engine.abort(ids[3]) and not llm.engine.abort(ids[1])  # already gone
    finals.update(drain(llm.engine))
    assert finals[ids[1]].outputs[0].finish_reason == "abort"
    assert finals[ids[3]].outputs[0].finish_reason == "abort"
    assert sorted(finals) == sorted(ids) and llm.engine.requests == {} and llm.engine._detok == {}
    _assert_pool_clean(llm)


@pytest.mark.parametrize("kind", ["v3_yarn", "v2_noq", "glm_lite"])
def test_greedy_equals_transformers_generate(hf_model_dir, kind):
    folder, ref = hf_model_dir(kind)
    prompt = random_ids(20, seed=7)
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(prompt) :].tolist()
    got = LLM(str(folder)).generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert got[0].outputs[0].token_ids == want


def test_seeded_sampling_is_reproducible_in_any_batch(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    alone = _tokens(llm.generate([PROMPTS[0]], sp))[0]
    batched = _tokens(llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [GREEDY, sp, sp]))
    assert batched[1] == alone


def test_bad_request_is_rejected_with_its_id(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    with pytest.raises(ValueError, match="token id 9999 outside the vocabulary"):
        llm.engine.add_request([1, 9999], GREEDY, request_id="bad")
    want = _tokens(LLM(str(folder)).generate([PROMPTS[0]], GREEDY))
    assert len(want[0]) == GREEDY.max_tokens
    assert _tokens(llm.generate([PROMPTS[0]], GREEDY)) == want  # the engine still serves, unchanged
    _assert_pool_clean(llm)


def test_prefix_cache_hit_equals_miss(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    shared = random_ids(37, seed=21)
    prompts = [shared + random_ids(6, seed=s)[1:] for s in (1, 2, 3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    miss = _tokens(LLM(str(folder), page_size=8, enable_prefix_caching=False).generate(prompts, sp))
    llm = LLM(str(folder), page_size=8, trace="memory")
    first = llm.generate([prompts[0]], sp)
    rest = llm.generate(prompts[1:], sp)
    assert _tokens(first) + _tokens(rest) == miss
    assert first[0].metrics["num_cached_prompt_tokens"] == 0
    assert [o.metrics["num_cached_prompt_tokens"] for o in rest] == [32, 32]  # 4 full pages of the shared 37
    cached = [r["cached_tokens"] for rec in llm.runner.tracer.records for r in rec["requests"] if r["cached_tokens"]]
    assert cached == [32, 32]
    _assert_pool_clean(llm)


def test_prefix_cache_survives_eviction_pressure(hf_model_dir):
    """A pool too small to keep every cached page: evicted pages are recomputed, output unchanged."""
    folder, _ = hf_model_dir("v3_yarn")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [random_ids(30, seed=s) for s in range(6)] + [random_ids(30, seed=0)]
    want = _tokens(LLM(str(folder), page_size=4, enable_prefix_caching=False).generate(prompts, sp))
    llm = LLM(str(folder), page_size=4, num_pages=20, max_num_seqs=2)
    got = [_tokens(llm.generate([p], sp))[0] for p in prompts]
    assert got == want
    _assert_pool_clean(llm)


def test_n_samples_and_stop_strings(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder))
    out = llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = _tokens(llm.generate([PROMPTS[1]], GREEDY))[0]
    stop_id = greedy[3]
    stopped = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    )[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].token_ids == greedy[: greedy.index(stop_id)]  # the stop token is not emitted
    # this model's first greedy token is EOS: without ignore_eos it ends there
    assert greedy[0] in llm.engine.eos_ids, (greedy[:3], llm.engine.eos_ids)
    eos_out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert eos_out.token_ids == [] and eos_out.finish_reason == "stop"
    # min_tokens bans EOS until 3 tokens are out
    held = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, min_tokens=3))[0].outputs[0]
    assert len(held.token_ids) >= 3 and not set(held.token_ids[:3]) & llm.engine.eos_ids
    _assert_pool_clean(llm)


def test_logprobs_and_prompt_logprobs_match_prompt_logits(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    llm = LLM(str(folder), max_num_batched_tokens=7)
    prompt = PROMPTS[3]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    )[0]
    comp = out.outputs[0]
    ref = llm.prompt_logits(prompt + comp.token_ids).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        assert len(entry) <= 3 and abs(entry[prompt[i + 1]] - ref[i, prompt[i + 1]].item()) <= 1e-5
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry[tok] - row[tok].item()) <= 1e-5  # the same fp32 forward, in other steps: rounding
        assert set(entry) >= set(row.topk(3).indices.tolist())
    _assert_pool_clean(llm)

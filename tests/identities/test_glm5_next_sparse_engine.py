"""GLM-5.3-Flash's pooled DSA route in the engine's identities, past index_topk (tests/glm5_next_models.py SPARSE:
queries keep 4 of up to 25 complete pools): a prefix-cache hit reads the pooled keys and the per-token [k | gate] rows
from the cached pages (pools are written once, by the step that completes them, never rewritten) == a cold run ==
transformers; preemption resumes exactly; a batch of mixed lengths (one-token decodes beside prefills, each selecting
over its own pools in one batched selection per segment) == each alone == transformers.

Bound: 1e-5 max abs against transformers' float64 run, 100% top-1, as tests/models/test_glm5_next_sparse.py (measured
there: ours 1.8e-6 .. 3.4e-6, transformers' own fp32 run 1.9e-6 .. 3.3e-6; dense attention is 0.8 .. 3.6 away past
index_topk, so a step that ran dense, or read a pool from the wrong row, fails by orders of magnitude).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.glm5_next")

from engine_drain import drain, token_ids  # noqa: E402
from glm5_next_models import SPARSE, float64_copy, hf_logits, random_ids, save_hf_glm5_next  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from state_engine import assert_close, greedy, model_fixture, together_and_alone  # noqa: E402
from state_prefill import prefill_in_chunks as _prefill  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402

BOUND = 1e-5
PAGE = 16

glm = model_fixture("glm", SPARSE, save_hf_glm5_next, float64_copy, seed=5)


@pytest.mark.parametrize("budget", [5, 64])
def test_a_hit_past_index_topk_equals_a_cold_run_and_transformers(glm, budget):
    """The owner's prompt writes every page's rows (latent, [k | gate], pooled keys) and snapshots; a second prompt
    sharing `hit` pages (16 .. 64 tokens: 4 .. 16 pools of kpool 4, 8 .. 32 of kpool 2, more than a query keeps)
    continues from the hit: its logits == a cold run's == transformers', at every position after the hit."""
    spec, ref, folder = glm
    llm = LLM(str(folder), page_size=PAGE, num_pages=64, max_num_seqs=4, trace="memory")
    runner, vocab = llm.runner, ref.config.text_config.vocab_size
    n = 5 * PAGE + 5
    first = random_ids(n, vocab, 7)
    owner = list(range(0, 8))
    _prefill(runner, "a", first, 0, owner, 0, budget)
    for hit in (1, 2, 4):
        ctx = hit * PAGE
        second = first[: ctx + 1] + random_ids(n - ctx - 1 + hit, vocab, 100 + hit)[1:]
        table = owner[:hit] + list(range(8 * hit, 8 * hit + 8))
        got = _prefill(runner, "b", second, ctx, table, 1, budget, first_restore=owner[hit - 1])
        cold = _prefill(runner, "c", second, 0, list(range(56, 64)), 2, budget)[ctx:]
        what = f"{spec} hit at {ctx} of {len(second)} budget {budget}"
        assert_close(got, cold, BOUND, what + ": restored vs cold")
        assert_close(got, hf_logits(ref, second)[ctx:], BOUND, what + ": vs transformers")
    assert any(r["needs_selection"] for r in runner.tracer.records), "the prompts were meant to select"


def test_a_prefix_hit_through_the_scheduler_decodes_exactly(glm):
    """b shares 53 tokens with a (a hit at 48: three full pages); b's greedy tokens, decoded over pools from the
    cached pages and its own, == transformers'."""
    spec, ref, folder = glm
    vocab = ref.config.text_config.vocab_size
    llm = LLM(str(folder), page_size=PAGE, max_num_batched_tokens=11, trace="memory")
    a = random_ids(60, vocab, 21)
    b = a[:53] + random_ids(9, vocab, 9)[1:]
    (out_a,) = llm.generate([a], greedy(8))
    assert list(out_a.outputs[0].token_ids) == hf_greedy(ref, a, 8, hf_logits), spec
    (out_b,) = llm.generate([b], greedy(6))
    assert list(out_b.outputs[0].token_ids) == hf_greedy(ref, b, 6, hf_logits), spec
    firsts = [q for r in llm.runner.tracer.records for q in r["requests"] if q["id"].startswith(out_b.request_id + "/")]
    assert firsts[0]["cached_tokens"] == 48 and firsts[0]["context_len"] == 48


def test_preemption_past_index_topk_resumes_exactly(glm):
    """A pool small enough to preempt: the re-admitted requests (their pools recomputed from token 0 into new pages)
    decode transformers' greedy tokens; every state slot is free at the end."""
    spec, ref, folder = glm
    llm = LLM(str(folder), page_size=4, num_pages=20, max_num_seqs=3, max_num_batched_tokens=16, trace="memory")
    prompts = [random_ids(n, ref.config.text_config.vocab_size, 50 + n) for n in (37, 21, 43, 29)]
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(6), request_id=f"r{i}")
    outs = token_ids(drain(engine))
    assert any(r["preempted"] for r in llm.runner.tracer.records), "the pool was meant to be small enough to preempt"
    assert any(r["needs_selection"] for r in llm.runner.tracer.records)
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 6, hf_logits), f"{spec}: prompt of {len(p)} tokens"
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_a_batch_of_mixed_lengths_equals_each_alone(glm):
    """Steps mixing one-token sequences (the decode segment) with prefills of several lengths (the prefill segment),
    every one past index_topk, each in its own pages and slot == each sequence alone, and == transformers."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_seqs=4, trace="memory")
    vocab = ref.config.text_config.vocab_size
    prompts = {"a": random_ids(90, vocab, 1), "b": random_ids(40, vocab, 2), "c": random_ids(86, vocab, 3)}
    plan = {"a": (85, 86, 87, 90), "b": (33, 34, 40), "c": (50, 83, 84, 86)}  # each sequence's chunk ends, in steps
    alone, together, decodes = together_and_alone(llm.runner, prompts, plan)
    assert decodes[1] == decodes[2] == 2, decodes  # one-token chunks beside prefills
    assert llm.runner.tracer.records[-3]["needs_selection"]
    for rid, got in together.items():
        assert_close(got, alone[rid], BOUND, f"{spec} request {rid}: batch vs alone")
        want = hf_logits(ref, prompts[rid][: plan[rid][-1]])
        assert_close(got, want, BOUND, f"{spec} request {rid} vs transformers")

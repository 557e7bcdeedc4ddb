"""GLM-5.3-Flash (glm5_next) in the engine's identities: a prefix-cache hit restores every KDA layer's states from the
hit's last page's snapshot rows (the MLA layers read the cached latent rows), preemption resumes from a snapshot, and
a batch of mixed lengths (two one-token sequences beside prefills, each in its own state slot) == each alone; all
equal transformers' Glm5NextForConditionalGeneration (tests/glm5_next_models.py).

Bound: 1e-5 max abs against transformers' float64 run, 100% top-1, as tests/models/test_glm5_next.py (where the
measured figures and why are written: ours 1.8e-6 .. 5.2e-6, transformers' own fp32 run 1.9e-6 .. 4.4e-6). Pages of
16 tokens put the hits inside a 64-token KDA chunk and on pool boundaries (kpool 2 and 4 divide 16).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.glm5_next")

from engine_drain import drain, token_ids  # noqa: E402
from glm5_next_models import SPECS, float64_copy, hf_logits, random_ids, save_hf_glm5_next  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from state_engine import assert_close, greedy, model_fixture, together_and_alone  # noqa: E402
from state_prefill import prefill_in_chunks as _prefill  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402

BOUND = 1e-5
PAGE = 16

glm = model_fixture("glm", SPECS, save_hf_glm5_next, float64_copy, seed=5)


@pytest.mark.parametrize("budget", [5, 64])
def test_a_hit_at_every_boundary_equals_a_cold_run_and_transformers(glm, budget):
    """The owner's prompt writes every page's snapshot rows; a second prompt sharing `hit` pages and one token more
    restores from the hit's last page and continues: its logits == a cold run's == transformers', at every
    position after the hit."""
    spec, ref, folder = glm
    llm = LLM(str(folder), page_size=PAGE, num_pages=64, max_num_seqs=4)
    runner, vocab = llm.runner, ref.config.text_config.vocab_size
    n = 4 * PAGE + 5
    first = random_ids(n, vocab, 7)
    owner = list(range(0, 8))
    _prefill(runner, "a", first, 0, owner, 0, budget)
    for hit in (1, 2, 4):  # hits at 16, 32 (inside the first 64-token KDA chunk) and 64
        ctx = hit * PAGE
        second = first[: ctx + 1] + random_ids(n - ctx - 1 + hit, vocab, 100 + hit)[1:]
        table = owner[:hit] + list(range(8 * hit, 8 * hit + 8))
        got = _prefill(runner, "b", second, ctx, table, 1, budget, first_restore=owner[hit - 1])
        cold = _prefill(runner, "c", second, 0, list(range(56, 64)), 2, budget)[ctx:]
        what = f"{spec} hit at {ctx} of {len(second)} budget {budget}"
        assert_close(got, cold, BOUND, what + ": restored vs cold")
        assert_close(got, hf_logits(ref, second)[ctx:], BOUND, what + ": vs transformers")


def test_a_prefix_hit_mid_kda_chunk_is_exact_and_the_ledger_shows_it(glm):
    """b shares 37 tokens with a (a hit at 32: two full pages, inside the first 64-token KDA chunk); b's first chunk
    restores its KDA slots from a's page-1 snapshot rows; its greedy tokens == transformers'."""
    spec, ref, folder = glm
    vocab = ref.config.text_config.vocab_size
    llm = LLM(str(folder), page_size=PAGE, max_num_batched_tokens=7, trace="memory")
    assert llm.config.cache.enable_prefix_caching and llm.runner.cache.keeps_snapshots
    a = random_ids(40, vocab, 21)
    b = a[:37] + random_ids(9, vocab, 9)[1:]
    (out_a,) = llm.generate([a], greedy(8))
    assert list(out_a.outputs[0].token_ids) == hf_greedy(ref, a, 8, hf_logits), spec
    (out_b,) = llm.generate([b], greedy(6))
    assert list(out_b.outputs[0].token_ids) == hf_greedy(ref, b, 6, hf_logits), spec
    firsts = [q for r in llm.runner.tracer.records for q in r["requests"] if q["id"].startswith(out_b.request_id + "/")]
    assert firsts[0]["cached_tokens"] == 32 and firsts[0]["context_len"] == 32
    assert firsts[0]["state_restore_page"] is not None and not firsts[0]["state_reset"]


def test_preemption_resumes_exactly(glm):
    """A pool small enough to preempt: the re-admitted requests' tokens equal transformers' greedy, and every state
    slot is free at the end."""
    spec, ref, folder = glm
    llm = LLM(str(folder), page_size=4, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16, trace="memory")
    prompts = [random_ids(n, ref.config.text_config.vocab_size, 50 + n) for n in (17, 5, 23, 9)]
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(6), request_id=f"r{i}")
    outs = token_ids(drain(engine))
    assert any(r["preempted"] for r in llm.runner.tracer.records), "the pool was meant to be small enough to preempt"
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 6, hf_logits), f"{spec}: prompt of {len(p)} tokens"
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_a_batch_of_mixed_lengths_equals_each_alone(glm):
    """Steps mixing two one-token sequences (the batched recurrent step) with prefills of several lengths, each in
    its own slot == each sequence alone, and == transformers."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_seqs=4)
    vocab = ref.config.text_config.vocab_size
    prompts = {"a": random_ids(70, vocab, 1), "b": random_ids(9, vocab, 2), "c": random_ids(66, vocab, 3)}
    plan = {"a": (65, 66, 67), "b": (1, 2, 9), "c": (60, 66)}  # each sequence's chunk ends, in steps
    alone, together, decodes = together_and_alone(llm.runner, prompts, plan)
    assert decodes[1] == 2  # two one-token sequences beside a prefill
    for rid, got in together.items():
        assert_close(got, alone[rid], BOUND, f"{spec} request {rid}: batch vs alone")
        want = hf_logits(ref, prompts[rid][: plan[rid][-1]])
        assert_close(got, want, BOUND, f"{spec} request {rid} vs transformers")

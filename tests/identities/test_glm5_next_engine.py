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
import torch

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import SPECS, float64_copy, hf_logits, random_ids, save_hf_glm5_next  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from state_prefill import prefill_in_chunks as _prefill  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
PAGE = 16


@pytest.fixture(scope="module", params=list(SPECS))
def glm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"glm5_engine_{request.param}")
    hf = save_hf_glm5_next(request.param, folder, seed=5)
    return request.param, float64_copy(hf), folder


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= BOUND, f"{what}: max abs {err:.3g} > {BOUND}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what}: top-1 differs"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


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
        _close(got, cold, what + ": restored vs cold")
        _close(got, hf_logits(ref, second)[ctx:], what + ": vs transformers")


def test_a_prefix_hit_mid_kda_chunk_is_exact_and_the_ledger_shows_it(glm):
    """b shares 37 tokens with a (a hit at 32: two full pages, inside the first 64-token KDA chunk); b's first chunk
    restores its KDA slots from a's page-1 snapshot rows; its greedy tokens == transformers'."""
    spec, ref, folder = glm
    vocab = ref.config.text_config.vocab_size
    llm = LLM(str(folder), page_size=PAGE, max_num_batched_tokens=7, trace="memory")
    assert llm.config.cache.enable_prefix_caching and llm.runner.cache.keeps_snapshots
    a = random_ids(40, vocab, 21)
    b = a[:37] + random_ids(9, vocab, 9)[1:]
    (out_a,) = llm.generate([a], _greedy(8))
    assert list(out_a.outputs[0].token_ids) == hf_greedy(ref, a, 8, hf_logits), spec
    (out_b,) = llm.generate([b], _greedy(6))
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
        engine.add_request(p, _greedy(6), request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    assert any(r["preempted"] for r in llm.runner.tracer.records), "the pool was meant to be small enough to preempt"
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 6, hf_logits), f"{spec}: prompt of {len(p)} tokens"
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_a_batch_of_mixed_lengths_equals_each_alone(glm):
    """Steps mixing two one-token sequences (the batched recurrent step) with prefills of several lengths, each in
    its own slot == each sequence alone, and == transformers."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_seqs=4)
    runner, vocab, ps = llm.runner, ref.config.text_config.vocab_size, llm.config.cache.page_size
    prompts = {"a": random_ids(70, vocab, 1), "b": random_ids(9, vocab, 2), "c": random_ids(66, vocab, 3)}
    pages = {r: list(range(i * 16, i * 16 + 16)) for i, r in enumerate(prompts)}

    def chunk(rid, ids, done, slot):
        table = tuple(pages[rid][: -(-(done + len(ids)) // ps)])
        return SeqChunk(rid, tuple(ids), done, table, all_logits=True, state_slot=slot, reset_state=done == 0)

    plan = {"a": (65, 66, 67), "b": (1, 2, 9), "c": (60, 66)}  # each sequence's chunk ends, in steps
    alone = {}
    for rid, ends in plan.items():
        rows, done = [], 0
        for end in ends:
            rows.append(runner.execute([chunk(rid, prompts[rid][done:end], done, 0)])[1])
            done = end
        alone[rid] = torch.cat(rows)
    together: dict[str, list[torch.Tensor]] = {r: [] for r in prompts}
    done = dict.fromkeys(prompts, 0)
    for i in range(3):
        chunks = []
        for slot, (rid, ends) in enumerate(plan.items(), start=1):
            if i < len(ends):
                chunks.append(chunk(rid, prompts[rid][done[rid] : ends[i]], done[rid], slot))
                done[rid] = ends[i]
        batch, logits = runner.execute(chunks)
        if i == 1:
            assert batch.num_decode_seqs == 2
        for (rid, _), row in zip(batch.logits_owner, logits):
            together[rid].append(row)
    for rid, rows in together.items():
        got = torch.stack(rows)
        _close(got, alone[rid], f"{spec} request {rid}: batch vs alone")
        _close(got, hf_logits(ref, prompts[rid][: done[rid]]), f"{spec} request {rid} vs transformers")

"""Kimi-Linear prefix caching, exact: each KDA layer saves its recurrent and conv states at every page boundary a
chunk reaches (the chunk split there), and a prefix hit restores the slot from the hit's last page's rows; the
continuation equals a cold run and transformers at every position.

Pages of 16 tokens put every hit in the middle of a 64-token KDA chunk (hits at 16, 32, 48); chunk budgets 3, 5
and 64 make chunks cross boundaries mid-chunk, end on them, and span several; a budget of 1 writes every
boundary from the batched one-token step. Prompts share a page and a few tokens more (37 tokens: a hit at 32).

Bound: 1e-5 max abs on fp32 logits of magnitude ~4 against transformers' float64 run on the same weights, as every
Kimi-Linear engine test (tests/models/test_kimi_linear.py: ours 1.1e-6 .. 7.5e-6 from float64, transformers' own
fp32 run 1.1e-6 .. 7.4e-6); measured here: restored vs cold and vs float64 within 5.2e-6. A snapshot taken at
the chunk's end instead of the boundary, a conv state one row off, or a restore from the wrong page moves logits
by 1e-2 .. 1 (seen when each was broken on purpose).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from engine_drain import drain, token_ids  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from kimi_linear_models import SPECS, float64_copy, hf_logits, random_ids, save_hf_kimi  # noqa: E402
from state_engine import assert_close, greedy, model_fixture  # noqa: E402
from state_prefill import prefill_in_chunks as _prefill  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402

BOUND = 1e-5
PAGE = 16


kimi = model_fixture("kimi", SPECS, save_hf_kimi, float64_copy, seed=5)


@pytest.mark.parametrize("budget", [1, 3, 5, 64])
def test_a_hit_at_every_boundary_equals_a_cold_run_and_transformers(kimi, budget):
    """The owner's prompt writes every page's snapshot rows (budget 1: from the batched one-token step); a second
    prompt sharing hit pages and one token more restores from the hit's last page and continues."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), page_size=PAGE, num_pages=64, max_num_seqs=4)
    runner, vocab = llm.runner, ref.config.vocab_size
    assert llm.config.cache.enable_prefix_caching and runner.cache.keeps_snapshots
    n = 4 * PAGE + 5
    first = random_ids(n, vocab, 7)
    owner = list(range(0, 8))
    _prefill(runner, "a", first, 0, owner, 0, budget)
    for hit in (1, 2, 3, 4):  # hits at 16, 32, 48 (inside the first 64-token KDA chunk) and 64
        ctx = hit * PAGE
        second = first[: ctx + 1] + random_ids(n - ctx - 1 + hit, vocab, 100 + hit)[1:]
        table = owner[:hit] + list(range(8 * hit, 8 * hit + 8))
        got = _prefill(runner, "b", second, ctx, table, 1, budget, first_restore=owner[hit - 1])
        cold = _prefill(runner, "c", second, 0, list(range(56, 64)), 2, budget)[ctx:]
        what = f"{spec} hit at {ctx} of {len(second)} budget {budget}"
        assert_close(got, cold, BOUND, what + ": restored vs cold")
        assert_close(got, hf_logits(ref, second)[ctx:], BOUND, what + ": vs transformers")


def test_the_engine_serves_a_hit_mid_chunk_and_the_ledger_shows_it(kimi):
    """Through the scheduler: b shares 37 tokens with a (2 full pages: a hit at 32, mid KDA chunk); b's first
    chunk restores its slot from a's page 1 snapshot rows; its greedy tokens == transformers' (the logits of
    a hit are held to the bound by the test above). c is a's prompt and a's 12 generated tokens: its hit at 48 ends on a
    page a's decode steps completed (their batched one-token step wrote the snapshot rows)."""
    spec, ref, folder = kimi
    vocab = ref.config.vocab_size
    llm = LLM(str(folder), page_size=PAGE, max_num_batched_tokens=7, trace="memory")
    a = random_ids(40, vocab, 21)
    b = a[:37] + random_ids(9, vocab, 9)[1:]
    (out_a,) = llm.generate([a], greedy(12))
    got_a = list(out_a.outputs[0].token_ids)
    assert got_a == hf_greedy(ref, a, 12, hf_logits), spec
    (out_b,) = llm.generate([b], greedy(6))
    assert list(out_b.outputs[0].token_ids) == hf_greedy(ref, b, 6, hf_logits), spec
    records = list(llm.runner.tracer.records)
    firsts = [q for r in records for q in r["requests"] if q["id"].startswith(out_b.request_id + "/")]
    assert firsts[0]["cached_tokens"] == 32 and firsts[0]["context_len"] == 32
    assert firsts[0]["state_restore_page"] is not None and not firsts[0]["state_reset"]
    c = a + got_a + random_ids(4, vocab, 5)[1:]  # 40 + 12 + 3 tokens: a's pages 0-2 are full
    (out_c,) = llm.generate([c], greedy(4))
    assert list(out_c.outputs[0].token_ids) == hf_greedy(ref, c, 4, hf_logits), spec
    firsts = [q for r in llm.runner.tracer.records for q in r["requests"] if q["id"].startswith(out_c.request_id + "/")]
    assert firsts[0]["cached_tokens"] == 48 and "state_restore_page" in firsts[0]


def test_preemption_resumes_from_a_snapshot_exactly(kimi):
    """A pool small enough to preempt, prefix caching on: a re-admitted request resumes at the last of its pages
    that survived, its slot restored from that page's snapshot rows (the ledger's state_restore_page), and its
    tokens equal transformers' greedy."""
    spec, ref, folder = kimi
    llm = LLM(str(folder), page_size=4, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16, trace="memory")
    assert llm.config.cache.enable_prefix_caching
    prompts = [random_ids(n, ref.config.vocab_size, 50 + n) for n in (17, 5, 23, 9)]
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, greedy(8), request_id=f"r{i}")
    outs = token_ids(drain(engine))
    records = list(llm.runner.tracer.records)
    preempted = {p["id"] for r in records for p in r["preempted"]}
    assert preempted, "the pool was meant to be small enough to preempt"
    resumed = [q for r in records for q in r["requests"] if q["id"] in preempted and "state_restore_page" in q]
    assert resumed, "a preempted request was meant to resume from a snapshot"
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 8, hf_logits), f"{spec}: prompt of {len(p)} tokens"
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_inspect_counts_the_snapshot_bytes(kimi, capsys):
    """`inspect` prints each KDA group's snapshot bytes per token: (recurrent H d d * 4 + conv (K-1) 3 H d * the
    cache's bytes) per layer / page_size; the cache's measured snapshot tensors agree."""
    from mlaserve.entrypoints.cli import main

    spec, ref, folder = kimi
    cfg = ref.config
    h, d, k = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    n_kda = sum(t == "linear_attention" for t in cfg.layer_types)
    llm = LLM(str(folder), page_size=PAGE, num_pages=10)
    per_layer = h * d * d * 4 + (k - 1) * 3 * h * d * 4  # fp32 cache
    snaps = [snap for _, snap in llm.runner.cache.snapshot_pairs()]
    assert sum(t.numel() * t.element_size() for t in snaps) == per_layer * n_kda * 11  # 10 pages + the pad row
    assert main(["inspect", str(folder), "--page-size", str(PAGE)]) == 0
    out = capsys.readouterr().out
    assert "snapshots at page boundaries" in out
    assert f"{per_layer * n_kda / PAGE:g} bytes/token of snapshots with prefix caching" in out, out

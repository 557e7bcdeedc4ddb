"""DeepSeek-V4 prefix caching, exact: a prefix hit at a page boundary restores each layer's ring and overlap
halves from the hit's last page's snapshot rows, reads the cached pages' compressed rows through the block
table, and continues equal to a cold run and to transformers at every position.

The page is the smallest the pools allow, the least common multiple of the ratios (8 for CSA 4 / HCA 8, 6 for
3 / 6, 4 for CSA 4 alone), so hits land on every boundary the config has; each of them is in the middle of a
CSA window (a CSA row pools 2m tokens, the Ca half of the window before and the Cb half of its own, so at a
multiple of m the overlap half is open), and with sliding windows 5-7 the ring at a hit spans the last one or
two pages (window 7 > page 4). A page boundary is always an HCA window boundary (the page is a multiple of m').
Prompts are not multiples of any ratio, so the hit's continuation also closes windows mid-chunk.

Bound: 1e-5 max abs on fp32 logits of magnitude ~4, as every V4 engine test (tests/identities/
test_deepseek_v4_engine.py: fp32 rounding measured 0 .. 2.3e-6 through the engine); measured here: restored
vs cold and vs transformers within 2.8e-6 over every spec, hit and budget. A restore from the
wrong page, a ring or overlap not saved at the boundary, or a compressed row read from the wrong page moves
logits by 1e-2 .. 1 (seen when each is broken on purpose).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import hf_greedy

pytest.importorskip("transformers")

from state_engine import assert_close  # noqa: E402
from state_prefill import prefill_in_chunks as _prefill  # noqa: E402
from v4_models import SPECS, build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5


@pytest.fixture(scope="module", params=list(SPECS))
def v4(request, tmp_path_factory):
    hf = build_hf_v4(request.param, seed=4)
    folder = tmp_path_factory.mktemp(f"v4_prefix_{request.param}")
    hf.save_pretrained(folder)
    raw = json.loads((Path(folder) / "config.json").read_text())
    rates = raw["compress_rates"]
    kinds = raw.get("layer_types") or []
    ratios = {rates[t] for t in kinds if t in rates} or {r for r in raw.get("compress_ratios", []) if r}
    return request.param, hf, folder, ratios


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _page(ratios: set[int]) -> int:
    import math

    return math.lcm(*ratios)


@pytest.mark.parametrize("budget", [3, 5, 64])  # chunks crossing boundaries mid-chunk, ending on them, one pass
def test_a_hit_at_every_boundary_equals_a_cold_run_and_transformers(v4, budget):
    kind, hf, folder, ratios = v4
    ps = _page(ratios)
    llm = LLM(str(folder), page_size=ps, num_pages=64, max_num_seqs=4)
    runner, vocab = llm.runner, hf.config.vocab_size
    assert llm.config.cache.enable_prefix_caching and runner.cache.keeps_snapshots
    n = 4 * ps + 3  # not a multiple of any ratio
    first = _ids(n, vocab, 7)
    owner_pages = list(range(0, 8))  # 8 pages per request: room for every length here
    _prefill(runner, "a", first, 0, owner_pages, 0, budget)  # writes the pools' rows and every page's snapshot
    for hit in (1, 2, 3, 4):  # pages reused: hits at ps, 2 ps, 3 ps, 4 ps tokens
        ctx = hit * ps
        second = first[: ctx + 1] + _ids(n - ctx - 1 + hit, vocab, 100 + hit)[1:]  # shares ctx + 1 tokens
        table = owner_pages[:hit] + list(range(8 * hit, 8 * hit + 8))  # its own pages after the hit
        got = _prefill(runner, "b", second, ctx, table, 1, budget, first_restore=owner_pages[hit - 1])
        cold = _prefill(runner, "c", second, 0, list(range(56, 64)), 2, budget)[ctx:]
        want = hf_v4_logits(hf, second)[ctx:]
        what = f"{kind} page {ps} hit at {ctx} of {len(second)} budget {budget}"
        assert_close(got, cold, BOUND, what + ": restored vs cold")
        assert_close(got, want, BOUND, what + ": vs transformers")


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=5)
    folder = tmp_path_factory.mktemp("v4_prefix_engine")
    hf.save_pretrained(folder)
    return hf, folder


def _firsts(records) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        for q in r["requests"]:
            out.setdefault(q["id"], q)
    return out


def test_the_engine_serves_a_hit_mid_window_and_the_ledger_shows_it(all_kinds):
    """Through the scheduler: the second request shares 19 tokens with the first (2 full pages of 8, a hit at
    16, mid CSA window), its first chunk restores the slot from page 1's snapshot; greedy 12 tokens of both ==
    transformers' full recompute; the ledger and the request's metrics count the 16 cached tokens."""
    hf, folder = all_kinds
    llm = LLM(str(folder), page_size=8, max_num_batched_tokens=5, trace="memory")
    vocab = hf.config.vocab_size
    a = _ids(21, vocab, 21)
    b = a[:19] + _ids(6, vocab, 9)[1:]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out_a,) = llm.generate([a], params)
    (out_b,) = llm.generate([b], params)
    assert list(out_a.outputs[0].token_ids) == hf_greedy(hf, a, 12, hf_v4_logits)
    assert list(out_b.outputs[0].token_ids) == hf_greedy(hf, b, 12, hf_v4_logits)
    first_b = [q for q in _firsts(llm.runner.tracer.records).values() if q["cached_tokens"]]
    assert len(first_b) == 1 and first_b[0]["cached_tokens"] == 16 and first_b[0]["context_len"] == 16
    assert "state_restore_page" in first_b[0] and first_b[0]["state_reset"] is False
    assert out_b.metrics["num_cached_prompt_tokens"] == 16


def test_preemption_mid_window_resumes_from_a_snapshot_exactly(all_kinds):
    """A pool small enough to preempt: a preempted request's registered pages stay cached, so its re-admission
    hits them and resumes from the last one's snapshot instead of token 0; tokens == transformers' greedy,
    with preemptions at contexts inside a compression window."""
    hf, folder = all_kinds
    llm = LLM(str(folder), page_size=8, num_pages=5, max_num_seqs=3, max_num_batched_tokens=8, trace="memory")
    engine, vocab = llm.engine, hf.config.vocab_size
    prompts = [_ids(n, vocab, 50 + n) for n in (5, 17, 1, 23, 10)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    recs = list(llm.runner.tracer.records)
    reached, resumed = [], []
    for r in recs:
        for p in r["preempted"]:
            seen = [q for x in recs if x["step"] < r["step"] for q in x["requests"] if q["id"] == p["id"]]
            reached.append(seen[-1]["context_len"] + seen[-1]["query_len"])
            later = [q for x in recs if x["step"] > r["step"] for q in x["requests"] if q["id"] == p["id"]]
            resumed.append(later[0])
    assert any(n % 4 for n in reached), f"no preemption inside a CSA window: contexts {reached}"
    assert any("state_restore_page" in q and q["context_len"] > 0 for q in resumed), resumed
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(hf, p, 10, hf_v4_logits), f"prompt of {len(p)} tokens"

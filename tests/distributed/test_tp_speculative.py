"""Speculative decoding (MTP) under tensor parallelism (CPU, gloo, 2 processes): the MTP layer split like a
decoder layer (heads, expert units, its own embedding's and head's vocabulary rows), each MTP pass run on
both ranks in lockstep, rank 0 alone verifying and drafting (distributed/group.py).

One TP=2 engine serves every check (a worker start costs seconds on 2 cores). Its folder is a DeepSeek-V3
MTP model (tests/mtp_models.py) whose MTP layer also has its own embed_tokens (as the V3 release does;
random, not the trunk's), so both vocabulary-split MTP tensors are exercised.

Checks: every MTP pass's logits at TP=2 == one process's (the same passes, catch-up ones included) and
the first pass == the formula over transformers' trunk and block; speculative greedy at TP=2 == the same
group without speculation == one process; drafts proposed / accepted per request equal one process's
(the real MTP, and an oracle that is right two times in three so that acceptance happens); the ledger holds
each verify and draft step once per rank with rank 0's speculative fields, and the leader's switch / accept
records once; the catch-up rows rank 0 sends (a paused request's trunk rows) are in rank 1's `comm`:
rows x hidden x 4 bytes, counted from what rank 0 packed (broken on purpose: a worker that does not count them
fails it).

Bound: FP32_LOGITS_TOL (1e-5, conftest.py): fp32 partial sums added in another order, as the other TP
tests. Measured: the first MTP pass TP=2 vs one process 2.8e-6, vs the formula 2.8e-6; the generation's passes
2.2e-6 to 5.0e-6 from one process's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL, compare_logits
from draft_oracle import oracle_drafts
from hf_models import random_ids
from mtp_models import hf_block_model, hf_trunk, save_mtp_model

import mlaserve.distributed.group as group_module
from mlaserve import LLM
from mlaserve.distributed.spawn import live_workers
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.sampling.params import SamplingParams

KIND, N = "v3_yarn", 3  # trunk depth 3: the MTP layer is model.layers.3
LENGTHS = (5, 17, 1, 9)
PROMPTS = [random_ids(n, seed=n) for n in LENGTHS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# k = 2 (deeper passes); a probe every 2 steps, so a request paused by the random MTP's failing drafts
# drafts again from the trunk rows rank 0 kept meanwhile (the rows sent to the other rank)
OPTS = dict(speculative="mtp", num_speculative_tokens=2, speculative_probe_interval=2, page_size=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(tensors, one process, TP=2 with trace) on a V3 MTP folder with the MTP's own embedding."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tp_mtp")
    tensors = save_mtp_model(KIND, folder)
    own = torch.randn(256, 64, generator=torch.Generator().manual_seed(5))  # not the trunk's table
    stored = load_file(str(folder / "model.safetensors"))
    save_file(stored | {f"model.layers.{N}.embed_tokens.weight": own}, str(folder / "model.safetensors"))
    one = LLM(str(folder), **OPTS)
    before = frozenset(live_workers())
    two = LLM(str(folder), tensor_parallel_size=2, trace="memory", **OPTS)
    yield tensors | {"own_embed": own}, one, two
    two.close()
    assert not set(live_workers()) - before


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _formula(tensors: dict, ids: list[int], eps: float) -> torch.Tensor:
    """shared_head(Block(eh_proj([enorm(E_mtp(t_{i+1})); hnorm(h_i)]))) at positions 0..L-2, transformers'
    trunk and block (the MTP's own embedding E_mtp)."""
    p, own = f"model.layers.{N}.", tensors.pop("own_embed")
    with torch.no_grad():
        h = hf_trunk(KIND, tensors).model(torch.tensor([ids])).last_hidden_state[0]
        emb = own[torch.tensor(ids[1:])]
        cat = torch.cat(
            [_rms(emb, tensors[p + "enorm.weight"], eps), _rms(h[:-1], tensors[p + "hnorm.weight"], eps)], -1
        )
        x = cat @ tensors[p + "eh_proj.weight"].T
        return hf_block_model(KIND, tensors)(inputs_embeds=x[None]).logits[0]


def _mtp_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The trunk over ids, then one MTP pass over positions 0..L-2 (through the runner: on every rank)."""
    ps, pool = llm.config.cache.page_size, llm.engine.pool
    pages = tuple(pool.allocate(-(-len(ids) // ps)))
    try:
        _, _, hidden = llm.runner.execute_with_hidden([SeqChunk("r", tuple(ids), 0, pages, all_logits=True)])
        chunk = SeqChunk("r", tuple(ids[1:]), 0, pages, all_logits=True)
        return llm.runner.drafter.forward([chunk], hidden, {"r": 0}, 0)[1]
    finally:
        pool.release(list(pages))


def test_mtp_pass_tp2_equals_one_process_and_the_formula(models):
    tensors, one, two = models
    assert two.loaded.report.skipped == []  # the MTP tensors were loaded on rank 0 (its vocabulary rows)
    mtp = two.loaded.model.mtp[0]
    assert mtp.embed_tokens.num_embeddings == 128 and mtp.shared_head.head.out_features == 128
    assert mtp.self_attn.q_b_proj.out_features == one.loaded.model.mtp[0].self_attn.q_b_proj.out_features // 2
    ids = random_ids(24, seed=3)
    ref, a, b = (
        _formula(dict(tensors), ids, one.config.model.rms_norm_eps),
        _mtp_logits(one, ids),
        _mtp_logits(two, ids),
    )
    diff, top1 = compare_logits(b, a)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    diff, top1 = compare_logits(b, ref)
    assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)


def _passes(llm: LLM, monkeypatch) -> list:
    """Record every MTP pass's (request ids, query lengths, gathered logits) of llm's drafter."""
    seen, drafter = [], llm.runner.drafter
    real = drafter.forward

    def forward(chunks, hidden, rows, step_no, ledger=None):
        out = real(chunks, hidden, rows, step_no, ledger)
        seen.append(([(c.request_id, len(c.token_ids)) for c in chunks], out[1].clone()))
        return out

    monkeypatch.setattr(drafter, "forward", forward)
    return seen


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _counts(outs) -> list[tuple[int, int]]:
    return [(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs]


def _ids(outs) -> list[list[int]]:  # request ids differ between engines: compare by prompt order
    return [o.request_id for o in outs]


def test_speculative_greedy_tp2_equals_plain_and_one_process(models, monkeypatch):
    """The real (random) MTP: drafts mostly rejected, requests paused and probed (the catch-up rows sent).
    Every MTP pass at TP=2 == one process's pass; tokens == plain greedy of the same TP group with its
    drafter off == one process; drafts proposed / accepted equal one process's."""
    _, one, two = models
    sent = []  # the packed rows of each pass that sends its rows [R, D]
    real_rows = group_module.rows_read

    def rows_sent(*args):
        out = real_rows(*args)
        sent.append(out[0])
        return out

    monkeypatch.setattr(group_module, "rows_read", rows_sent)
    mine, theirs = _passes(one, monkeypatch), _passes(two, monkeypatch)
    start = len(two.runner.tracer.records)
    a, b = one.generate(PROMPTS, GREEDY), two.generate(PROMPTS, GREEDY)
    assert len(mine) == len(theirs) > 0 and sent, (len(mine), len(theirs), len(sent))
    # the catch-up rows are in rank 1's comm stats: rows x hidden x 4 bytes (fp32), on its draft records only
    hidden = two.config.model.hidden_size
    worker = [r for r in list(two.runner.tracer.records)[start:] if r.get("rank") == 1]
    rows = sum(t.shape[0] for t in sent)
    assert all(t.shape == (t.shape[0], hidden) and t.dtype == torch.float32 for t in sent)
    assert sum(r["comm"]["catch_up_rows"] for r in worker) == rows > 0, rows
    assert sum(r["comm"]["catch_up_bytes"] for r in worker) == rows * hidden * 4
    assert all(r["comm"]["catch_up_rows"] == 0 for r in worker if r["spec_phase"] != "draft")
    for (who_a, la), (who_b, lb) in zip(mine, theirs):
        assert [n for _, n in who_a] == [n for _, n in who_b]
        diff, top1 = compare_logits(lb, la)
        assert diff <= FP32_LOGITS_TOL and top1 == 1.0, (diff, top1)
    assert _counts(b) == _counts(a) and sum(d for d, _ in _counts(b)) > 0, _counts(b)
    monkeypatch.setattr(two.runner, "drafter", None)  # the same group, plain steps (engine.py: no drafter)
    plain = two.generate(PROMPTS, GREEDY)
    assert _tokens(b) == _tokens(plain) == _tokens(a)
    assert all(o.metrics.get("num_draft_tokens", 0) == 0 for o in plain)  # no drafts: the plain path


def test_acceptance_and_ledger_are_one_view(models, monkeypatch):
    """With drafts accepted and rejected: tokens == one process, the same drafts proposed and accepted per
    request; the ledger has each verify / draft step once per rank with rank 0's fields, switch and
    accept records once (the leader's)."""
    _, one, two = models
    reference = {tuple(p): t for p, t in zip(PROMPTS, _tokens(one.generate(PROMPTS, GREEDY)))}
    oracle_drafts(monkeypatch, reference, 256)
    a = one.generate(PROMPTS, GREEDY)
    start = len(two.runner.tracer.records)
    b = two.generate(PROMPTS, GREEDY)
    assert _tokens(b) == _tokens(a) == [reference[tuple(p)] for p in PROMPTS]
    assert _counts(b) == _counts(a), (_counts(b), _counts(a))
    proposed, accepted = (sum(x) for x in zip(*_counts(b)))
    assert 0 < accepted < proposed, (accepted, proposed)
    recs = list(two.runner.tracer.records)[start:]
    leader = [r for r in recs if "rank" not in r]
    assert {r["spec_phase"] for r in leader} == {"switch", "accept"}
    assert sum(r["num_accepted_tokens"] for r in leader if r["spec_phase"] == "accept") == accepted
    ranked: dict[tuple, dict[int, dict]] = {}
    for r in recs:
        if "rank" in r:
            key = (r["step"], r["spec_phase"], r.get("draft_depth"))
            assert r["rank"] not in ranked.setdefault(key, {}), key  # once per rank and step
            ranked[key][r["rank"]] = r
    phases = {k[1] for k in ranked}
    assert {"verify", "draft"} <= phases, phases
    for key, by_rank in ranked.items():
        assert sorted(by_rank) == [0, 1], key
        r0, r1 = by_rank[0], by_rank[1]
        for field in ("spec_phase", "verify", "num_proposed_tokens", "draft_depth", "requests", "segments"):
            assert r0.get(field) == r1.get(field), (key, field)

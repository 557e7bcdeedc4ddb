"""The page-boundary snapshot hook of request states, through the real Engine and ModelRunner, on a toy stack.

The consumer is the test state of tests/identities/test_request_state.py, `running_sum` ([1 + D] float64 per
request: the count of tokens layer 0 has seen and the sum of their embeddings), here declared with
snapshot=True. A forward pre-hook on layer 0 advances it by one batched index_add_ and, before that, writes
each page-boundary snapshot the step asks for (StepContext.snapshots: (k, page) = the state after the chunk's
first k tokens) as the slot's state plus the chunk's first k rows. So a prefix hit that restores the slot from
the hit's last page must leave `count == num_computed` and `sum == embed(ids[:num_computed]).sum()`, checked
after every step; a hit that zeroed the slot instead would count only the recomputed tokens, one restored from
the wrong page would be off by a page's tokens.

Bound: as test_request_state.py, fp64 sums of <= 45 fp32 embeddings |x| < 4.4 in two orders: 1e-13 (a wrong
token moves the sum by a whole embedding row, >= 1.75 here, and the count by 1).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from hf_models import random_ids

from mlaserve.config.engine import make_options
from mlaserve.config.layer_kinds import StateSpec, declare_layers
from mlaserve.engine.engine import Engine
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.model_runner import ModelRunner
from mlaserve.loading.model_loader import load_model
from mlaserve.observability.trace import MemoryTracer
from mlaserve.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SUM_TOL = 1e-13  # see the module docstring
PAGE = 4


def _snapshot_hook(layer, args):
    x, step, _rope, state, _prev = args
    t = state.tensors["running_sum"]
    rows = torch.cat([torch.ones(x.shape[0], 1, dtype=t.dtype), x.to(t.dtype)], dim=-1)
    snap = state.tensors.get("running_sum_snapshot")
    # a test consumer: the plain loop over the step's boundaries (a few per step) is its reference form
    for (a, _n, _c, slot), at in zip(step.seq_spans, step.snapshots):
        for k, page in at:
            snap[page] = t[slot] + rows[a : a + k].sum(0)
    t.index_add_(0, step.token_state_slots, rows)


def _engine(folder, **options):
    loaded = load_model(str(folder), make_options(page_size=PAGE, **options))
    cfg = loaded.config
    kinds = declare_layers(cfg.model, cfg.attention.sparse)
    spec = StateSpec("running_sum", 1 + cfg.model.hidden_size, addressing="request", dtype=torch.float64, snapshot=True)
    kinds = (replace(kinds[0], states=(*kinds[0].states, spec)), *kinds[1:])
    loaded.model.model.layers[0].register_forward_pre_hook(_snapshot_hook)
    return Engine(ModelRunner(loaded.model, cfg, MemoryTracer(), layer_kinds=kinds), None), loaded.model


def _expected(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        emb = model.model.embed_tokens(torch.tensor(ids)).double()
    return torch.cat([torch.tensor([float(len(ids))], dtype=torch.float64), emb.sum(0)])


def _run(engine: Engine, model, prompts: list[list[int]], arrive_after: int = 0) -> tuple[dict, int]:
    """Prompts added one after another (the next once the previous has run `arrive_after` steps, 0: all at
    once); every running request's state checked after every step -> (tokens by id, states checked)."""
    t = engine.runner.cache.layers[0].tensors["running_sum"]
    outs, checked, pending = {}, 0, list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and (arrive_after == 0 or steps % arrive_after == 0 or not engine.has_unfinished()):
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=f"r{i}")
            if arrive_after == 0:
                continue
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        steps += 1
        for r in engine.scheduler.running:
            if not r.num_computed:
                continue
            got, want = t[r.state_slot], _expected(model, r.all_ids[: r.num_computed])
            assert got[0].item() == r.num_computed, f"{r.request_id}: count {got[0].item()} != {r.num_computed}"
            assert (got - want).abs().max().item() < SUM_TOL, f"{r.request_id}: running sum off"
            checked += 1
    return outs, checked


def test_a_prefix_hit_restores_the_state_from_the_last_cached_page(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, max_num_batched_tokens=7)
    assert engine.cfg.cache.enable_prefix_caching and engine.runner.cache.keeps_snapshots
    shared = random_ids(30, seed=3)
    # chunks of 7 cross the page boundaries 4, 8, ... inside chunks and end on 28: every snapshot form
    prompts = [shared, shared[:19] + [7, 8, 9, 10], shared[:13]]
    outs, checked = _run(engine, model, prompts, arrive_after=6)
    assert len(outs) == 3 and checked > 10
    firsts = {}
    for rec in engine.runner.tracer.records:
        for q in rec["requests"]:
            firsts.setdefault(q["id"], q)
    # r1 shares 19 tokens: 4 full pages (16 tokens) cached; r2 shares 13 (12 tokens, 3 pages; >= 1 computed)
    assert firsts["r1"]["cached_tokens"] == 16 and firsts["r2"]["cached_tokens"] == 12
    assert "state_restore_page" in firsts["r1"] and not firsts["r1"]["state_reset"]
    assert "state_restore_page" not in firsts["r0"] and firsts["r0"]["state_reset"]
    # the same tokens as an engine without prefix caching: the state changes no logit, the hit no token
    cold, _ = _engine(folder, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert not cold.runner.cache.keeps_snapshots
    assert _run(cold, model, prompts)[0] == outs


def test_preemption_resumes_from_the_snapshot_of_its_last_cached_page(hf_model_dir):
    """A pool small enough to preempt: a re-admitted request hits its own registered pages and resumes there,
    its state restored (not recomputed from token 0)."""
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, num_pages=9, max_num_seqs=3, max_num_batched_tokens=8)
    prompts = [random_ids(n, seed=n) for n in (5, 17, 1, 23, 10)]
    outs, checked = _run(engine, model, prompts)
    recs = engine.runner.tracer.records
    preempted = {p["id"] for r in recs for p in r["preempted"]}
    assert preempted, "the pool was meant to be small enough to preempt"
    resumed = [q for r in recs for q in r["requests"] if q["id"] in preempted and "state_restore_page" in q]
    assert resumed, "no preempted request resumed from a cached page"
    cold, _ = _engine(folder, enable_prefix_caching=False)
    assert _run(cold, model, prompts)[0] == outs and checked > 10


def test_chunks_list_the_boundaries_they_reach():
    # plain data of the batch: (k, page) for each boundary b in (context_len, seq_len], b = k + context_len
    c = SeqChunk("a", tuple(range(9)), 3, (10, 11, 12), state_slot=0)
    (s,) = ForwardBatch.build([c], 4, 1, snapshots=True).seqs
    assert s.snapshot_at == ((1, 10), (5, 11), (9, 12))  # boundaries 4, 8 and 12 (the chunk ends on it)
    (s,) = ForwardBatch.build([c], 4, 1).seqs
    assert s.snapshot_at == ()  # a cache without snapshots: none asked for
    d = SeqChunk("b", (1,), 4, (10, 11), state_slot=1, restore_page=10)
    batch = ForwardBatch.build([d], 4, 1, snapshots=True)
    assert batch.restores == ((1, 10),) and batch.seqs[0].snapshot_at == ()

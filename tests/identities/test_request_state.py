"""Request-addressed cache states through the real Engine and ModelRunner, with a real consumer.

The consumer is a small test layer state, `running_sum`, kept by layer 0 of a tiny v3 model: per running
request [1 + D] float64, the number of tokens the layer has seen and the sum of their layer-0 inputs (the
token embeddings). A forward pre-hook on layer 0 updates it from the step's data alone (one batched
index_add_ over StepContext.token_state_slots), so after every step the state of each running request must
equal a recomputation over its sequence, `count == num_computed` and `sum == embed(ids[:num_computed]).sum()`,
under chunked prefill, batching, preemption (re-admission recomputes from token 0, so a slot the runner did
not zero would count twice) and slot reuse (a stale slot would carry another request's sum).

Bound: the state accumulates fp32 embeddings (|x| < 4.4 on this model) in float64, at most 45 tokens per
request, and the recomputation sums the same values in float64 (possibly in another order): the difference
is fp64 rounding, at most 45 * 4.4 * 1.1e-16 = 2.2e-14, so 1e-13 (measured: 0.0 over 218 checks). One token
counted twice or missed moves the sum by a whole embedding row (its largest entry >= 1.75 here), the count by 1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_drain import drain, token_ids
from hf_models import random_ids

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.engine import make_options
from mlaserve.config.layer_kinds import StateSpec, declare_layers, describe, prefix_caching_blocker
from mlaserve.config.model import ConfigError
from mlaserve.engine.engine import Engine
from mlaserve.engine.request import Status
from mlaserve.executor.model_runner import ModelRunner, with_request_state_rules
from mlaserve.loading.model_loader import load_model
from mlaserve.observability.trace import MemoryTracer
from mlaserve.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SUM_TOL = 1e-13  # fp64 rounding of <= 45 terms |x| < 4.4 in two orders (see the module docstring)


def _sum_state(hidden: int, snapshot: bool = False) -> StateSpec:
    return StateSpec("running_sum", 1 + hidden, addressing="request", dtype=torch.float64, snapshot=snapshot)


def _running_sum_hook(layer, args):
    """Layer 0's input rows (the embeddings), added per token to its request's slot: [count | sum]."""
    x, step, _rope, state, _prev = args
    t = state.tensors["running_sum"]
    rows = torch.cat([torch.ones(x.shape[0], 1, dtype=t.dtype), x.to(t.dtype)], dim=-1)
    t.index_add_(0, step.token_state_slots, rows)


def _engine(folder, stateful: bool = True, **options):
    loaded = load_model(str(folder), make_options(**options))
    cfg = loaded.config
    kinds = declare_layers(cfg.model, cfg.attention.sparse)
    if stateful:
        first = kinds[0]
        kinds = (replace(first, states=(*first.states, _sum_state(cfg.model.hidden_size))), *kinds[1:])
        loaded.model.model.layers[0].register_forward_pre_hook(_running_sum_hook)
    runner = ModelRunner(loaded.model, cfg, MemoryTracer(), layer_kinds=kinds)
    return Engine(runner, None), loaded.model


def _expected(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        emb = model.model.embed_tokens(torch.tensor(ids)).double()
    return torch.cat([torch.tensor([float(len(ids))], dtype=torch.float64), emb.sum(0)])


def _check_states(engine: Engine, model) -> int:
    """Every running request's state equals the recomputation over its computed tokens -> how many checked."""
    if engine.slots is None:  # today's model: nothing to check
        return 0
    t = engine.runner.cache.layers[0].tensors["running_sum"]
    held = [r for r in engine.scheduler.running if r.num_computed]
    for r in held:
        got, want = t[r.state_slot], _expected(model, r.all_ids[: r.num_computed])
        assert got[0].item() == r.num_computed, f"request {r.request_id}: count {got[0].item()} != {r.num_computed}"
        err = (got - want).abs().max().item()
        assert err < SUM_TOL, f"request {r.request_id}: running sum off by {err:.2e}"
    assert t[engine.runner.cache.state_pad_slot].abs().max().item() == 0  # the pad slot is never written
    return len(held)


def _run(engine: Engine, model, prompts, params=GREEDY) -> tuple[dict[str, list[int]], int, int]:
    """Run to the end, checking every state after every step -> (tokens by id, states checked, peak slots held)."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    checked, peak = 0, 0

    def check() -> None:
        nonlocal checked, peak
        checked += _check_states(engine, model)
        held = engine.slots.num_slots - engine.slots.num_free if engine.slots else 0
        peak = max(peak, held)
        assert held == sum(r.state_slot is not None for r in engine.scheduler.running)

    return token_ids(drain(engine, check)), checked, peak


PROMPTS = [random_ids(n, seed=n) for n in (5, 17, 1, 33, 9)]


@pytest.fixture(scope="module")
def plain_tokens(hf_model_dir):
    """Greedy tokens of today's engine (no request state): the state must not change the model's math."""
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, stateful=False, enable_prefix_caching=False)
    return _run(engine, model, PROMPTS)[0]


def test_state_follows_chunked_prefill_and_batching(hf_model_dir, plain_tokens):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, max_num_batched_tokens=7, page_size=4)
    outs, checked, peak = _run(engine, model, PROMPTS)
    assert outs == plain_tokens
    assert checked > 20 and peak >= 2  # the states were checked mid-prefill and in batches
    recs = engine.runner.tracer.records
    assert any(len(r["requests"]) > 1 for r in recs)
    # the ledger names each sequence's slot and whether the runner zeroed it: exactly the chunks at position 0
    for r in recs:
        for q in r["requests"]:
            assert q["state_reset"] == (q["context_len"] == 0) and 0 <= q["state_slot"] < engine.slots.num_slots
    assert engine.slots.num_free == engine.slots.num_slots and not engine.slots.owner


def test_preemption_frees_the_slot_and_readmission_starts_from_zero(hf_model_dir, plain_tokens):
    folder, _ = hf_model_dir("v3_yarn")
    # three slots for five requests: a re-admitted request gets a slot another request (or itself) used before
    engine, model = _engine(folder, page_size=4, num_pages=14, max_num_seqs=3)
    outs, checked, _ = _run(engine, model, PROMPTS)
    assert outs == plain_tokens and checked
    recs = engine.runner.tracer.records
    preempted = {p["id"] for r in recs for p in r["preempted"]}
    assert preempted, "the pool was meant to be small enough to preempt"
    for rid in preempted:  # each preempted request started again from a zeroed state (context 0, reset)
        starts = [q for r in recs for q in r["requests"] if q["id"] == rid and q["context_len"] == 0]
        assert len(starts) >= 2 and all(q["state_reset"] for q in starts)
    assert engine.slots.num_free == engine.slots.num_slots


def test_slots_bound_admission_by_max_num_seqs_and_are_reused(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, max_num_seqs=2)
    assert engine.slots.num_slots == 2 and engine.runner.cache.num_slots == 2
    outs, _, peak = _run(engine, model, PROMPTS)
    assert len(outs) == len(PROMPTS) and peak == 2  # five requests through two slots, each reused
    used = {q["state_slot"] for r in engine.runner.tracer.records for q in r["requests"]}
    assert used == {0, 1}


def test_abort_and_failure_free_the_slot(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder)
    engine.add_request(PROMPTS[1], GREEDY, request_id="a")
    engine.add_request(PROMPTS[3], GREEDY, request_id="b")
    engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    assert {a.state_slot, b.state_slot} == {0, 1}
    assert engine.abort("a") and a.state_slot is None and engine.slots.owner == {b.state_slot: "b"}
    engine.fail(b, "test: a failed request gives its slot back")
    assert b.status is Status.FINISHED and b.state_slot is None and not engine.slots.owner
    engine.step()  # the abort's final output
    assert not engine.has_unfinished()


def test_children_of_one_prompt_keep_their_own_state(hf_model_dir):
    # n > 1 is n requests of one prompt (entrypoints/llm.py): same tokens, own slots, sampled apart
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder)
    params = [SamplingParams(temperature=1.0, seed=j, max_tokens=8, ignore_eos=True) for j in range(3)]
    for j, p in enumerate(params):
        engine.add_request(PROMPTS[1], p, request_id=f"c{j}")
    engine.step()
    assert sorted(r.state_slot for r in engine.scheduler.running) == [0, 1, 2]
    outs = token_ids(drain(engine, lambda: _check_states(engine, model)))
    assert len({tuple(v) for v in outs.values()}) > 1  # the children diverged, and each state followed its own


def test_prefix_caching_is_off_with_its_reason_when_a_state_lacks_snapshots(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, page_size=4, enable_prefix_caching=True)
    assert not engine.cfg.cache.enable_prefix_caching and not engine.pool.prefix_caching
    setting = next(s for s in engine.cfg.all_provenance() if s.name == "enable_prefix_caching")
    assert setting.value is False
    assert "layer 0's request state 'running_sum' has no page-boundary snapshot" in setting.source
    shared = PROMPTS[3]  # two prompts with a 32-token common prefix: 8 full pages a prefix cache would reuse
    outs, _, _ = _run(engine, model, [shared, shared[:32] + [7, 8, 9]])
    assert len(outs) == 2
    # the ledger's cached-token counts stay truthful: nothing was served from a cache
    assert all(q["cached_tokens"] == 0 for r in engine.runner.tracer.records for q in r["requests"])


def test_todays_models_get_no_slots_and_an_unchanged_config(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, stateful=False, page_size=4)
    loaded_cfg = engine.runner.cfg
    assert engine.slots is None and engine.scheduler.slots is None and engine.runner.cache.num_slots == 0
    assert with_request_state_rules(loaded_cfg, engine.runner.layer_kinds) is loaded_cfg
    assert engine.cfg.cache.enable_prefix_caching and prefix_caching_blocker(engine.runner.layer_kinds) is None
    outs, _, _ = _run(engine, model, PROMPTS[:2])
    assert len(outs) == 2
    for r in engine.runner.tracer.records:  # no slot in the batch, no state fields in the ledger
        assert all(set(q) == {"id", "query_len", "context_len", "cached_tokens"} for q in r["requests"])


def test_a_stateful_model_refuses_speculation_and_needs_slots(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    cfg = load_model(str(folder), make_options()).config
    kinds = declare_layers(cfg.model, cfg.attention.sparse)
    stateful = (replace(kinds[0], states=(*kinds[0].states, _sum_state(cfg.model.hidden_size))), *kinds[1:])
    with pytest.raises(ConfigError, match="speculative='mtp': layer 0's request state 'running_sum' would advance"):
        with_request_state_rules(replace(cfg, speculative=replace(cfg.speculative, method="mtp")), stateful)
    snap = (replace(kinds[0], states=(*kinds[0].states, _sum_state(8, snapshot=True))), *kinds[1:])
    assert prefix_caching_blocker(snap) is None  # a snapshotted state keeps prefix caching on
    kept = ModelCache(snap, 4, 4, torch.float32, num_slots=2, snapshots=True)  # one snapshot row per page + pad
    assert kept.keeps_snapshots and kept.layers[0].tensors["running_sum_snapshot"].shape == (4 + 1, 1 + 8)
    assert not ModelCache(snap, 4, 4, torch.float32, num_slots=2).keeps_snapshots  # prefix caching off: none
    with pytest.raises(ConfigError, match="needs state slots"):
        ModelCache(stateful, 4, 4, torch.float32)


def test_bytes_per_request_are_reported_next_to_bytes_per_token(hf_model_dir):
    folder, _ = hf_model_dir("v3_yarn")
    engine, _ = _engine(folder, max_num_seqs=3)
    cache, kinds, d = engine.runner.cache, engine.runner.layer_kinds, engine.cfg.model.hidden_size
    assert ModelCache.bytes_per_request(kinds, torch.float32) == (1 + d) * 8 == cache.measured_bytes_per_request()
    # request states are not per-token bytes: the paged figure is today's
    plain = declare_layers(engine.cfg.model, engine.cfg.attention.sparse)
    assert cache.measured_bytes_per_token() == ModelCache.bytes_per_token(kinds, torch.float32)
    assert ModelCache.bytes_per_token(kinds, torch.float32) == ModelCache.bytes_per_token(plain, torch.float32)
    assert cache.layers[0].tensors["running_sum"].shape == (3 + 1, 1 + d)
    line = describe(kinds, 4)[0]
    assert f"running_sum [{1 + d}] float64 per request (no snapshots)" in line
    assert f"{(1 + d) * 8} bytes/request" in line
    # a multi-dim request state (a recurrent [H, dk, dv]) in the cache dtype
    rec = StateSpec("recurrent", 6, addressing="request", per_request=(2, 5))
    assert rec.request_shape == (2, 5, 6) and rec.values_per_request() == 60
    with pytest.raises(ConfigError, match="state 'ring': addressing 'ring' is not one of"):
        StateSpec("ring", 8, addressing="ring")
    with pytest.raises(ConfigError, match="apply to 'request' addressing only"):
        StateSpec("latent", 8, snapshot=True)


def test_the_server_ready_line_reports_bytes_per_token_and_per_request(hf_model_dir):
    from types import SimpleNamespace

    from mlaserve.entrypoints.openai.server import _ready

    folder, _ = hf_model_dir("v3_yarn")
    for stateful in (True, False):
        engine, _ = _engine(folder, stateful=stateful, max_num_seqs=3)
        llm = SimpleNamespace(config=engine.cfg, runner=engine.runner, engine=engine)
        line = _ready(llm, "tiny", "127.0.0.1", 8000)
        per_token = ModelCache.bytes_per_token(engine.runner.layer_kinds, torch.float32)
        assert f"tokens ({per_token} bytes/token)" in line
        d = engine.cfg.model.hidden_size
        assert (f"state slots 3 x {(1 + d) * 8} bytes/request" in line) == stateful, line


def test_prompt_logits_runs_in_chunks_through_a_given_slot(hf_model_dir):
    # the path of `verify` and LLM.prompt_logits: chunks of max_num_batched_tokens, the slot zeroed at chunk 0
    folder, _ = hf_model_dir("v3_yarn")
    engine, model = _engine(folder, max_num_batched_tokens=8, page_size=4)
    runner, ids = engine.runner, PROMPTS[3]
    pages = list(range(-(-len(ids) // 4)))
    t = runner.cache.layers[0].tensors["running_sum"]
    t[1] = 7.0  # a stale state left in the slot: the first chunk's reset must clear it
    with_state = runner.prompt_logits("p", ids, pages, state_slot=1)
    assert (t[1] - _expected(model, ids)).abs().max().item() < SUM_TOL
    plain, _ = _engine(folder, stateful=False, max_num_batched_tokens=8, page_size=4)
    assert torch.equal(with_state, plain.runner.prompt_logits("p", ids, pages))  # the state changes no logit
    with pytest.raises(ValueError, match="request p: this model keeps request states; no state slot given"):
        runner.prompt_logits("p", ids, pages)
    with pytest.raises(ValueError, match="request p: state slot 64 outside"):
        runner.prompt_logits("p", ids, pages, state_slot=64)

"""DeepSeek-V4 through the Engine / LLM against transformers' DeepseekV4ForCausalLM on the same random weights (fp32).

The folder is written by transformers' save_pretrained (tests/v4_models.py: every layer kind, CSA ratio 4 and
HCA ratio 8 or 3 and 6, sliding windows 5-7, index_topk 2-3 below the CSA rows of the longer prompts, 8
indexer heads), so the engine's whole path runs: config reader, loader, layer kinds and their request states
in the cache's slots, scheduler, chunked prefill, batching, preemption, slot reuse.

Bound: 1e-5 max abs on logits of magnitude ~4 (fp32). Measured through the engine on these configs: 0 .. 2.3e-6
at every position for every chunk budget (the same fp32 rounding as the model's own tests: keys summed over
differently shaped sets when a prompt is chunked, windows pooled across chunk edges). A defect moves logits by
1e-2 .. 1: a slot not zeroed on reset (a reused slot's stale ring rows and carry), a window one row short.
Batch == alone: compared within the same bound, not bitwise: a step's projections and MoE run over all its
tokens at once, and a BLAS GEMM's rounding may depend on the number of rows, and the alone run splits request
a's chunks differently (measured: 9.5e-7 max abs batch vs alone, 9.5e-7 vs transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import hf_greedy

pytest.importorskip("transformers")

from state_engine import assert_close  # noqa: E402
from v4_models import SPECS, build_hf_v4, hf_v4_logits, largest_ratio  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402
from mlaserve.kernels import native  # noqa: E402
from mlaserve.models.deepseek_v4.norm import RMSNorm  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5


@pytest.fixture(scope="module", params=list(SPECS))
def v4(request, tmp_path_factory):
    """(spec, transformers model, folder written by its save_pretrained)."""
    hf = build_hf_v4(request.param, seed=1)
    folder = tmp_path_factory.mktemp(f"v4_{request.param}")
    hf.save_pretrained(folder)
    return request.param, hf, folder


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=2)
    folder = tmp_path_factory.mktemp("v4_engine_all_kinds")
    hf.save_pretrained(folder)
    return hf, folder


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _ratios(folder: Path) -> tuple[int, ...]:
    raw = json.loads((folder / "config.json").read_text())
    rates = raw["compress_rates"]
    return tuple(sorted({rates[t] for t in raw["layer_types"] if t in rates}))


def _boundary_lengths(folder: Path, kind: str) -> list[int]:
    """Prompt lengths at, just before and just after every multiple of every ratio, up to 3 x the largest + 5."""
    top = 3 * largest_ratio(kind) + 5
    return sorted({n for m in _ratios(folder) for n in range(1, top + 1) if n % m in (0, 1, m - 1)})


@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow), 3, 4, 7])  # 1: token by token
def test_prompt_logits_at_every_position_around_every_boundary(v4, budget):
    """Chunked prefill through the engine (chunks of `budget` tokens, the cache's request-state slot carried
    between steps) == transformers' one pass, at every position, for lengths around every compression boundary."""
    kind, hf, folder = v4
    llm = LLM(str(folder), max_num_batched_tokens=budget)
    assert llm.config.cache.enable_prefix_caching is True  # on for V4: every request state restorable at a page
    for n in _boundary_lengths(folder, kind):
        ids = _ids(n, hf.config.vocab_size, n)
        assert_close(llm.prompt_logits(ids), hf_v4_logits(hf, ids), BOUND, f"{kind} length {n} budget {budget}")


def _native_v4_ops(llm: LLM) -> None:
    """Bind V4's own native ops on every layer, the attention's padded softmax with sinks (csrc/attention.c
    mls_sink_mqa), the hyper-connections' mixing (csrc/hyper.c mls_hc_pre) and the weighted RMSNorms (csrc/glue.c
    mls_rms_norm): the KernelPlan gives them to quantized files (native kernels); a float folder's plan keeps torch."""

    def norms(layer):
        return [m for m in layer.modules() if isinstance(m, RMSNorm)]

    if not native.status().available:
        pytest.skip(f"native kernels unavailable: {native.status().detail}")
    for layer in llm.runner.model.inner.model.layers:
        for module in (layer.self_attn, layer.attn_hc, layer.ffn_hc, *norms(layer)):
            module.kernel = "native"


def test_native_v4_ops_through_the_engine_equal_transformers(v4):
    """The same prompts and bound with the native softmax and mixing: chunks of 3 tokens (a chunk's keys span the
    ring, the chunk and the pools), then two requests decoded together beside each other's prefill (pad query
    slots in the padded layout) == transformers' greedy."""
    kind, hf, folder = v4
    llm = LLM(str(folder), max_num_batched_tokens=3)
    _native_v4_ops(llm)
    for n in _boundary_lengths(folder, kind):
        ids = _ids(n, hf.config.vocab_size, n)
        assert_close(llm.prompt_logits(ids), hf_v4_logits(hf, ids), BOUND, f"{kind} length {n}, native ops")
    llm = LLM(str(folder), max_num_batched_tokens=5)
    _native_v4_ops(llm)
    prompts = [_ids(11, hf.config.vocab_size, 11), _ids(3, hf.config.vocab_size, 3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 12, hf_v4_logits), f"prompt of {len(p)} tokens"


def test_greedy_32_tokens_equal_transformers_full_recompute(all_kinds):
    hf, folder = all_kinds
    llm = LLM(str(folder), max_num_batched_tokens=5)
    prompts = [_ids(11, hf.config.vocab_size, 11), _ids(3, hf.config.vocab_size, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params)  # both in flight together: decodes batched with the other's prefill
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 32, hf_v4_logits), f"prompt of {len(p)} tokens"


def test_a_batch_of_mixed_lengths_equals_each_alone(all_kinds):
    """One step with a decode and prefills of several lengths (each in its own slot) == each sequence alone."""
    hf, folder = all_kinds
    llm = LLM(str(folder), max_num_seqs=4)
    runner, vocab, ps = llm.runner, hf.config.vocab_size, llm.config.cache.page_size
    prompts = {"a": _ids(9, vocab, 1), "b": _ids(14, vocab, 2), "c": _ids(4, vocab, 3)}
    pages = {r: list(range(i * 8, i * 8 + 8)) for i, r in enumerate(prompts)}

    def chunk(rid, ids, done, slot):
        table = tuple(pages[rid][: -(-(done + len(ids)) // ps)])
        return SeqChunk(rid, tuple(ids), done, table, all_logits=True, state_slot=slot, reset_state=done == 0)

    alone = {}
    for rid, ids in prompts.items():  # each alone, in slot 0 (reset at its first chunk): 5 tokens, then the rest
        rows = [runner.execute([chunk(rid, ids[:5], 0, 0)])[1]]
        if len(ids) > 5:
            rows.append(runner.execute([chunk(rid, ids[5:], 5, 0)])[1])
        alone[rid] = torch.cat(rows)
    together: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    # step 1: three prefills in slots 1-3 (c whole, a and b their first 5 tokens)
    first = [chunk("a", prompts["a"][:5], 0, 1), chunk("b", prompts["b"][:5], 0, 2), chunk("c", prompts["c"], 0, 3)]
    # step 2: a one-token (decode) chunk beside b's 9-token prefill
    second = [chunk("a", prompts["a"][5:6], 5, 1), chunk("b", prompts["b"][5:], 5, 2)]
    for chunks in (first, second):
        batch, logits = runner.execute(chunks)
        for (rid, _), row in zip(batch.logits_owner, logits):
            together[rid].append(row)
    assert batch.num_decode_seqs == 1  # the second step mixed a decode and a prefill
    worst = 0.0
    for rid, rows in together.items():
        got = torch.stack(rows)
        ref = alone[rid][: got.shape[0]]
        worst = max(worst, (got - ref).abs().max().item())
        assert_close(got, ref, BOUND, f"request {rid}: batch vs alone (worst so far {worst:.3g})")
        assert_close(got, hf_v4_logits(hf, prompts[rid])[: got.shape[0]], BOUND, f"request {rid} vs transformers")


def _engine_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], list[dict]]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(
            p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}"
        )
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return outs, list(llm.runner.tracer.records)


PROMPT_LENGTHS = (5, 17, 1, 23, 10)


def test_preemption_mid_window_is_exact(all_kinds):
    """A pool small enough to preempt: a re-admitted request restarts from a zeroed slot and recomputes from token
    0; its tokens equal transformers' greedy, including requests preempted inside a compression window."""
    hf, folder = all_kinds
    # page_size 8: the paged pools need a multiple of every ratio (4, 8); 5 pages hold the longest request.
    # Prefix caching off: re-admission recomputes from token 0 (with it on, it resumes from a page snapshot:
    # tests/identities/test_deepseek_v4_prefix_cache.py)
    llm = LLM(str(folder), page_size=8, num_pages=5, max_num_seqs=3, trace="memory", enable_prefix_caching=False)
    prompts = [_ids(n, hf.config.vocab_size, n) for n in PROMPT_LENGTHS]
    outs, recs = _engine_run(llm, prompts, 10)
    preempted = [(r["step"], p["id"]) for r in recs for p in r["preempted"]]
    assert preempted, "the pool was meant to be small enough to preempt"
    # the context each preempted request had reached before it was preempted: some inside a CSA/HCA window
    reached = []
    for step, rid in preempted:
        seen = [q for r in recs if r["step"] < step for q in r["requests"] if q["id"] == rid]
        if seen:
            reached.append(seen[-1]["context_len"] + seen[-1]["query_len"])
    assert any(n % 4 or n % 8 for n in reached), f"no preemption inside a window: contexts {reached}"
    for step, rid in preempted:  # each re-admission starts over at token 0 in a zeroed slot
        again = next(q for r in recs if r["step"] > step for q in r["requests"] if q["id"] == rid)
        assert again["context_len"] == 0 and again["state_reset"] and "state_restore_page" not in again
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(hf, p, 10, hf_v4_logits), f"prompt of {len(p)} tokens"


def test_more_requests_than_slots_reuse_them_exactly(all_kinds):
    hf, folder = all_kinds
    llm = LLM(str(folder), max_num_seqs=2, max_num_batched_tokens=6, trace="memory")
    prompts = [_ids(n, hf.config.vocab_size, 100 + n) for n in PROMPT_LENGTHS]
    outs, recs = _engine_run(llm, prompts, 8)
    assert {q["state_slot"] for r in recs for q in r["requests"]} == {0, 1}  # five requests through two slots
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(hf, p, 8, hf_v4_logits), f"prompt of {len(p)} tokens"


def test_a_reused_slot_starts_zeroed(all_kinds):
    """Stale rows are never read (a sequence reads only rows its own positions wrote), and the runner zeroes a
    slot when a sequence starts in it all the same: after a 20-token request, a 5-token one in the same slot
    leaves only its own ring rows (0-4) and carries non-zero. (The compressed pools are paged: a page a
    request did not write is not in its block table, so it is never read.)"""
    hf, folder = all_kinds
    llm = LLM(str(folder), max_num_seqs=1, enable_prefix_caching=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # the prompt only is run
    llm.generate([_ids(20, hf.config.vocab_size, 20)], one)
    cache = llm.runner.cache
    assert torch.count_nonzero(cache.layers[1].tensors["window"][0, 5:]) > 0  # the long request's ring rows
    assert torch.count_nonzero(cache.layers[1].tensors["kv_overlap"][0]) > 0  # and its last closed window
    llm.generate([_ids(5, hf.config.vocab_size, 5)], one)
    for layer in cache.layers:
        t = layer.tensors
        assert torch.count_nonzero(t["window"][0, 5:]) == 0, f"layer {layer.kind.index}: stale ring rows"
        if "kv_overlap" in t:  # ratio 4: one window closed in 5 tokens, so the overlap is the new request's
            assert not torch.equal(t["kv_overlap"][0], torch.zeros_like(t["kv_overlap"][0]))
        assert torch.count_nonzero(t["window"][cache.state_pad_slot]) == 0  # the pad slot is never written


@pytest.mark.parametrize(
    "option, why",
    [
        (dict(tensor_parallel_size=2), "not split across ranks"),
        (dict(quantization="int8"), "quantizing its float weights at load is not built"),
        (dict(kv_cache_dtype="int8"), "rounds its rows through FP8 only"),
    ],
)
def test_what_v4_does_not_run_yet_is_refused_with_its_reason(all_kinds, option, why):
    from mlaserve.config.model import ConfigError

    with pytest.raises(ConfigError, match=f"DeepSeek-V4 with {next(iter(option))}=.*{why}"):
        LLM(str(all_kinds[1]), **option)

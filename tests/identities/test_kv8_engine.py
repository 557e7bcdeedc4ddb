"""The engine over an 8-bit cache (kv_cache_dtype int8 / fp8_e4m3): the route identities hold as they do over
the full cache, because every reader (decode, prefill, the indexer) reads the same quantized rows, written once.

- chunked prefill (budget 7) and token-by-token decode write the same 8-bit rows as one forward, up to codes
  that flip at a rounding boundary (each within both rows' error bounds), and give its logits to fp32 rounding
  (TOL, as tests/identities/test_identities.py) where none flipped; absorbed and decompressed, dense and DSA;
- preemption and a batch leave greedy output equal to each request alone over the same 8-bit cache;
- a prefix-cache hit gives the same greedy tokens as a fresh engine, the ledger counting cached tokens;
- the ledger names the layout, `inspect`'s lines count its bytes; the 8-bit logits really differ from the full
  cache's (the option is live), by an amount printed, not asserted: the derived bound is per attention call
  (tests/identities/test_kv8_attention.py, `mlaserve verify`), and no bound through the whole stack is claimed.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import random_ids

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.sampling.params import SamplingParams

TOL = 1e-5  # fp32 reassociation noise between two orders of the same sums (as test_identities.py)
# codes that may differ between two routes: measured 0-1 per run (of ~3,500 codes here); 1 in 1,000 leaves room
# for another CPU's rounding and still fails a route that writes different rows
MAX_FLIP_FRACTION = 1e-3
# 16-bit rows: float16's relative spacing 2^-10 is far finer than an 8-bit code's, so more values lie within fp32
# noise (~1e-6 relative between two summation orders, e.g. TP=2's split reductions) of a midpoint: ~1e-3 of them
# (measured 1.4e-3 under TP=2, 0-5e-4 in one process); each flip must be the neighbouring value (checked above),
# and a route that writes different rows moves most values by many steps
MAX_FLIP_FRACTION_16 = 1e-2
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [random_ids(n, seed=n) for n in (5, 17, 1, 33, 9)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _compare_caches(a: LLM, b: LLM, n: int) -> int:
    """Two engines' 8-bit rows at slots 0..n-1 (a fresh pool hands one prompt pages 0, 1, ... in order) hold
    the same values up to their quantization: x~_a and x~_b quantize values equal up to fp32 rounding, so
    |x~_a - x~_b| <= delta_a + delta_b (+ that rounding); kept values within TOL. -> codes that differ: a value
    within fp32 noise of a rounding boundary lands on the neighbouring code (one step), which no fp32 tolerance
    can promise away."""
    slots = torch.arange(n)
    flips = codes = 0
    half = False
    for la, lb in zip(a.runner.cache.layers, b.runner.cache.layers):
        for name, qa in la.tensors.items():
            qb = lb.tensors[name]
            va, vb = qa.rows(slots), qb.rows(slots)
            q = qa.fmt.quantized
            slack = qa.error(slots) + qb.error(slots) + TOL
            assert bool(((va[:, :q] - vb[:, :q]).abs() <= slack).all()), name
            assert (va[:, q:] - vb[:, q:]).abs().max().item() <= TOL if qa.fmt.kept else True
            flips += int((qa.codes[:n] != qb.codes[:n]).sum())
            codes += qa.codes[:n].numel()
            if qa.fmt.half:  # a 16-bit flip is the neighbouring value: bit patterns one apart
                steps = (qa.codes[:n].view(torch.int16).int() - qb.codes[:n].view(torch.int16).int()).abs()
                assert int(steps.max()) <= 1, name
                half = True
    # a flip is a value within fp32 noise of a rounding boundary: rare. Many flips are no longer that (a route that
    # writes different rows), so they fail here even where the logits cannot be compared
    limit = MAX_FLIP_FRACTION_16 if half else MAX_FLIP_FRACTION
    assert flips <= max(2, limit * codes), f"{flips} of {codes} codes differ"
    return flips


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kind", ["v3_yarn", "v32"])
@pytest.mark.parametrize("mla_path", ["auto", "decompressed"])
@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_equals_one_forward(hf_model_dir, kind, codes, mla_path, budget):
    """The same rows (up to a code flip at a rounding boundary, _compare_caches); where no code flipped the
    logits are equal to fp32 rounding, as over the full cache. Where one did, the logits moved by what one
    step of one value does through the rest of the stack: printed, not bounded here."""
    folder, _ = hf_model_dir(kind)
    ids = random_ids(36, seed=4)  # > index_topk 16 of v32: selection runs over FP8 keys
    one = LLM(str(folder), kv_cache_dtype=codes, mla_path=mla_path, page_size=4)
    full = one.prompt_logits(ids)
    llm = LLM(
        str(folder), kv_cache_dtype=codes, mla_path=mla_path, max_num_batched_tokens=budget, page_size=4, trace="memory"
    )
    chunked = llm.prompt_logits(ids)
    flips = _compare_caches(one, llm, len(ids))
    diff = (full - chunked).abs().max().item()
    print(f"{kind} {codes} {mla_path} budget {budget}: {flips} codes flipped, max |logit diff| {diff:.3g}")
    if not flips:
        assert diff <= TOL
    recs = llm.runner.tracer.records
    assert {r["kv_cache"] for r in recs} == {codes}
    cache = llm.runner.cache.layers[0]
    assert isinstance(cache.latent, QuantizedRows) and cache.latent.fmt.codes == codes
    if kind == "v32":
        assert isinstance(cache.index_keys, QuantizedRows) and cache.index_keys.fmt.codes == "fp8_e4m3"
        assert any(r["needs_selection"] for r in recs)


@pytest.mark.parametrize("kind", ["v3_yarn", "v32"])
def test_8bit_logits_differ_from_full_and_are_reported(hf_model_dir, kind):
    folder, _ = hf_model_dir(kind)
    ids = random_ids(48, seed=3)
    full = LLM(str(folder)).prompt_logits(ids)
    for codes in ("int8", "fp8_e4m3"):
        got = LLM(str(folder), kv_cache_dtype=codes).prompt_logits(ids)
        diff = (got - full).abs().max().item()
        top1 = (got.argmax(-1) == full.argmax(-1)).float().mean().item()
        print(f"{kind} {codes}: max |logit diff| {diff:.3g}, top-1 agreement {top1:.3f}")
        assert diff > TOL  # the rows really are 8-bit


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def alone(request, hf_model_dir):
    folder, _ = hf_model_dir("v32")
    llm = LLM(str(folder), kv_cache_dtype=request.param)
    return request.param, [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def test_batch_chunks_and_preemption_keep_greedy_output(hf_model_dir, alone):
    codes, want = alone
    folder, _ = hf_model_dir("v32")
    llm = LLM(str(folder), kv_cache_dtype=codes, page_size=4, num_pages=16, max_num_batched_tokens=7)
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages


def test_prefix_cache_hit_keeps_greedy_output(hf_model_dir, alone):
    codes, _ = alone
    folder, _ = hf_model_dir("v32")
    prefix = random_ids(24, seed=7)
    a, b = prefix + random_ids(5, seed=8), prefix + random_ids(6, seed=9)
    fresh = _tokens(LLM(str(folder), kv_cache_dtype=codes, enable_prefix_caching=False).generate([b], GREEDY))
    llm = LLM(str(folder), kv_cache_dtype=codes, page_size=4, trace="memory")
    llm.generate([a], GREEDY)
    assert _tokens(llm.generate([b], GREEDY)) == fresh
    cached = [q["cached_tokens"] for r in llm.runner.tracer.records for q in r["requests"]]
    assert max(cached) == 24


def test_inspect_lines_count_the_8bit_bytes(hf_model_dir):
    from mlaserve.config.layer_kinds import describe

    folder, _ = hf_model_dir("v32")
    llm = LLM(str(folder), kv_cache_dtype="int8")
    lines = describe(llm.runner.layer_kinds, 4)
    # r 32 (one block), dr 16 kept fp32, Di 32: latent 32 + 4 + 64 = 100 bytes, keys 32 + 4 = 36 (vs 192, 128)
    assert any("latent [48] as int8 [32] / 32 per scale + 16 kept" in line for line in lines)
    full_layers = sum(k.state("index_keys") is not None for k in llm.runner.layer_kinds)
    assert full_layers == 3  # deepseek_v32: every layer a full indexer layer
    measured = llm.runner.cache.measured_bytes_per_token()
    full = LLM(str(folder)).runner.cache.measured_bytes_per_token()
    assert (measured, full) == (100 * 3 + 36 * 3, 48 * 4 * 3 + 32 * 4 * 3)

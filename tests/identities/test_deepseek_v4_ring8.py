"""DeepSeek-V4's sliding-window ring and its page snapshots in 8 bits (kv_cache_dtype=fp8_e4m3), scales as one
e8m0 byte, on a save_pretrained folder of the tiny config whose shapes the official rounding takes
(tests/official_v4.py OFFICIAL_SHAPES: head_dim 136 = 128 non-rope + 8 rope values, W = 6, CSA 4, HCA 8).

- Layout and bytes: every layer's ring and its snapshots are QuantizedRows (e4m3 codes, uint8 e8m0 scales, the
  rope part kept); a ring row takes 128 + 2 + 8 x c bytes instead of 136 x c (fp32: 162 vs 544, 3.36x fewer;
  bf16: 146 vs 272, 1.86x), counted by hand == `inspect`'s lines == the allocation, per request and per token of
  snapshots; kv_cache_memory sizes pages by those bytes.
- Equality with the official path: with power-of-two scales the rows the FP8 rounding makes are what the codes
  hold, so the 8-bit cache (pools and rings) == the full cache with v4_kv_rounding=fp8_ue8m0 bit for bit: every
  ring and snapshot row read back equal to the full cache's (torch.equal), the top-20 logprobs of every decoded
  token equal, for prompts of length 3 mod 4 (the CSA window boundary) decoded across CSA and HCA boundaries.
- Snapshots restore bit-exactly: a request preempted and re-admitted from its last cached page's 8-bit
  snapshot continues exactly as one never preempted (tokens and logprobs equal, not within a bound: one token
  per step, so both runs do the same arithmetic and only the restored state could differ).
- Against the full cache without the rounding (transformers' numerics): per attention call, the output over the
  8-bit rows is within the bound derived from the stored scales (attention/cache_error.py shared_kv_error_bound,
  plus verify's fp32 slack); the logits' distance and the greedy agreement are reported (no bound through the
  whole stack is derived, as for MLA's verify).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from official_v4 import OFFICIAL_SHAPES  # noqa: E402
from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.attention.cache_error import shared_kv_error_bound  # noqa: E402
from mlaserve.cache.quantized_rows import QuantizedRows  # noqa: E402
from mlaserve.config.kv_cache import describe_layout  # noqa: E402
from mlaserve.config.layer_kinds import describe  # noqa: E402
from mlaserve.config.v4_numerics import kv_format  # noqa: E402
from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.entrypoints.verify_kv8 import FP32_SLACK  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.sink_softmax import keyed_of  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

PAGE = 8  # a multiple of CSA 4 and HCA 8
D, ROPE, C, W = 136, 8, 64, 6  # head_dim, rope dims, index_head_dim, sliding_window
NOPE = D - ROPE
LAYERS, CSA_LAYERS, HCA_LAYERS = 4, 2, 1  # all_kinds: sliding, CSA 4, HCA 8, CSA 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=2, **OFFICIAL_SHAPES)
    path = tmp_path_factory.mktemp("v4_ring8")
    hf.save_pretrained(path)
    return hf, path


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _engines(path, **kw) -> tuple[LLM, LLM]:
    """The full cache with the official rounding, and the 8-bit cache (which implies it)."""
    kw = dict(page_size=PAGE, max_num_seqs=2, **kw)
    return LLM(str(path), v4_kv_rounding="fp8_ue8m0", **kw), LLM(str(path), kv_cache_dtype="fp8_e4m3", **kw)


def _ring_row(compute_bytes: int) -> int:
    return NOPE + NOPE // 64 + ROPE * compute_bytes  # e4m3 codes + one e8m0 byte per 64 + the rope part kept


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_ring_and_snapshots_are_8bit_and_counted(folder, dtype, size):
    _, path = folder
    full = LLM(str(path), dtype=dtype, page_size=PAGE, num_pages=16, max_num_seqs=3)
    eight = LLM(str(path), dtype=dtype, page_size=PAGE, num_pages=16, max_num_seqs=3, kv_cache_dtype="fp8_e4m3")
    for layer in eight.runner.cache.layers:
        for name in ("window", "window_snapshot"):
            t = layer.tensors[name]
            assert isinstance(t, QuantizedRows) and t.fmt == kv_format(NOPE, ROPE), name
            assert t.codes.dtype == torch.uint8 and t.scales.dtype == torch.uint8, name  # e8m0: one byte a scale
            assert t.kept.dtype == eight.config.runtime.dtype and t.shape[1:] == (W, D), name
    # `inspect`'s layout line names both 8-bit states
    layout = describe_layout(eight.runner.layer_kinds, "fp8_e4m3", dtype)
    assert "kv_pool fp8_e4m3 [128] / 64 per scale (ue8m0" in layout and "window fp8_e4m3 [128] / 64" in layout
    row, full_row = _ring_row(size), D * size
    # as stated: fp32 162 vs 544 bytes a ring row (3.36x), bf16 146 vs 272 (1.86x)
    assert (row, full_row) == ((162, 544) if size == 4 else (146, 272))
    carries = size * (CSA_LAYERS * (2 * 4 * 2 * D + 2 * 4 * D + 2 * 4 * 2 * C + 2 * 4 * C) + HCA_LAYERS * 2 * 8 * D)
    by_hand = {"full": LAYERS * W * full_row + carries, "eight": LAYERS * W * row + carries}
    assert full.runner.cache.measured_bytes_per_request() == by_hand["full"]
    assert eight.runner.cache.measured_bytes_per_request() == by_hand["eight"]
    # snapshots per page: every ring, and each CSA layer's overlap halves (kept in the compute dtype)
    halves = CSA_LAYERS * (2 * 4 * D + 2 * 4 * C) * size
    snap_page = {"full": LAYERS * W * full_row + halves, "eight": LAYERS * W * row + halves}
    pools_page = {
        "full": CSA_LAYERS * (D + C) * size * (PAGE // 4) + HCA_LAYERS * D * size * (PAGE // 8),
        "eight": CSA_LAYERS * (row + C * size) * (PAGE // 4) + HCA_LAYERS * row * (PAGE // 8),
    }
    for name, llm in (("full", full), ("eight", eight)):
        assert llm.runner.cache.measured_bytes_per_token() == (pools_page[name] + snap_page[name]) // PAGE, name
    lines = describe(eight.runner.layer_kinds, size, PAGE)
    assert all(f"window [{W} x {D}] as fp8_e4m3 [{NOPE}] / 64 per scale (ue8m0" in line for line in lines)
    snapped = sum(float(line.split(" bytes/token of snapshots")[0].rsplit("+ ", 1)[1]) for line in lines)
    per_request = sum(int(line.split(" bytes/request")[0].rsplit(", ", 1)[1]) for line in lines)
    assert snapped == snap_page["eight"] / PAGE and per_request == by_hand["eight"]
    # kv_cache_memory: a page holds its pool rows and its snapshot rows, both in the 8-bit layout
    gib = 2**20 / 2**30
    pages = LLM(str(path), dtype=dtype, page_size=PAGE, kv_cache_memory=gib, kv_cache_dtype="fp8_e4m3")
    assert pages.config.cache.num_pages == 2**20 // (pools_page["eight"] + snap_page["eight"])


def _same_logprobs(a, b) -> None:
    for x, y in zip(a, b):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert da == db  # the same tokens ranked with the same values, bit for bit


def _states(llm, name: str) -> list[torch.Tensor]:
    """Every layer's `name` tensor read back in the compute dtype (8-bit rows dequantized)."""
    out = []
    for layer in llm.runner.cache.layers:
        if name not in layer.tensors:  # a sliding layer has no pool
            continue
        t = layer.tensors[name]
        out.append(t.rows(torch.arange(t.shape[0])) if isinstance(t, QuantizedRows) else t)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_8bit_ring_equals_the_rounded_full_ring_bit_for_bit(folder, dtype):
    """Prompts of 23 and 11 tokens (3 mod 4: the CSA window boundary) in chunks of 5 beside each other, then 14
    tokens decoded each (across CSA boundaries at 24, 28, 32, 36 and HCA boundaries at 24, 32): the same
    schedule both ways, so every ring, snapshot and pool row and every logprob must match exactly."""
    hf, path = folder
    vocab = hf.config.vocab_size
    prompts = [_ids(23, vocab, 31), _ids(11, vocab, 32)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=20)
    full, eight = _engines(path, dtype=dtype, max_num_batched_tokens=5)
    outs = [llm.generate(prompts, params) for llm in (full, eight)]
    _same_logprobs(*outs)
    for name in ("window", "window_snapshot", "kv_pool"):
        for i, (a, b) in enumerate(zip(_states(full, name), _states(eight, name))):
            assert torch.equal(a, b), f"layer {i} {name}"
    assert any(t.abs().sum() > 0 for t in _states(eight, "window_snapshot"))  # snapshots were written


def _run(llm, prompts, params) -> tuple[dict, list]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs, list(llm.runner.tracer.records)


def test_a_request_resumed_from_an_8bit_snapshot_continues_as_one_never_stopped(folder):
    """Request A: a 21-token prompt, 14 tokens decoded. Request B: A's prompt and its first 6 tokens (27 tokens):
    its prefix hit covers 3 pages (24 tokens: inside a CSA window of A's decode) and restores the rings from the
    24-token page's 8-bit snapshot (codes and scales copied as stored). One token per step, so B's steps from
    position 24 on do the arithmetic A's did: its logprobs at every position equal A's bit for bit, which holds
    only if the restored rings (and overlap halves) are exactly the states A had there."""
    hf, path = folder
    ids = _ids(21, hf.config.vocab_size, 51)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=20)
    llm = LLM(str(path), page_size=PAGE, max_num_batched_tokens=1, kv_cache_dtype="fp8_e4m3", trace="memory")
    a = llm.generate([ids], params)[0]
    tokens = list(a.outputs[0].token_ids)
    b = llm.generate([ids + tokens[:6]], replace(params, max_tokens=8))[0]
    assert b.metrics["num_cached_prompt_tokens"] == 24
    assert any(q.get("state_restore_page") is not None for r in llm.runner.tracer.records for q in r["requests"])
    assert list(b.outputs[0].token_ids) == tokens[6:]
    assert b.outputs[0].logprobs == a.outputs[0].logprobs[6:]  # bit for bit


def test_preemption_with_the_8bit_ring(folder):
    """A pool of 5 pages preempts requests inside compression windows; re-admitted, each resumes from its last
    cached page's snapshot. The same schedule on the full cache with the rounding (fp32 snapshots) gives the same
    tokens and logprobs bit for bit; a pool that never preempts gives the same greedy tokens."""
    hf, path = folder
    vocab = hf.config.vocab_size
    prompts = [_ids(n, vocab, 50 + n) for n in (5, 17, 1, 23, 10)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=20)
    kw = dict(page_size=PAGE, max_num_seqs=3, max_num_batched_tokens=8, trace="memory")
    full, recs = _run(LLM(str(path), num_pages=5, v4_kv_rounding="fp8_ue8m0", **kw), prompts, params)
    eight, recs8 = _run(LLM(str(path), num_pages=5, kv_cache_dtype="fp8_e4m3", **kw), prompts, params)
    assert [r["preempted"] for r in recs] == [r["preempted"] for r in recs8]  # the same schedule
    reached = [q["context_len"] for r in recs8 for q in r["requests"] if q.get("state_restore_page") is not None]
    assert any(r["preempted"] for r in recs8) and any(c % 4 == 0 and c % PAGE == 0 and c for c in reached), reached
    for i in range(len(prompts)):
        _same_logprobs([full[f"r{i}"]], [eight[f"r{i}"]])
    roomy, recs_roomy = _run(LLM(str(path), num_pages=64, kv_cache_dtype="fp8_e4m3", **kw), prompts, params)
    assert not any(r["preempted"] for r in recs_roomy)
    for i in range(len(prompts)):
        assert list(roomy[f"r{i}"].outputs[0].token_ids) == list(eight[f"r{i}"].outputs[0].token_ids)


def test_attention_over_8bit_rows_within_the_derived_bound(folder, monkeypatch):
    """Every attention call of a chunked prefill and decode on the full cache without the rounding
    (transformers' numerics), captured with its queries, exact K=V rows (ring, new and compressed rows) and
    mask (the CSA selection held fixed): the layer's softmax over the rows the 8-bit cache would hold (the cache's
    quantizer) is within shared_kv_error_bound of the softmax over the exact rows, plus verify's fp32 slack.
    Then the engines' logits and greedy tokens, reported."""
    hf, path = folder
    vocab = hf.config.vocab_size
    calls = []
    original = V4Attention._attend_step_torch  # the engine's softmax over every sequence's keys, read at once

    def capture(self, q, keys, mask, queries):
        keyed = keyed_of(keys, mask, queries)  # each sequence's part (its pad columns zero rows, never visible)
        calls.append((self, q.detach().clone(), [(a, n, k.clone(), v.clone()) for a, n, k, v in keyed]))
        return original(self, q, keys, mask, queries)

    monkeypatch.setattr(V4Attention, "_attend_step_torch", capture)  # bound by the LLM made below
    ids = _ids(27, vocab, 41)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    full = LLM(str(path), page_size=PAGE, max_num_batched_tokens=7)
    out = full.generate([ids], params)[0].outputs[0]
    # the capture ran inside the steps, where a failure only fails the request: the request ran to its length
    assert out.error is None and len(out.token_ids) == 6
    monkeypatch.setattr(V4Attention, "_attend_step_torch", original)
    layers = [m for m in full.loaded.model.modules() if isinstance(m, V4Attention)]
    for attn in layers:
        attn.kernel = attn.kernel  # attend_step bound again to the plan's implementation (no more captures)
    fmt = kv_format(NOPE, ROPE)
    worst, checked = 0.0, 0
    for attn, q, keyed in calls:
        for a, n, keys, visible in keyed:
            eight = QuantizedRows.of(keys, fmt)
            slots = torch.arange(keys.shape[0])
            rows8 = eight.rows(slots)
            delta = torch.cat([eight.error(slots), torch.zeros(keys.shape[0], ROPE)], dim=-1)
            assert ((rows8 - keys).abs() <= delta).all()  # per value, the bound the attention bound starts from
            with torch.inference_mode():  # the captured tensors are inference tensors
                want = attn._attend(q[a : a + n], keys, visible)
                got = attn._attend(q[a : a + n], rows8, visible)
            bound = shared_kv_error_bound(q[a : a + n], keys, delta, visible, attn.sinks, attn.scale)
            err = (got - want).abs()
            allowed = bound + FP32_SLACK * max(1.0, want.abs().max().item())
            assert (err <= allowed).all(), f"error {err.max():.3g} beyond the bound {bound.max():.3g}"
            assert (got != want).any()  # the 8-bit rows differ: the check is not vacuous
            worst, checked = max(worst, (err / allowed).max().item()), checked + 1
    # every layer at every step: the 27-token prompt in chunks of 7 (4 steps), then 5 decode steps
    assert checked == len(calls) == len(layers) * (-(-27 // 7) + 5)
    # the whole stack: the 8-bit engine against transformers' numerics (reported; no bound is derived)
    eight = LLM(str(path), page_size=PAGE, max_num_batched_tokens=7, kv_cache_dtype="fp8_e4m3")
    a, b = hf_v4_logits(hf, ids), eight.prompt_logits(ids)
    greedy = [
        list(
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0].outputs[0].token_ids
        )
        for llm in (full, eight)
    ]
    agree = next((i for i, (x, y) in enumerate(zip(*greedy)) if x != y), 32)
    print(
        f"\n{checked} attention calls: worst |error| / bound {worst:.3f}; logits 8-bit vs transformers max abs "
        f"{(a - b).abs().max():.3g}, top-1 {(a.argmax(-1) == b.argmax(-1)).float().mean():.3f}; greedy agrees "
        f"on the first {agree} of 32 tokens"
    )


def _equal_caches(a, b, at: str) -> None:
    for j, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        for name, t in la.tensors.items():
            u = lb.tensors[name]
            parts = zip(t.tensors(), u.tensors()) if isinstance(t, QuantizedRows) else [(t, u)]
            assert all(torch.equal(x, y) for x, y in parts), f"{at}: layer {j} {name}"


def test_per_sequence_reference_over_the_8bit_ring_equals_the_batched_update(folder):
    """The plain reference state update (V4Serving(batched_state=False): each sequence's ring written through its
    slot's view, page snapshots saved between pieces with copy_) and the batched one (index_put_, snapshot rows
    from the ring read back) over the 8-bit rings: every cache part (codes, e8m0 scales, kept values) and the
    logits bitwise equal after every step of a schedule with chunks across page boundaries, a decode beside
    prefills and a prefix hit restoring a slot from an 8-bit snapshot mid CSA window."""
    from mlaserve.executor.forward_batch import SeqChunk
    from mlaserve.executor.model_runner import ModelRunner
    from mlaserve.models.deepseek_v4.serving import V4Serving

    hf, path = folder
    vocab = hf.config.vocab_size
    llm = LLM(str(path), page_size=PAGE, num_pages=24, max_num_seqs=3, kv_cache_dtype="fp8_e4m3")
    fast, ref = (ModelRunner(V4Serving(llm.loaded.model.inner, batched_state=b), llm.config) for b in (True, False))
    a = _ids(4 * PAGE + 3, vocab, 61)
    toks = {"a": a, "b": _ids(PAGE + 4, vocab, 62), "c": a[: 2 * PAGE + 1] + _ids(PAGE + 6, vocab, 63)[1:]}
    pages = {"a": list(range(0, 6)), "b": list(range(8, 12)), "c": [0, 1] + list(range(16, 20))}
    slot = {"a": 0, "b": 1, "c": 2}
    steps = [
        [("a", 2 * PAGE + 3, None), ("b", PAGE - 1, None)],  # a crosses two page boundaries and many windows
        [("b", 1, None), ("a", PAGE + 2, None)],
        [("b", 1, None), ("a", 1, None), ("c", PAGE + 4, (2 * PAGE, 1))],  # c: a hit on a's page 1 (16 tokens)
        [("a", 1, None), ("c", 1, None), ("b", 1, None)],
    ]
    done = dict.fromkeys(toks, 0)
    for i, step in enumerate(steps):
        chunks = []
        for rid, n, resume in step:
            restore = None
            if resume is not None:
                done[rid], restore = resume
            c = done[rid]
            table = tuple(pages[rid][: -(-(c + n) // PAGE)])
            ids = tuple(toks[rid][c : c + n])
            chunks.append(
                SeqChunk(
                    rid, ids, c, table, all_logits=True, state_slot=slot[rid], reset_state=c == 0, restore_page=restore
                )
            )
            done[rid] = c + n
        _, got = fast.execute(chunks)
        _, want = ref.execute(chunks)
        _equal_caches(fast, ref, f"step {i}")
        assert torch.equal(got, want), f"step {i}: logits differ"
    snap = fast.cache.layers[0].tensors["window_snapshot"]
    assert isinstance(snap, QuantizedRows) and snap.codes[1].any() and snap.codes[2].any()  # pages 1, 2 written

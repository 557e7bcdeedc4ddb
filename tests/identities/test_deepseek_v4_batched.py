"""DeepSeek-V4's batched attention (one softmax for the step's sequences over keys padded to [B, K], the engine's
path) == the per-sequence reference (one softmax per sequence) == transformers, through the engine's runner.

Bound 1e-5 max abs on logits (fp32): the two paths reduce over the same keys, the padded one with extra
masked columns (exp(-inf) = 0 joins the softmax's sum; zero-probability pad rows join probs @ keys), so only
summation order differs; measured 1.5e-6 batched vs reference and 1.7e-6 vs transformers on this config. A
defect (a sequence reading another's keys, a pad column left visible, a row scattered to the wrong token)
moves logits by 1e-2 .. 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402

BOUND = 1e-5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=3)
    folder = tmp_path_factory.mktemp("v4_batched")
    hf.save_pretrained(folder)
    return hf, LLM(str(folder), max_num_seqs=17)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _set_batched(llm: LLM, batched: bool) -> None:
    for layer in llm.runner.model.inner.model.layers:
        layer.self_attn.batched = batched


def _run(llm: LLM, steps: list[list[tuple[str, list[int], int, int]]], batched: bool) -> dict[str, torch.Tensor]:
    """steps of (request, tokens, tokens before, slot) chunks through the runner -> every request's logits rows."""
    _set_batched(llm, batched)
    ps = llm.config.cache.page_size
    rows: dict[str, list[torch.Tensor]] = {}
    try:
        for chunks in steps:
            seqs = []
            for rid, ids, done, slot in chunks:
                # each slot's request its own pages (the compressed pools are paged): 3 per slot, 64 in the cache
                table = tuple(range(slot * 3, slot * 3 + -(-(done + len(ids)) // ps)))
                assert len(table) <= 3 and slot * 3 + 3 <= llm.config.cache.num_pages
                seqs.append(
                    SeqChunk(rid, tuple(ids), done, table, all_logits=True, state_slot=slot, reset_state=done == 0)
                )
            batch, logits = llm.runner.execute(seqs)
            for (rid, _), row in zip(batch.logits_owner, logits):
                rows.setdefault(rid, []).append(row)
    finally:
        _set_batched(llm, True)
    return {rid: torch.stack(r) for rid, r in rows.items()}


def _compare(batched, reference, hf, prompts) -> None:
    for rid, got in batched.items():
        ref = reference[rid]
        err = (got - ref).abs().max().item()
        assert err <= BOUND, f"request {rid}: batched vs per-sequence max abs {err:.3g}"
        want = hf_v4_logits(hf, prompts[rid])[: got.shape[0]]
        err = (got - want).abs().max().item()
        assert err <= BOUND, f"request {rid}: batched vs transformers max abs {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"request {rid}: top-1 differs"


def test_a_mixed_step_batched_equals_the_per_sequence_reference_and_transformers(engine):
    """Prefills of 1, 4, 9 and 13 tokens in one step (different key counts: ring rows, CSA/HCA rows), then a
    step of a decode beside prefill continuations of 3 and 8 tokens (S = 8 pads the decode's query rows)."""
    hf, llm = engine
    vocab = hf.config.vocab_size
    prompts = {r: _ids(n, vocab, n) for r, n in (("a", 10), ("b", 7), ("c", 17), ("d", 13))}
    first = [("a", prompts["a"][:9], 0, 1), ("b", prompts["b"][:4], 0, 2), ("c", prompts["c"][:1], 0, 3)]
    first.append(("d", prompts["d"], 0, 4))
    second = [("a", prompts["a"][9:10], 9, 1), ("b", prompts["b"][4:7], 4, 2), ("c", prompts["c"][1:9], 1, 3)]
    steps = [first, second]
    _compare(_run(llm, steps, True), _run(llm, steps, False), hf, prompts)


def test_sixteen_decodes_in_one_step(engine):
    """16 sequences of 16 different lengths (1 .. 31 tokens: window full or not, 0 .. 7 CSA rows, 0 .. 3 HCA
    rows) prefilled, then one step of their 16 decodes: B = 16, S = 1, K the longest's keys."""
    hf, llm = engine
    vocab = hf.config.vocab_size
    lengths = [1 + 2 * i for i in range(16)]
    prompts = {f"r{i}": _ids(n + 1, vocab, 50 + n) for i, n in enumerate(lengths)}
    prefill = [(f"r{i}", prompts[f"r{i}"][:n], 0, i + 1) for i, n in enumerate(lengths)]
    decode = [(f"r{i}", prompts[f"r{i}"][n : n + 1], n, i + 1) for i, n in enumerate(lengths)]
    steps = [prefill, decode]
    _compare(_run(llm, steps, True), _run(llm, steps, False), hf, prompts)


def test_the_engine_runs_the_batched_path(engine):
    _, llm = engine
    assert llm.runner.model.batched_attention is True
    assert all(layer.self_attn.batched for layer in llm.runner.model.inner.model.layers)

"""GLM-5.3-Flash (glm5_next) past index_topk, where the pooled DSA route selects: logits == transformers 5.24's
Glm5NextForConditionalGeneration (run in float64) on the same random weights, three layer patterns
(tests/glm5_next_models.py SPARSE: KDA x3 + MLA with kpool 4 and index_topk 16; MLA first with kpool 2 and
index_topk 8; a shared indexer layer right after the full one, kpool 4, index_topk 12), 8 index heads each, prompts
of up to 101 tokens: a query keeps 4 of up to 25 complete pools plus its tail.

Bound: 1e-5 max abs against the float64 run, 100% top-1. Measured (97 tokens, budgets 1, 7 and one pass): ours
1.8e-6 .. 3.4e-6, transformers' own fp32 run 1.9e-6 .. 3.3e-6 from float64 (fp32 rounding at these sizes, logits of
magnitude ~4; the same as within index_topk, tests/models/test_glm5_next.py). The selection itself is exact: a pool
flipped at the top-k cut moves logits by 1e-2 or more. Dense attention over the same weights (attention='dense')
is 0.8 .. 3.6 away past index_topk: every test below would fail by five orders of magnitude if the route silently
ran dense, and the first test shows that dense run's distance. The ledger's pooled fields (pools scored, pools
selected, tail) are checked against what transformers' indexer keeps, query by query.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.glm5_next")

from glm5_next_models import SPARSE, float64_copy, hf_logits, random_ids, save_hf_glm5_next  # noqa: E402
from hf_models import hf_greedy  # noqa: E402
from state_engine import assert_close, model_fixture  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.sampling.params import SamplingParams  # noqa: E402

BOUND = 1e-5
N = 97


glm = model_fixture("glm", SPARSE, save_hf_glm5_next, float64_copy, seed=3)


def _selecting_from(text) -> int:
    """The first position whose query keeps fewer than all its complete pools: (k + 1) kpool - 1."""
    return (text.index_topk // text.index_kpool + 1) * text.index_kpool - 1


def test_sparse_is_the_default_and_differs_from_dense(glm):
    """attention='auto' resolves sparse (recorded with the pooled indexer); one pass == transformers; the same
    weights run dense (on purpose, recorded as such) equal it only before the first selecting query and are far
    from it after: the route really selects."""
    spec, ref, folder = glm
    text = ref.config.text_config
    llm = LLM(str(folder))
    prov = {s.name: s for s in llm.config.all_provenance()}
    assert llm.config.attention.sparse and "pooled indexer" in prov["is_sparse"].source
    ids = random_ids(N, text.vocab_size, 5)
    want = hf_logits(ref, ids)
    assert_close(llm.prompt_logits(ids), want, BOUND, f"{spec} one pass")
    with pytest.warns(UserWarning, match="attention='dense'"):
        dense = LLM(str(folder), attention="dense")
    assert not dense.config.attention.sparse
    assert "user option attention='dense'" in {s.name: s for s in dense.config.all_provenance()}["is_sparse"].source
    got = dense.prompt_logits(ids)
    cut = _selecting_from(text)
    assert_close(got[:cut], want[:cut], BOUND, f"{spec} dense before the first selecting query")
    far = (got[cut:] - want[cut:]).abs().max().item()
    assert far > 1e4 * BOUND, f"{spec}: dense is only {far:.3g} from the sparse reference past index_topk"


@pytest.mark.parametrize("budget", [1, 5, 7, 64, 512])  # 1: token by token (decode steps); 512: one pass
def test_chunked_prefill_past_index_topk_equals_transformers(glm, budget):
    """Chunks of `budget` tokens == transformers' one pass at every position of a 97-token prompt; on budgets 7 and
    512 also prompts ending around the pools and the first selecting query, each as its own prompt."""
    spec, ref, folder = glm
    text = ref.config.text_config
    llm = LLM(str(folder), max_num_batched_tokens=budget)
    cut = _selecting_from(text)
    lengths = (N,) if budget not in (7, 512) else (cut, cut + 1, cut + 2, 2 * cut + 3, 64, 65, N + 4)
    for n in lengths:
        ids = random_ids(n, text.vocab_size, n)
        assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec} length {n} budget {budget}")


def _kept_by_transformers(ref, ids: list[int]) -> list[tuple[int, int]]:
    """Per position of `ids`: (pools selected, tail tokens) of the first full indexer layer, read from what
    transformers' Glm5NextTextIndexer returns (token indices, -1 = none) in its float64 run."""
    text = ref.config.text_config
    p = text.index_kpool
    layer = next(
        i
        for i, (t, r) in enumerate(zip(text.layer_types, text.indexer_types))
        if t == "indexed_attention" and r == "full"
    )
    kept = []
    hook = ref.model.language_model.layers[layer].self_attn.indexer.register_forward_hook(
        lambda mod, args, out: kept.append(out[0])
    )
    try:
        hf_logits(ref, ids)
    finally:
        hook.remove()
    out = []
    for t, row in enumerate(kept[0].tolist()):
        tail_start = t + 1 - (t + 1) % p
        tokens = [i for i in row if i >= 0]
        out.append((len([i for i in tokens if i < tail_start]) // p, len([i for i in tokens if i >= tail_start])))
    return out


def test_the_ledger_records_pools_scored_selected_and_tail(glm):
    """Each step's record of the pooled kind: per request at its chunk's last query, pools scored = (t + 1) // kpool
    and pools selected and tail == what transformers' indexer kept at t; the step's sums == the sums over its
    queries; the selecting and the sharing layers named; the implementation the pooled sparse one."""
    spec, ref, folder = glm
    text = ref.config.text_config
    p, k = text.index_kpool, text.index_topk // text.index_kpool
    ids = random_ids(N, text.vocab_size, 5)
    want = _kept_by_transformers(ref, ids)
    llm = LLM(str(folder), max_num_batched_tokens=7, trace="memory")
    llm.prompt_logits(ids)
    records = list(llm.runner.tracer.records)
    assert len(records) == -(-N // 7)
    indexed = [i for i, t in enumerate(text.layer_types) if t == "indexed_attention"]
    sharing = [str(i) for i in indexed if text.indexer_types[i] == "shared"]
    selecting = [str(i) for i in indexed if text.indexer_types[i] == "full"]
    done = 0
    for rec in records:
        (kind,) = [x for x in rec["kinds"] if x["kind"] == "mla_dsa"]
        pooled = kind["pooled"]
        (req,) = pooled["requests"]
        n = rec["num_tokens"]
        t = done + n - 1
        assert (req["pools_scored"], req["pools_selected"], req["tail"]) == ((t + 1) // p, *want[t]), (spec, t)
        span = range(done, done + n)
        assert pooled["pools_scored"] == sum((s + 1) // p for s in span)
        assert (pooled["pools_selected"], pooled["tail"]) == tuple(map(sum, zip(*(want[s] for s in span))))
        assert pooled["new_pools"] == (done + n) // p - done // p
        assert (pooled["kpool"], pooled["pools_per_query"]) == (p, k)
        assert (pooled["selecting_layers"], pooled["sharing_layers"]) == (", ".join(selecting), ", ".join(sharing))
        assert rec["needs_selection"] == ((done + n) // p > k)
        impl = [s["implementation"] for s in rec["segments"] if s["kind"] == "mla_dsa"][0]
        assert impl.startswith("torch:pooled_sparse_absorbed")
        assert impl.endswith("(every pool within index_topk)") != rec["needs_selection"]
        done += n


def test_greedy_decode_past_index_topk_equals_transformers(glm):
    """Decode == prefill: two requests in flight (decodes batched beside the other's prefill chunks), each decode
    step selecting over pools written by earlier steps, generate transformers' greedy tokens (its full recompute)."""
    spec, ref, folder = glm
    llm = LLM(str(folder), max_num_batched_tokens=9)
    vocab = ref.config.text_config.vocab_size
    prompts = [random_ids(45, vocab, 45), random_ids(14, vocab, 14)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(ref, p, 12, hf_logits), f"{spec}: prompt of {len(p)} tokens"


@pytest.mark.parametrize("option", [dict(mla_path="decompressed"), dict(attention_backend="reference")])
def test_the_other_paths_select_the_same_rows(glm, option):
    """mla_path='decompressed' (masked MHA over Selection.as_mask) and the reference backend (its sparse_absorbed: a
    mask over the segment's keys) == transformers: both build a mask from the selection, where its unused entries,
    parked at position 0, must not unselect a selected position 0."""
    spec, ref, folder = glm
    ids = random_ids(N, ref.config.text_config.vocab_size, 5)
    llm = LLM(str(folder), max_num_batched_tokens=9, **option)
    assert_close(llm.prompt_logits(ids), hf_logits(ref, ids), BOUND, f"{spec} {option} budget 9")


def test_inspect_shows_the_route(glm, capsys):
    """`mlaserve inspect` prints the pooled route (kpool, pools kept per query, the tail; which layers reuse a
    selection) or, with attention='dense', that it runs dense and up to which context that is the same attention;
    indexer_types and num_hidden_layers listed once."""
    from mlaserve.entrypoints.cli import main

    spec, ref, folder = glm
    text = ref.config.text_config
    p, k = text.index_kpool, text.index_topk // text.index_kpool
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    route = out[out.index("attention route:") :]
    assert f"pooled DSA sparse: a query scores its complete pools of {p} tokens, keeps the top {k} " in route
    assert f"and its incomplete pool's tokens (< {p})" in route
    assert ("reuse the nearest previous selecting layer's selection" in route) == ("shared" in text.indexer_types)
    firsts = [line.split()[:1] for line in out.splitlines()]
    assert firsts.count(["indexer_types"]) == firsts.count(["num_hidden_layers"]) == 1
    assert main(["inspect", str(folder), "--attention", "dense"]) == 0
    out = capsys.readouterr().out
    assert (
        f"dense (attention='dense'): every cached row, the indexer unused; the same attention while a context is <= {text.index_topk + p - 1} tokens"
        in out
    )

"""DeepSeek-V4's attention step with every sequence's keys read at once (models/deepseek_v4/step_keys.py: the
rings, the paged pools and the CSA indexer's top-k gathered and masked with tensor ops, the engine's path)
== the plain per-sequence reference (V4Serving(batched_attention=False, batched_state=False): a Python loop over
the step's sequences reading each one's ring, pool and top-k, one softmax each) == transformers.

Two runners over the same weights, each with its own cache, take the same mixed steps: decodes beside prefills,
chunks crossing the sliding window (W 6) and the CSA (4) and HCA (8) window boundaries, sequences with no
compressed row yet, more CSA rows visible than index_topk (3) so the top-k selects; the CSA layers' sparse and
dense routes. Bound 1e-5 max abs on the logits after every step (fp32): the two read the same keys, in the same
order per sequence, and differ in summation order only (padded matmuls over extra masked columns whose
probability is exactly 0); measured <= 1.2e-6 between them in either route (7e-7 .. 1.2e-6 per step) and 1.4e-6
from transformers (sparse; the dense route moves the logits 0.54 from transformers' selection, asserted > 1e-3 so
the route is real). Broken on purpose, each fails here: the window rule off by one (0.89), the causal rule of the
compressed rows off by one (0.90), the tie fallback removed (1.35, the ties test).

Ties: torch's top-k breaks a tie between equal scores by the length of the row (measured: padding a row with
-inf changes which of several equal scores it keeps), so a padded batched top-k alone could choose other rows
than the reference's. With the indexer's query projection zeroed every score is exactly 0 (relu(0)): every
visible row ties, and the batched path must still choose the reference's rows (Indexer.choose_step redoes a
tied sequence's selection with the reference's top-k on its own shape).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from v4_models import build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402
from mlaserve.executor.model_runner import ModelRunner  # noqa: E402
from mlaserve.models.deepseek_v4.attention import V4Attention  # noqa: E402
from mlaserve.models.deepseek_v4.indexer import Indexer  # noqa: E402
from mlaserve.models.deepseek_v4.serving import V4Serving  # noqa: E402

BOUND = 1e-5

# (request, tokens this step); every request starts at 0 in its own slot and pages
STEPS = [
    [("a", 13), ("b", 2), ("c", 9)],  # a past W and two CSA windows, b no compressed row yet
    [("b", 1), ("a", 7), ("c", 1), ("d", 3)],  # decodes beside prefills; a crosses 16 (CSA and HCA close)
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 17)],  # b's first CSA row closes at its token 3
    [("e", 1), ("a", 1), ("d", 4), ("b", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],  # all decodes
]
TOTAL = {"a": 23, "b": 6, "c": 13, "d": 9, "e": 19}


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = build_hf_v4("all_kinds", seed=11)
    folder = tmp_path_factory.mktemp("v4_varlen")
    hf.save_pretrained(folder)
    return hf, LLM(str(folder), max_num_seqs=5)


def _spy(monkeypatch) -> dict[str, int]:
    """Counts of the calls that say which form ran (so a switch that is ignored fails here); `redone`: the
    reference top-k (Indexer.pick) called from inside the batched one (a tied sequence's selection redone)."""
    calls = {"_attend_step_torch": 0, "_attend": 0, "choose_step": 0, "choose": 0, "redone": 0}
    inside = []
    for owner, name in [(V4Attention, "_attend_step_torch"), (V4Attention, "_attend"), (Indexer, "choose")]:
        real = getattr(owner, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(owner, name, spy)
    real_step, real_pick = Indexer.choose_step, Indexer.pick

    def choose_step(self, *args):
        calls["choose_step"] += 1
        inside.append(True)
        try:
            return real_step(self, *args)
        finally:
            inside.pop()

    def pick(self, *args):
        calls["redone"] += bool(inside)
        return real_pick(self, *args)

    monkeypatch.setattr(Indexer, "choose_step", choose_step)
    monkeypatch.setattr(Indexer, "pick", pick)
    return calls


def _execute(runner: ModelRunner, chunks: list[SeqChunk]):
    """One step; the layers' softmax switch set to the runner's (both runners share the model's layers)."""
    layers = runner.model.inner.model.layers
    for layer in layers:
        layer.self_attn.batched = runner.model.batched_attention
        layer.self_attn.kernel = layer.self_attn.kernel  # bound again: the spies are class attributes (_spy)
    try:
        return runner.execute(chunks)
    finally:
        for layer in layers:
            layer.self_attn.batched = True


def _run(llm: LLM, dense: bool, monkeypatch) -> tuple[dict, dict, list[float], dict[str, int]]:
    """STEPS through the batched runner and the reference runner -> (tokens, logits rows per request from the
    batched runner, max abs per step, the call counts); asserts the bound after every step."""
    ps, vocab = llm.config.cache.page_size, llm.config.model.vocab_size
    inner = llm.loaded.model.inner
    fast = ModelRunner(V4Serving(inner), llm.config, v4_csa_dense=dense)
    ref = ModelRunner(V4Serving(inner, batched_attention=False, batched_state=False), llm.config, v4_csa_dense=dense)
    calls = _spy(monkeypatch)
    toks = {rid: _ids(n, vocab, seed) for seed, (rid, n) in enumerate(TOTAL.items())}
    slot = {rid: i for i, rid in enumerate(TOTAL)}
    per_page = -(-max(TOTAL.values()) // ps)
    done = dict.fromkeys(TOTAL, 0)
    rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in TOTAL}
    errs = []
    for step in STEPS:
        chunks = []
        for rid, n in step:
            c = done[rid]
            table = tuple(range(slot[rid] * per_page, slot[rid] * per_page + -(-(c + n) // ps)))
            ids = tuple(toks[rid][c : c + n])
            chunks.append(SeqChunk(rid, ids, c, table, all_logits=True, state_slot=slot[rid], reset_state=c == 0))
            done[rid] = c + n
        before = dict(calls)
        batch, got = _execute(fast, chunks)
        assert calls["_attend_step_torch"] - before["_attend_step_torch"] == 4 and calls["_attend"] == before["_attend"]
        assert calls["choose"] == before["choose"], "the batched path called the per-sequence top-k"
        before = dict(calls)
        _, want = _execute(ref, chunks)
        assert (
            calls["_attend"] - before["_attend"] == 4 * len(chunks)
            and calls["_attend_step_torch"] == before["_attend_step_torch"]
        )
        err = (got - want).abs().max().item()
        errs.append(err)
        assert err <= BOUND, f"step {len(errs)}: batched vs per-sequence reference max abs {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for (rid, _), row in zip(batch.logits_owner, got):
            rows[rid].append(row)
    assert done == TOTAL
    # the batched top-k ran in the sparse route (two CSA layers per step) and not in the dense one
    assert (calls["choose_step"] > 0) is not dense
    return toks, {rid: torch.stack(r) for rid, r in rows.items()}, errs, calls


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_batched_key_reads_equal_the_per_sequence_reference_and_transformers(v4, monkeypatch, dense):
    hf, llm = v4
    toks, rows, errs, calls = _run(llm, dense, monkeypatch)
    assert calls["redone"] == 0  # random weights: no exact tie at a cutoff
    print(f"batched vs reference per step: {[f'{e:.2g}' for e in errs]}")
    worst, moved = 0.0, 0.0
    for rid, got in rows.items():
        want = hf_v4_logits(hf, toks[rid])
        if dense:  # transformers always selects: dense moves the logits once more rows than index_topk are visible
            moved = max(moved, (got - want).abs().max().item())
            continue
        err = (got - want).abs().max().item()
        worst = max(worst, err)
        assert err <= BOUND, f"request {rid}: batched vs transformers max abs {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"request {rid}: top-1 differs"
    print(f"batched vs transformers: {worst:.2g}, dense vs transformers' selection {moved:.2g}")
    if dense:  # the sparse route asserted each request above
        assert moved > 1e-3, f"dense vs transformers' selection moved the logits only {moved:.3g}"


def test_ties_choose_the_reference_rows(tmp_path, monkeypatch):
    """Every indexer score exactly 0: every query with more than index_topk visible rows has a tie at the
    cutoff, which the batched top-k resolves as the reference does (its rows chosen: logits within the bound;
    another choice moves them by ~1e-2)."""
    hf = build_hf_v4("all_kinds", seed=11)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=5)
    csa = [layer.self_attn for layer in llm.loaded.model.inner.model.layers if layer.self_attn.kind == "csa"]
    for attn in csa:
        torch.nn.init.zeros_(attn.compressor.indexer.q_b_proj.weight)
    *_, calls = _run(llm, False, monkeypatch)
    print(f"tied sequences redone by the reference top-k: {calls['redone']}")
    assert calls["redone"] > 0

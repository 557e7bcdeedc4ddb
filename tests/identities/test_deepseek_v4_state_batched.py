"""DeepSeek-V4's batched state update (every sequence's ring writes, compressor windows, indexer keys, carries,
overlap halves and page-boundary snapshots at once: models/deepseek_v4/step_update.py, the engine's default)
== the per-sequence reference (V4Serving(batched_state=False): a loop over the step's sequences, in pieces
ending at page boundaries) bit for bit, and == transformers.

One schedule per tiny config, with the smallest legal page (the lcm of the ratios, so every boundary the config
has is a page boundary): prefills of different lengths beside decodes in one step, chunks crossing several
compression windows and page boundaries, a prefix hit restoring a slot mid CSA window, a preempted request
re-admitted from its last cached page into another request's stale slot. Two runners over the same weights,
each with its own cache, take the same steps; after every step:
  - every cache tensor (rings, carries, overlap halves, pools, every snapshot row) is bitwise equal: the batched
    form gathers the same values and pools them with the same ops (softmax over each window's slots, kv_norm
    over each row, rope per element; none reduces across windows), so there is no rounding to allow for;
  - the logits are bitwise equal (the attention reads the same keys through the same code).
At the end each request's logits at every computed position == transformers' one pass (fp32, 1e-5 as every
V4 engine test: fp32 rounding measured 0 .. 2.8e-6 through the engine; the bound leaves room above that,
while a wrong window, overlap or ring row moves logits by 1e-2 .. 1).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from v4_models import SPECS, build_hf_v4, hf_v4_logits  # noqa: E402

from mlaserve.entrypoints.llm import LLM  # noqa: E402
from mlaserve.executor.forward_batch import SeqChunk  # noqa: E402
from mlaserve.executor.model_runner import ModelRunner  # noqa: E402
from mlaserve.models.deepseek_v4.compressor import Compressor  # noqa: E402
from mlaserve.models.deepseek_v4.serving import V4Serving  # noqa: E402
from mlaserve.observability.trace import MemoryTracer  # noqa: E402

BOUND = 1e-5


@pytest.fixture(scope="module", params=list(SPECS))
def v4(request, tmp_path_factory):
    hf = build_hf_v4(request.param, seed=6)
    folder = tmp_path_factory.mktemp(f"v4_state_batched_{request.param}")
    hf.save_pretrained(folder)
    cfg = hf.config
    kinds = cfg.layer_types or []
    ratios = {cfg.compress_rates[t] for t in kinds if t in cfg.compress_rates}
    ratios = ratios or {r for r in (getattr(cfg, "compress_ratios", None) or []) if r}
    return request.param, hf, folder, math.lcm(*ratios)


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(2, vocab, (n - 1,), generator=g).tolist()


def _schedule(ps: int, vocab: int, hits: bool = True):
    """-> (every request's tokens, its block table, its first slot, the steps). A step is a list of (request,
    tokens this chunk, resume): resume None continues the request (a chunk at context 0 resets its slot), or
    (context, page, slot) starts an admission at a prefix hit: the slot restored from that page's snapshot.
    hits False (no prefix cache): those admissions recompute from token 0 instead (page None)."""
    a = _ids(4 * ps + 8, vocab, 1)
    toks = {
        "a": a,
        "b": _ids(ps + 4, vocab, 2),
        "c": a[: 2 * ps + 1] + _ids(2 * ps + 6, vocab, 3)[1:],  # shares 2 pages + 1 token with a
        "d": _ids(3 * ps + 6, vocab, 4),
        "e": _ids(6, vocab, 5),
    }
    pages = {
        "a": list(range(0, 8)),
        "b": list(range(8, 16)),
        "c": list(range(0, 2)) + list(range(16, 22)),  # a hit on a's first two pages
        "d": list(range(24, 32)),
        "e": list(range(32, 40)),
    }
    slot = {"a": 0, "b": 1, "c": 3, "d": 2, "e": 2}
    steps = [
        [("a", 2 * ps + 3, None), ("b", ps - 1, None)],  # a crosses two page boundaries and many windows
        [("b", 1, None), ("a", ps + 2, None), ("d", 2 * ps + 2, None)],  # a decode beside two prefills
        [("b", 1, None), ("d", 1, None), ("a", ps - 2, None)],  # d stops here (preempted at 2 ps + 3)
        [("b", 1, None), ("a", 1, None), ("c", ps + 4, (2 * ps, 1, 3))],  # c: hit at 2 ps on a's page 1
        [("a", 1, None), ("c", 1, None), ("d", ps + 1, (2 * ps, 25, 1))],  # d re-admitted in b's stale slot
        [("a", 1, None), ("c", 1, None), ("d", 1, None), ("e", 5, None)],  # e in d's old, stale slot
    ]
    if not hits:
        steps[3][2], steps[4][2] = ("c", 3 * ps + 4, (0, None, 3)), ("d", 3 * ps + 1, (0, None, 1))
    return toks, pages, slot, steps


def _runner(llm: LLM, batched_state: bool) -> ModelRunner:
    model = V4Serving(llm.loaded.model.inner, batched_state=batched_state)
    return ModelRunner(model, llm.config, tracer=MemoryTracer())


def _run_both(llm: LLM, what: str, vocab: int, monkeypatch) -> tuple[dict, dict, ModelRunner, ModelRunner]:
    """The schedule through a batched and a reference runner (each its own cache), asserting after every step
    that the logits and every cache tensor are bitwise equal -> (tokens, logits rows per request and position,
    the two runners)."""
    ps, hits = llm.config.cache.page_size, llm.config.cache.enable_prefix_caching
    fast, ref = _runner(llm, True), _runner(llm, False)
    assert fast.cache.keeps_snapshots == hits and ref.cache.keeps_snapshots == hits
    calls = {"close": 0, "close_step": 0}
    for name in calls:  # which form ran: counted, so a flag that is ignored fails here
        real = getattr(Compressor, name)

        def spy(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(Compressor, name, spy)

    toks, pages, slot, steps = _schedule(ps, vocab, hits)
    done = dict.fromkeys(toks, 0)
    rows: dict[str, dict[int, torch.Tensor]] = {r: {} for r in toks}
    for i, step in enumerate(steps):
        chunks = []
        for rid, n, resume in step:
            restore = None
            if resume is not None:  # a prefix hit (c on a's pages; d on its own, re-admitted after preemption)
                done[rid], restore, slot[rid] = resume
            c = done[rid]
            ids = tuple(toks[rid][c : c + n])
            assert len(ids) == n, (rid, c, n)
            table = tuple(pages[rid][: -(-(c + n) // ps)])
            chunks.append(
                SeqChunk(
                    rid,
                    ids,
                    c,
                    table,
                    all_logits=True,
                    state_slot=slot[rid],
                    reset_state=c == 0,
                    restore_page=restore,
                )
            )
            done[rid] = c + n
        before = dict(calls)
        batch, got = fast.execute(chunks)
        mid = dict(calls)
        _, want = ref.execute(chunks)
        at = f"{what} page {ps} step {i}"
        assert mid["close"] == before["close"] and mid["close_step"] > before["close_step"], at
        assert calls["close"] > mid["close"] and calls["close_step"] == mid["close_step"], at
        for j, (lf, lr) in enumerate(zip(fast.cache.layers, ref.cache.layers)):
            assert lf.tensors.keys() == lr.tensors.keys()
            for name, t in lf.tensors.items():
                diff = (t.float() - lr.tensors[name].float()).abs().max().item()
                assert torch.equal(t, lr.tensors[name]), f"{at}: layer {j} {name} differs by {diff:.3g}"
        assert torch.equal(got, want), f"{at}: logits differ by {(got - want).abs().max().item():.3g}"
        for (rid, off), row in zip(batch.logits_owner, got):
            seq = next(s for s in batch.seqs if s.request_id == rid)
            rows[rid][seq.context_len + off] = row
    return toks, rows, fast, ref


def test_the_batched_state_update_equals_the_per_sequence_reference_bitwise_and_transformers(v4, monkeypatch):
    kind, hf, folder, ps = v4
    llm = LLM(str(folder), page_size=ps, num_pages=48, max_num_seqs=4)
    toks, rows, fast, ref = _run_both(llm, kind, hf.config.vocab_size, monkeypatch)
    for rid, got_rows in rows.items():
        positions = sorted(got_rows)
        want = hf_v4_logits(hf, toks[rid][: positions[-1] + 1])[positions]
        ours = torch.stack([got_rows[p] for p in positions])
        err = (ours - want).abs().max().item()
        assert err <= BOUND, f"{kind} request {rid}: max abs {err:.3g} vs transformers > {BOUND}"
        assert torch.equal(ours.argmax(-1), want.argmax(-1)), f"{kind} request {rid}: top-1 differs"
    # the route records which form ran
    impl = {s["implementation"] for r in fast.tracer.records for s in r["segments"]}
    impl_ref = {s["implementation"] for r in ref.tracer.records for s in r["segments"]}
    assert impl == {"torch:padded_batch+batched_state"} and impl_ref == {"torch:padded_batch+per_sequence_state"}


def test_bfloat16_batched_equals_the_reference_bitwise(tmp_path, monkeypatch):
    """bf16: the cache holds bf16 rows while the gates carry the fp32 position bias, so a stored overlap gate is
    rounded to bf16. Both forms store it in the cache's dtype; with prefix caching off (no page-boundary
    pieces in the reference) they are bitwise equal after every step, preemption recomputing from token 0.
    With it on they are not, by one bf16 rounding: the reference splits its update at each page boundary, so
    the window after a boundary reads the stored (rounded) gate, while the batched form reads the unrounded one
    as one pass does (measured: 1 bf16 ulp in a pool row, 2e-2 in logits of magnitude ~2); the batched form
    equals the reference's own unsplit pass, which this test checks."""
    hf = build_hf_v4("all_kinds", seed=6)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", page_size=8, num_pages=48, max_num_seqs=4, enable_prefix_caching=False)
    assert llm.runner.cache.layers[1].tensors["kv_overlap"].dtype == torch.bfloat16
    _run_both(llm, "all_kinds bf16", hf.config.vocab_size, monkeypatch)

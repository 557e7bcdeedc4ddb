"""The static-shape decode step a CUDA graph captures (executor/padded_decode.py), on the CPU: a pure decode batch
padded to its batch bucket and context bucket gives its real rows the logits of transformers (full recompute of
each sequence) and of the eager unpadded step, leaves the pad slot a zero row, and runs without any op that needs
the host (executor/host_sync.py HostSyncGuard), on a dense model (deepseek_v3) and a DSA model (deepseek_v32 with
sequences longer than index_topk 16, so the indexer selects with fp32 scoring).

Tolerance: the padded and the eager step evaluate the same fp32 formulas; only BLAS's blocking (by row count: 4 or 8
rows instead of 3 or 5) and the softmax's reduction over a longer, masked key row differ, so they agree to fp32
rounding, not bitwise. Measured max |padded - eager| on these models: 0 (bucket 1) to 1.4e-6, and |padded -
transformers| 1.4e-6 to 2.2e-6 (logits of std ~1, |max| ~5); both are held to FP32_LOGITS_TOL (1e-5), the engine's
bound against transformers. Real rows reading every key unmasked (the pad slot's columns included) moved the logits by
0.5 to 5.2; a step that left the padding rows' writes in the pad slot failed the zero-row check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL
from hf_models import hf_logits, random_ids

from mlaserve import LLM
from mlaserve.executor.forward_batch import SeqChunk
from mlaserve.executor.host_sync import HostSyncError, HostSyncGuard
from mlaserve.executor.padded_decode import run_padded

PAGE = 8
# prompt lengths per step size: 3 sequences (bucket 4), 5 (bucket 8), 1 (bucket 1); up to 41 tokens = 6 pages
# (context bucket 8); the DSA model's sequences exceed index_topk 16
LENGTHS = {1: (23,), 3: (5, 17, 30), 5: (9, 18, 27, 36, 41)}


@pytest.fixture(scope="module", params=["v3_yarn", "v32"])
def engine(request, hf_model_dir):
    folder, hf = hf_model_dir(request.param)
    llm = LLM(str(folder), kernels="torch", attention_backend="torch", page_size=PAGE, num_pages=64)
    return request.param, llm.runner, hf


def _prefill(runner, lengths: tuple[int, ...], seed: int) -> list[tuple[str, list[int], tuple[int, ...]]]:
    """Each prompt prefilled through its own pages; -> (request id, ids incl. the next token, block table)."""
    out, page = [], 0
    for i, n in enumerate(lengths):
        ids = random_ids(n, seed=seed + i)
        pages = tuple(range(page, page + n // PAGE + 1))
        page += len(pages)
        rid = f"r{i}"
        logits = runner.execute([SeqChunk(rid, tuple(ids), 0, pages)])[1]
        out.append((rid, ids + [int(logits[-1].argmax())], pages))
    return out


def _decode_chunks(seqs) -> list[SeqChunk]:
    return [SeqChunk(rid, (ids[-1],), len(ids) - 1, pages) for rid, ids, pages in seqs]


@pytest.mark.parametrize("n", sorted(LENGTHS))
def test_padded_step_matches_eager_and_transformers(engine, n):
    kind, runner, hf = engine
    seqs = _prefill(runner, LENGTHS[n], seed=10 * n)
    chunks = _decode_chunks(seqs)
    padded, plan = runner.padded_eager(chunks)
    assert plan.bucket == {1: 1, 3: 4, 5: 8}[n] and plan.real_rows == n
    assert plan.context_pages == {1: 4, 3: 4, 5: 8}[n]  # 24, 31, 42 tokens: 3, 4, 6 pages
    pad = runner.cache.pad_slot
    assert all(not layer.latent[pad].any() for layer in runner.cache.layers), "pad slot left written"
    eager = runner.execute(chunks)[1]
    assert padded.shape == eager.shape == (n, 256)
    ref = torch.stack([hf_logits(hf, ids)[-1] for _, ids, _ in seqs])
    assert (padded - eager).abs().max() <= FP32_LOGITS_TOL
    assert (padded - ref).abs().max() <= FP32_LOGITS_TOL
    assert torch.equal(padded.argmax(-1), ref.argmax(-1))
    # the DSA route really selects (sequences > index_topk 16) with fp32 scoring; the dense one has no indexer
    assert [(s[3], s[4]) for s in plan.shape] == ([(True, "fp32")] if kind == "v32" else [(False, None)])


@pytest.fixture(scope="module", params=["v3_yarn", "v32"])
def bf16_engine(request, hf_model_dir):
    """In bf16: torch._grouped_mm's fp32 form falls back to a loop over offsets read on the host, so the experts of
    a replayed step are bf16 (the DSA model's bf16 keys: index scoring bf16_then_fp32, fp32 in the graph)."""
    folder, _ = hf_model_dir(request.param)
    llm = LLM(str(folder), kernels="torch", attention_backend="torch", page_size=PAGE, num_pages=64, dtype="bfloat16")
    return request.param, llm.runner


def test_padded_step_needs_no_host(bf16_engine):
    """The bucketed step under the guard: no .item(), nonzero, boolean-mask index, tensor made from host data or
    grouped GEMM that falls back to the host."""
    kind, runner = bf16_engine
    assert runner.graph_settings.model_blocker is None
    padded, plan = runner.padded_step(_decode_chunks(_prefill(runner, LENGTHS[3], seed=7)))
    assert plan.bucket == 4 and plan.rescored == (kind == "v32")
    with torch.inference_mode(), HostSyncGuard():
        run_padded(runner.model, runner.cache, padded)


def test_fp32_experts_are_refused_and_caught(engine):
    """fp32 routed experts: the runner's plan refuses them (naming why), and the guard catches the op."""
    _, runner, _ = engine
    assert "routed experts in float32" in runner.graph_settings.model_blocker
    padded, _ = runner.padded_step(_decode_chunks(_prefill(runner, LENGTHS[1], seed=5)))
    with pytest.raises(HostSyncError, match="_grouped_mm.*float32"):
        with torch.inference_mode(), HostSyncGuard():
            run_padded(runner.model, runner.cache, padded)


def test_guard_catches_an_inserted_item(bf16_engine, monkeypatch):
    """A deliberate .item() inside a layer makes the guarded step fail, naming the op."""
    _, runner = bf16_engine
    chunks = _decode_chunks(_prefill(runner, LENGTHS[1], seed=3))
    norm = runner.model.model.norm
    plain = norm.forward

    def reads_host(x):
        float(x.abs().max())  # a host read
        return plain(x)

    monkeypatch.setattr(norm, "forward", reads_host)
    padded, _ = runner.padded_step(chunks)
    with pytest.raises(HostSyncError, match="value read on the host"):
        with torch.inference_mode(), HostSyncGuard():
            run_padded(runner.model, runner.cache, padded)


def test_guard_catches_bool_index_and_nonzero():
    x = torch.arange(6.0)
    with pytest.raises(HostSyncError, match="boolean index"):
        with HostSyncGuard():
            x[x > 2]
    with pytest.raises(HostSyncError, match="nonzero"):
        with HostSyncGuard():
            torch.nonzero(x)
    with HostSyncGuard():  # index tensors of integers, topk, scatter: fine
        torch.topk(x, 2).indices.sort()
        x.index_select(0, torch.arange(3))

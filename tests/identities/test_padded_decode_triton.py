"""The padded decode step (executor/padded_decode.py) on the `triton` attention backend, under Triton's interpreter
on CPU: its real rows give the logits of the eager unpadded triton step and of transformers, it runs without any op
that needs the host (executor/host_sync.py HostSyncGuard), and the latent MQA's split of the key axis is the one the
graph plan records from the padded key axis (context_pages * page_size), on a dense model (deepseek_v3) and a DSA
model (deepseek_v32, sequences longer than index_topk 16: the sparse kernel and the indexer's scores run too).

What the guard sees of a kernel: the launch wrapper's torch ops (torch.empty partials, .contiguous(), views) and,
under the interpreter only, its own copies of the arguments (untyped_storage().cpu(), new_empty, set_, copy_ back:
none reads a value on the host); the kernel body runs in numpy on the tensors' memory, outside torch's dispatch.
A compiled launch has neither the copies nor the numpy work, so the guard checks what a CUDA graph would capture.

Splits: the tiny models' contexts are <= 64 keys, one split at the engine's KEYS_PER_SPLIT 512; the guard and
equality tests also run at KEYS_PER_SPLIT 16, where bucket 8's padded 64-key axis takes 2 splits (of whole 32-key
tiles), so the reduce kernel merges partials in the graph's step too. A split taken from the real lengths needs them
on the host (q_pos or seq_lens read back): the guard fails it.

Prefill: the prompts are prefilled on the `torch` backend (_prefill_on_torch): the step under test only reads the
cache rows a prefill wrote, and the interpreted prefill (~130 sparse queries on v32) took ~90 % of this file's time;
the triton backend's prefill is tests/identities/test_triton_attention.py's subject. The decode steps compared here
(padded, eager, under the guard) all run on the triton backend.

Tolerance: as tests/identities/test_padded_decode.py (FP32_LOGITS_TOL 1e-5): measured max |padded - eager| on the
triton backend 0 to 1.7e-6, |padded - transformers| 1.7e-6 to 2.4e-6 (the same at both split widths).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from conftest import FP32_LOGITS_TOL, skip_unless_triton_runs
from hf_models import hf_logits
from test_padded_decode import LENGTHS, PAGE, _decode_chunks, _prefill

from mlaserve import LLM
from mlaserve.attention.backends.triton_kernels import key_split
from mlaserve.executor.host_sync import HostSyncGuard
from mlaserve.executor.padded_decode import run_padded


def _llm(folder, dtype: str) -> LLM:
    skip_unless_triton_runs("cpu")
    return LLM(str(folder), kernels="torch", attention_backend="triton", page_size=PAGE, num_pages=64, dtype=dtype)


@contextmanager
def _torch_backend(runner):
    """The runner's steps routed to the `torch` attention backend while inside (the route reads cfg per step)."""
    cfg = runner.cfg
    runner.cfg = replace(cfg, attention=replace(cfg.attention, backend="torch"))
    try:
        yield
    finally:
        runner.cfg = cfg


def _prefill_on_torch(runner, lengths, seed):
    with _torch_backend(runner):
        return _prefill(runner, lengths, seed)


@pytest.fixture(scope="module", params=["v3_yarn", "v32"])
def engine(request, hf_model_dir):
    folder, hf = hf_model_dir(request.param)
    return request.param, _llm(folder, "float32").runner, hf


@pytest.fixture(scope="module", params=["v3_yarn", "v32"])
def bf16_engine(request, hf_model_dir):
    """bf16: the routed experts' grouped GEMM is capturable in bf16 only (test_padded_decode.py)."""
    return request.param, _llm(hf_model_dir(request.param)[0], "bfloat16").runner


# buckets 1 and 4 at the engine's split width (one split), bucket 8 at 16 (2 splits over its 64-key padded axis)
@pytest.mark.parametrize("n, keys_per_split", [(1, key_split.KEYS_PER_SPLIT), (3, key_split.KEYS_PER_SPLIT), (5, 16)])
def test_padded_triton_step_matches_eager_and_transformers(engine, n, keys_per_split, monkeypatch):
    kind, runner, hf = engine
    monkeypatch.setattr(key_split, "KEYS_PER_SPLIT", keys_per_split)
    seqs = _prefill_on_torch(runner, LENGTHS[n], seed=10 * n)
    chunks = _decode_chunks(seqs)
    assert {seg.backend for p in runner.padded_step(chunks)[0].step.route.plans for seg in p.segments} == {"triton"}
    padded, plan = runner.padded_eager(chunks)
    assert plan.bucket == {1: 1, 3: 4, 5: 8}[n] and plan.context_pages == {1: 4, 3: 4, 5: 8}[n]
    # whole 32-key tiles per split: 1 split at 512; at 16, 1 over 32 keys (4 pages), 2 over 64 (8 pages)
    assert plan.key_splits == (2 if keys_per_split == 16 and plan.context_pages == 8 else 1)
    assert plan.to_record()["key_splits"] == plan.key_splits
    eager = runner.execute(chunks)[1]
    ref = torch.stack([hf_logits(hf, ids)[-1] for _, ids, _ in seqs])
    assert (padded - eager).abs().max() <= FP32_LOGITS_TOL
    assert (padded - ref).abs().max() <= FP32_LOGITS_TOL
    assert torch.equal(padded.argmax(-1), ref.argmax(-1))
    assert [(s[3], s[4]) for s in plan.shape] == ([(True, "fp32")] if kind == "v32" else [(False, None)])


def test_padded_triton_step_needs_no_host(bf16_engine, monkeypatch):
    """The bucketed step under the guard, the triton kernels' launches included (2 splits and the reduce kernel)."""
    _, runner = bf16_engine
    monkeypatch.setattr(key_split, "KEYS_PER_SPLIT", 16)
    assert runner.graph_settings.model_blocker is None
    padded, plan = runner.padded_step(_decode_chunks(_prefill_on_torch(runner, LENGTHS[5], seed=7)))
    assert plan.replay and plan.bucket == 8 and plan.key_splits == 2
    assert {seg.backend for p in padded.step.route.plans for seg in p.segments} == {"triton"}
    with torch.inference_mode(), HostSyncGuard():
        run_padded(runner.model, runner.cache, padded)

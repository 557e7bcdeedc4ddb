"""CUDA graphs of pure decode steps (executor/cuda_graphs.py) on a GPU: per batch bucket, a replay gives the logits of
the same padded step run eagerly bit for bit (the same kernels on the same shapes; the tiny models route 2 experts per
token, so the MoE's index_add_ sums two values onto zero: order-free), and the CPU engine's within its bound; greedy
generation with graphs equals generation without them over many steps whose batch changes bucket as requests finish;
the ledger says which steps replayed, in which bucket, and why the others did not.

Models: the MoE models replay in bf16 only (torch._grouped_mm's fp32 form reads its offsets on the host: the runner
refuses it, saying so), held to the CPU's fp32 logits by test_cuda's BF16_REL_TOL; an all-dense copy of v3_yarn
(first_k_dense_replace = every layer) replays in fp32, held to FP32_LOGITS_TOL. Each on the torch attention backend,
and the dense and DSA models on the triton backend too (compiled kernels; split-K fixed per graph by its padded key
axis, recorded as key_splits; tests/identities/test_padded_decode_triton.py holds the padded triton step to the guard
and to the eager step on the CPU, under Triton's interpreter).

Skipped (saying why) where torch sees no CUDA device; `benchmarks/gpu_check.sh` runs it on a GPU. Not yet run on a
GPU: the bitwise claim is what this test is there to check.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGITS_TOL
from hf_models import make_config, random_ids, reinit_

# test_cuda.py's bound on bf16 vs fp32 logits (reasoned there), and its IEEE fp32 matmuls (an autouse fixture, so
# imported here it applies to this module's tests too)
from test_cuda import BF16_REL_TOL, _ieee_fp32_matmuls  # noqa: F401

from mlaserve import LLM, SamplingParams
from mlaserve.executor.forward_batch import SeqChunk

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA,
    reason="torch.cuda.is_available() is False: no CUDA device here (benchmarks/gpu_check.sh runs these on a GPU)",
)

PAGE = 8
LENGTHS = {1: (23,), 2: (11, 30), 3: (5, 17, 30), 5: (9, 18, 27, 36, 41)}  # buckets 1, 2, 4, 8


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    """v3_yarn with every layer dense (no routed experts): a model whose fp32 decode step is capturable."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("v3_yarn")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    reinit_(model, 0)
    folder = tmp_path_factory.mktemp("v3_dense")
    model.save_pretrained(folder)
    return folder


def _llm(folder, device: str, dtype: str = "float32", backend: str = "torch", **kw) -> LLM:
    return LLM(str(folder), device=device, dtype=dtype, attention_backend=backend, page_size=PAGE, num_pages=64, **kw)


def _prefill(runner, lengths, seed: int):
    out, page = [], 0
    for i, n in enumerate(lengths):
        ids = random_ids(n, seed=seed + i)
        pages = tuple(range(page, page + n // PAGE + 1))
        page += len(pages)
        logits = runner.execute([SeqChunk(f"r{i}", tuple(ids), 0, pages)])[1]
        out.append((f"r{i}", ids + [int(logits[-1].argmax())], pages))
    return out


def _decode_chunks(seqs):
    return [SeqChunk(rid, (ids[-1],), len(ids) - 1, pages) for rid, ids, pages in seqs]


@pytest.mark.parametrize(
    "kind, dtype, backend",
    [
        ("dense", "float32", "torch"),
        ("v3_yarn", "bfloat16", "torch"),
        ("v32", "bfloat16", "torch"),
        ("dense", "float32", "triton"),
        ("v32", "bfloat16", "triton"),
    ],
)
def test_replay_equals_eager_of_the_same_bucket(hf_model_dir, dense_folder, kind, dtype, backend):
    folder = dense_folder if kind == "dense" else hf_model_dir(kind)[0]
    gpu = _llm(folder, "cuda", dtype, backend, cuda_graphs="on", trace="memory")
    cpu = _llm(folder, "cpu", kernels="torch")
    runner = gpu.runner
    for n, lengths in LENGTHS.items():
        seqs = _prefill(runner, lengths, seed=10 * n)
        _prefill(cpu.runner, lengths, seed=10 * n)
        chunks = _decode_chunks(seqs)
        for rep in range(3):  # the first captures, the others replay
            replayed = runner.execute(chunks)[1]
            rec = runner.tracer.records[-1]["graph"]
            assert rec["replayed"] and rec["rows"] == n and rec["capture"] == (rep == 0), rec
            eager, plan = runner.padded_eager(chunks)
            assert rec["bucket"] == plan.bucket
            # triton: the key axis' split is the graph's (from its padded context), recorded
            assert rec.get("key_splits") == plan.key_splits == (None if backend == "torch" else 1), rec
            assert torch.equal(replayed, eager), f"bucket {plan.bucket} rep {rep}: {(replayed - eager).abs().max()}"
        ref = cpu.runner.execute(chunks)[1]
        if dtype == "float32":
            assert (replayed.cpu() - ref).abs().max() <= FP32_LOGITS_TOL
            assert torch.equal(replayed.argmax(-1).cpu(), ref.argmax(-1))
        else:
            assert (replayed.float().cpu() - ref).norm() / ref.norm() <= BF16_REL_TOL
    summary = runner.graphs.summary()
    assert summary["graphs"] == len(LENGTHS) and summary["capture_s"] > 0
    print(f"{kind}: captures {summary}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generation_with_graphs_equals_without(dense_folder, backend):
    """Many decode steps in a row; requests of different lengths finish, so the batch moves 5 -> ... -> 1 across
    buckets 8, 4, 2, 1; the tokens are those of the eager engine on the same GPU and backend (fp32: padding changes
    sums by ulps only)."""
    folder = dense_folder
    prompts = [random_ids(n, seed=n) for n in (5, 17, 9, 33, 12)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 14, 20, 24)]
    graphs = _llm(folder, "cuda", backend=backend, cuda_graphs="on", trace="memory")
    eager = _llm(folder, "cuda", backend=backend, cuda_graphs="off", trace="memory")
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert got == want
    recs = graphs.runner.tracer.records
    replayed = [r["graph"] for r in recs if r["graph"]["replayed"]]
    assert {g["bucket"] for g in replayed} >= {8, 4, 2, 1}
    assert all(r["graph"]["reason"].startswith("prefill") for r in recs if not r["graph"]["replayed"])
    assert all(
        not r["graph"]["replayed"] and "cuda_graphs off" in r["graph"]["reason"] for r in eager.runner.tracer.records
    )

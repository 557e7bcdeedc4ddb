"""benchmarks/kimi_linear.py times decode steps on synthetic caches (no prefill of the context). Its method holds
when the fill is a state both engines read alike: our cache filled directly (latent rows at the pool's slots,
random KDA recurrent and conv states in the slot pool's slots) and transformers' DynamicCache filled from it give
the same next-token logits, per request of a batch. And its resident-state figure is the engine's accounting:
the slot's state bytes plus the pages a request holds, checked against the widths in the model's config."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    sys.path.insert(0, str(BENCH))
    sys.modules.pop("kimi_linear", None)
    import kimi_linear

    kimi_linear.MODELS_DIR = tmp_path_factory.mktemp("models")
    yield kimi_linear
    sys.modules.pop("kimi_linear", None)
    sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def engines(bench):
    path = bench.folder("kimi_linear", quick=True)
    ours = bench.Ours(path, threads=1, n_max=80, max_batch=2, budget=16)
    prompt = bench.random_prompt(40, bench.QUICK_SHAPE["vocab_size"], seed=0)
    ours.prefill(prompt, "real")  # the scale of the synthetic KDA states: this real prefill's
    ours.measure_scales("real")
    ours.finish("real")
    return ours, bench.Theirs(path)


def test_synthetic_fill_is_the_same_state_in_both_engines(bench, engines):
    ours, theirs = engines
    assert set(ours.scales) == {0, 1, 2} and all(s > 0 for v in ours.scales.values() for s in v.values())
    n = 70  # not a page boundary; the two requests hold different rows and states
    ours.grow(2, n, seed=3)
    ref = theirs.step(theirs.cache_from(ours, 2, n), 2)
    got = ours.step(ours.chunks(2, n))
    # fp32 on a toy model: measured ~5e-8 (the logits are ~1e-2 here); 1e-5 is the suite's fp32 bound
    assert (got - ref).abs().max() < 1e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got[0] - got[1]).abs().max() > 1e-4  # the requests' states differ: a mix-up would show


def test_resident_bytes_are_the_engine_accounting(bench, engines):
    ours, _ = engines
    c = bench.QUICK_SHAPE
    h, d = c["linear_num_heads"], c["linear_head_dim"]
    state = 3 * (h * d * d * 4 + (4 - 1) * 3 * h * d * 4)  # 3 KDA layers: fp32 [H, d, d] + conv [K-1, 3 H d]
    row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4  # the one MLA layer's latent row
    for n in (1, 16, 17, 200):
        r = ours.resident(n)
        assert r["state_bytes"] == state
        assert r["total_bytes"] == state + math.ceil(n / 16) * 16 * row

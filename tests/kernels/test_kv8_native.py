"""The native paths over an 8-bit cache (kv_cache_dtype): what reads fp32 rows in place steps aside, what writes
rows goes through the cache's one quantizer, and the results equal the torch paths over the same 8-bit rows.

- The native latent write (csrc/glue.c) writes the step's fp32 rows to a buffer the cache quantizes: the codes
  equal the torch write's up to a boundary flip (the C norm's sum rounds differently), each within both rows'
  error bounds; where none flipped, the logits equal to fp32 rounding (TOL, as tests/identities/).
- The native backend's C latent MQA over 8-bit rows (mls_latent_mqa8) reads the codes where they lie and decodes
  a tile at a time: equal bit for bit to the fp32 kernel (mls_latent_mqa) over the dequantized rows, dense and
  sparse, int8 and e4m3 (the same products in the same order over the same decoded values).
- The one-call decode layers run over 8-bit rows too (the ledger says "decode_layer": "native"); on a GGUF
  fixture (ds32, DSA) the tokens equal the torch kernels'.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir
from hf_models import random_ids
from test_kv8_engine import _compare_caches

from mlaserve import LLM
from mlaserve.attention.backends import native_backend
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.row_format import latent_format
from mlaserve.kernels import native, native_indexer, native_layers
from mlaserve.sampling.params import SamplingParams

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
TOL = 1e-5


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
def test_native_write_and_backend_over_8bit_rows(hf_model_dir, codes):
    folder, _ = hf_model_dir("v32")
    ids = random_ids(30, seed=2)
    runs = {}
    for kernels in ("native", "torch"):
        llm = LLM(str(folder), quantization="int8", kernels=kernels, kv_cache_dtype=codes, page_size=4, trace="memory")
        runs[kernels] = llm, llm.prompt_logits(ids)
    (nat, a), (tor, b) = runs["native"], runs["torch"]
    assert nat.config.attention.backend == "native" and tor.config.attention.backend == "torch"
    assert {m.kernel for m in nat.loaded.model.modules() if type(m).__name__ == "MLAAttention"} == {"native"}
    flips = _compare_caches(nat, tor, len(ids))
    diff = (a - b).abs().max().item()
    print(f"{codes}: {flips} codes flipped, max |logit diff| {diff:.3g}")
    if not flips:
        assert diff <= TOL


def test_gguf_decode_layers_run_over_8bit_rows():
    """The one-call layers read 8-bit rows (csrc/decode_layer.c over mls_rows_t; they fell back to per op every
    step before): the ledger says so, and on a GGUF fixture (ds32, DSA) the tokens equal the torch kernels'.
    tests/kernels/test_decode_layer_kv8.py holds them to the per-op path."""
    path = fixture_dir("ds32") / "model-q8_0.gguf"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [random_ids(n, seed=n, vocab=64) for n in (20, 5)]
    out = {}
    for kernels in ("native", "torch"):
        llm = LLM(str(path), kernels=kernels, kv_cache_dtype="int8", trace="memory")
        out[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        recs = llm.runner.tracer.records
        want = {"native", "per_op"} if kernels == "native" else {"per_op"}  # native: decode steps; per op: prefill
        assert {r["kernels"]["decode_layer"] for r in recs} == want and {r["kv_cache"] for r in recs} == {"int8"}
    assert out["native"] == out["torch"]


@pytest.mark.parametrize("op", ["absorbed", "sparse_absorbed"])
@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
def test_c_mqa_over_8bit_rows_equals_fp32_kernel_over_dequantized_rows(codes, op, monkeypatch):
    from test_attention_backends import _case, _selection

    c = _case(0, torch.float32, "cpu")
    r, dr = c.w_uk.shape[-1], c.q_pe.shape[-1]
    eight = QuantizedRows.of(c.cache, latent_format(codes, r + dr, dr))
    dequantized = eight.rows(torch.arange(c.cache.shape[0]))
    calls = []
    real = native_layers.latent_mqa8
    monkeypatch.setattr(native_layers, "latent_mqa8", lambda *a: calls.append(1) or real(*a))
    for i, seg in enumerate(c.segments("native")):  # decode and prompt segments: the kernel takes both
        index, valid = _selection(seg, i)
        args = (c.q_nope, c.q_pe)
        if op == "absorbed":
            got = native_backend.absorbed_attention(*args, eight, c.w_uk, c.w_uv, seg, c.scale)
            want = native_backend.absorbed_attention(*args, dequantized, c.w_uk, c.w_uv, seg, c.scale)
        else:
            got = native_backend.sparse_absorbed_attention(*args, eight, c.w_uk, c.w_uv, seg, c.scale, index, valid)
            want = native_backend.sparse_absorbed_attention(
                *args, dequantized, c.w_uk, c.w_uv, seg, c.scale, index, valid
            )
        assert torch.equal(got, want)
    assert len(calls) == 2  # the 8-bit kernel ran for both segments


def test_c_topk_over_fp8_keys_equals_fp32_topk_over_dequantized_keys(monkeypatch):
    """mls_index_topk8 decodes each key where it lies: the same positions as mls_index_topk over the dequantized
    keys (torch.equal); the native backend runs it for decode segments over FP8 keys."""
    from test_attention_backends import TOPK, _case

    from mlaserve.config.row_format import index_key_format

    c = _case(1, torch.float32, "cpu")
    # keys of magnitudes 0.1x..10x: their scales differ 100-fold, so a scale dropped or taken from the wrong key
    # reorders the scores (the harness's keys are all of one magnitude)
    g = torch.Generator().manual_seed(3)
    spread = 10 ** (torch.rand(c.keys.shape[0], 1, generator=g) * 2 - 1)
    keys = QuantizedRows.of(c.keys * spread, index_key_format(c.keys.shape[1]))
    dequantized = keys.rows(torch.arange(c.keys.shape[0]))
    seg = c.segments("native", torch.float32)[0]  # the decode segment
    rows = seg.q_index[:, 0]
    # positive head weights: every score >= 0, so a key's magnitude (its scale) decides its rank
    args = (c.q_idx[rows].contiguous(), c.w[rows].abs().contiguous())
    slots, mask = seg.kv_slots.contiguous(), seg.mask[:, 0].contiguous()
    got = native_indexer.index_topk8(*args, keys, slots, mask, TOPK)
    want = native_indexer.index_topk(*args, dequantized, slots, mask, TOPK)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    calls = []
    real = native_indexer.index_topk8
    monkeypatch.setattr(native_indexer, "index_topk8", lambda *a: calls.append(1) or real(*a))
    index = native_backend.NativeBackend.index_topk(c.q_idx, c.w.abs(), keys, seg, TOPK)
    assert calls and torch.equal(index[:, 0].sort(-1).values, want[0].sort(-1).values)

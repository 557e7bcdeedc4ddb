"""The native paths over a 16-bit cache (kv_cache_dtype float16 / bfloat16, csrc/rows16.c): the C write rounds as
torch's casts do, the C readers widen the stored values exactly, so each C path equals its fp32 counterpart over
the widened rows bit for bit; the one-call decode layers run over 16-bit rows and equal the per-op path.

- mls_round16_rows (the decode layer's write) == torch's .to(float16 / bfloat16) bit for bit: random rows over
  sixteen decades (fp16 subnormals, its overflow to inf), exact ties (ties to even), signed zeros, NaN.
- mls_latent_mqa16 == mls_latent_mqa over the widened rows (torch.equal), dense and sparse (the same products in
  the same order over the same fp32 values); mls_index_topk16 == mls_index_topk over the widened keys.
- On llama.cpp's GGUF fixtures (ds3 dense MLA, ds32 DSA, sparse route), every decode step runs one call per layer
  over 16-bit rows: the same tokens as the per-op path over the same 16-bit cache, the first layer's rows the same
  bytes (the same C write of the same input), and logprobs within fp32 rounding (BOUND, as
  test_decode_layer_kv8.py) where no stored value differs.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_layer_kv8 import BOUND, _llm, _run

from mlaserve.attention.backends import native_backend
from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.row_format import index_key_format, latent_format
from mlaserve.kernels import native, native_indexer, native_layers

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
HALF = ["float16", "bfloat16"]
DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _ties(codes: str) -> torch.Tensor:
    """Values exactly half-way between two neighbours (ties go to the even one), and the edges."""
    if codes == "float16":  # spacing 2^-10 at 1, 2^-24 among subnormals; 65504 the largest, 65520 rounds to inf
        mids = [1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 65504.0 + 8, 65520.0, 2**-14 - 2**-25]
    else:  # spacing 2^-7 at 1; fp32's range
        mids = [1 + 2**-8, 1 + 3 * 2**-8, 3.0 * 2**-130, 2.0**127 * (1 + 2**-8)]
    x = torch.tensor(mids + [-m for m in mids] + [0.0, -0.0], dtype=torch.float32)
    return x.view(1, -1)


@pytest.mark.parametrize("codes", HALF)
def test_c_rounding_equals_torch_cast_bit_for_bit(codes):
    g = torch.Generator().manual_seed(0)
    decades = 10.0 ** torch.randint(-9, 7, (300, 1), generator=g).float()  # fp16: subnormals up to overflow
    x = torch.randn(300, 576, generator=g) * decades
    x[0, :7] = float("nan")
    want = x.to(DTYPE[codes])
    got = native_layers.round16_rows(x, codes)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[0, :7].isnan().all())
    finite = ~want.isnan()
    assert torch.equal(got.view(torch.int16)[finite], want.view(torch.int16)[finite])  # signed zeros, infs too
    ties = _ties(codes)
    assert torch.equal(
        native_layers.round16_rows(ties, codes).view(torch.int16), ties.to(DTYPE[codes]).view(torch.int16)
    )


@pytest.mark.parametrize("op", ["absorbed", "sparse_absorbed"])
@pytest.mark.parametrize("codes", HALF)
def test_c_mqa_over_16bit_rows_equals_fp32_kernel_over_widened_rows(codes, op, monkeypatch):
    from test_attention_backends import _case, _selection

    c = _case(0, torch.float32, "cpu")
    r, dr = c.w_uk.shape[-1], c.q_pe.shape[-1]
    half = QuantizedRows.of(c.cache, latent_format(codes, r + dr, dr))
    widened = half.rows(torch.arange(c.cache.shape[0]))
    assert torch.equal(widened, c.cache.to(DTYPE[codes]).float()) and not torch.equal(widened, c.cache)
    calls = []
    real = native_layers.latent_mqa16
    monkeypatch.setattr(native_layers, "latent_mqa16", lambda *a: calls.append(1) or real(*a))
    for i, seg in enumerate(c.segments("native")):  # decode and prompt segments: the kernel takes both
        index, valid = _selection(seg, i)
        args = (c.q_nope, c.q_pe)
        if op == "absorbed":
            got = native_backend.absorbed_attention(*args, half, c.w_uk, c.w_uv, seg, c.scale)
            want = native_backend.absorbed_attention(*args, widened, c.w_uk, c.w_uv, seg, c.scale)
        else:
            got = native_backend.sparse_absorbed_attention(*args, half, c.w_uk, c.w_uv, seg, c.scale, index, valid)
            want = native_backend.sparse_absorbed_attention(*args, widened, c.w_uk, c.w_uv, seg, c.scale, index, valid)
        assert torch.equal(got, want)
    assert len(calls) == 2  # the 16-bit kernel ran for both segments


@pytest.mark.parametrize("codes", HALF)
def test_c_topk_over_16bit_keys_equals_fp32_topk_over_widened_keys(codes, monkeypatch):
    from test_attention_backends import TOPK, _case

    c = _case(1, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    spread = 10 ** (torch.rand(c.keys.shape[0], 1, generator=g) * 2 - 1)  # keys of 0.1x..10x magnitude
    keys = QuantizedRows.of(c.keys * spread, index_key_format(c.keys.shape[1], codes))
    assert keys.fmt.half and keys.codes.dtype == DTYPE[codes]
    widened = keys.rows(torch.arange(c.keys.shape[0]))
    seg = c.segments("native", torch.float32)[0]  # the decode segment
    rows = seg.q_index[:, 0]
    args = (c.q_idx[rows].contiguous(), c.w[rows].abs().contiguous())
    slots, mask = seg.kv_slots.contiguous(), seg.mask[:, 0].contiguous()
    got = native_indexer.index_topk16(*args, keys, slots, mask, TOPK)
    want = native_indexer.index_topk(*args, widened, slots, mask, TOPK)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    calls = []
    real = native_indexer.index_topk16
    monkeypatch.setattr(native_indexer, "index_topk16", lambda *a: calls.append(1) or real(*a))
    index = native_backend.NativeBackend.index_topk(c.q_idx, c.w.abs(), keys, seg, TOPK)
    assert calls and torch.equal(index[:, 0].sort(-1).values, want[0].sort(-1).values)


def _half_states(llm) -> list[torch.Tensor]:
    return [s.codes.clone() for name in ("latent", "index_keys") for s in llm.runner.cache.state(name) if s is not None]


@pytest.mark.parametrize("name,codes,attention", [("ds3", "float16", "auto"), ("ds3", "bfloat16", "auto"),
                                                  ("ds32", "float16", "sparse")])  # fmt: skip
def test_one_call_layers_over_16bit_rows_equal_the_per_op_path(name, codes, attention, monkeypatch):
    llm = _llm(name, "q8_0", kv_cache_dtype=codes, attention=attention)
    model = llm.runner.model
    n = len(model.model.layers)
    assert all(layer.native_layer is not None for layer in model.model.layers) and model.native_decode is not None
    tok_a, lp_a, calls = _run(llm, monkeypatch)
    recs = llm.runner.tracer.records
    assert calls == 9 * n  # 9 decode steps after the prompts' step, every layer one call each
    assert "native" in {r["kernels"]["decode_layer"] for r in recs} and {r["kv_cache"] for r in recs} == {codes}
    fused = _half_states(llm)
    assert all(s.dtype == DTYPE[codes] for s in fused) and (name != "ds32" or len(fused) == 2 * n)
    llm = _llm(name, "q8_0", kv_cache_dtype=codes, attention=attention)
    llm.runner.model.native_decode = None
    tok_b, lp_b, calls_b = _run(llm, monkeypatch)
    assert calls_b == 0 and tok_a == tok_b
    per_op = _half_states(llm)
    assert torch.equal(fused[0], per_op[0])  # layer 0: the same input, the same rounding, the same bytes
    per_layer = [int((a != b).sum()) for a, b in zip(fused, per_op)]
    flips = sum(per_layer)
    written = sum(int((a != 0).any(-1).sum()) * a.shape[1] for a in fused)
    worst = max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb))
    print(
        f"{name} {codes}: one call vs per op over 16-bit rows, max |dlogprob| {worst:.2e}, {flips} of {written} "
        f"differ (per state {per_layer})"
    )
    # The later layers' inputs differ by fp32 rounding (the two paths' own orders), so a value within that noise of
    # a rounding midpoint lands on the neighbouring 16-bit code. In the first state that differs at all, those
    # crossings are independent: each one code apart, and rare. How rare: over fp32 rows the two paths' latent
    # values differ by 3-7e-7 relative on average (max 3e-4), which crosses a float16 midpoint at an expected
    # 4.4-9.8e-4 of the values (|delta| / the grid's spacing at each value, both fixtures' layers), bfloat16 at
    # 0.6-1.2e-4; so at most 3e-3 of a state's values (a state holds ~4,700: an expected <= 4.6 crossings, and
    # 14 or more come by chance ~2e-4 of the time; a wrong value is not one code off). A crossing then
    # moves the later layers' inputs by a 16-bit step, not by fp32 noise, and their rows differ in a cascade
    # (measured: 2 crossings in ds3 float16's second layer, 29 values of its third, up to 27 codes apart near 0),
    # so only the first differing state is held to that rule, and the logprobs to 1e-3 (the cascade measured
    # 1.2e-4; a wrong row, scale or selection moves them by >= 1e-2).
    first = next((i for i, f in enumerate(per_layer) if f), None)
    if first is not None:
        a, b = fused[first], per_op[first]
        d = a != b
        steps = (a.view(torch.int16)[d].int() - b.view(torch.int16)[d].int()).abs()
        assert (steps == 1).all(), (first, steps.max())
        assert per_layer[first] <= 3e-3 * int((a != 0).any(-1).sum()) * a.shape[1], (first, per_layer)
        assert worst <= 1e-3, worst
    else:
        assert worst <= BOUND, worst


def test_a_16bit_kind_the_call_cannot_read_is_refused_by_name():
    import ctypes

    llm = _llm("ds3", "q8_0", kv_cache_dtype="float16")
    layer = llm.runner.model.model.layers[0].native_layer
    bad = native_layers.rows_of(llm.runner.cache.state("latent")[0])
    assert bad.half == 1 and not bad.rows
    bad.half = 3
    step = native_layers.DecodeStepArgs(0)
    x = torch.zeros(0, layer.args.d)
    rc = native.library().mls_decode_layer(
        ctypes.byref(layer.args), ctypes.byref(step), x.data_ptr(), x.data_ptr(), ctypes.byref(bad), None, 1
    )
    assert rc == -6 and "16-bit rows" in native_layers.LAYER_ERRORS[rc]

"""The one-call decode layer (csrc/decode_layer.c) over an 8-bit cache (kv_cache_dtype): the layer writes the
step's rows through the C quantizer (csrc/rows8.c) and reads the codes in place (mls_latent_mqa8, and
mls_index_topk8 over FP8 index keys on DSA models), held to the per-op path over the same 8-bit cache.

- The C quantizer equals cache/quantized_rows.quantize bit for bit: random rows over twelve decades, exact
  ties (int8 halves, e4m3 mantissa and subnormal midpoints), zero rows (the AMAX_FLOOR scale), NaN blocks.
- On llama.cpp's GGUF fixtures (../shared/fixtures/: ds3 dense MLA, ds32 DSA with a sparse route), every decode
  step runs as one call per layer over 8-bit rows, and against the same engine with every layer per op: the
  same tokens; the same cache bytes in the first layer (the latent rows come from the same C write) and in the
  others scales within fp32 rounding with at most 1 code in 1,000 across a boundary (their inputs differ by the
  MoE block's rounding; the index keys' LayerNorm is torch's per op, C's in the call); logprobs within fp32
  rounding, BOUND, as tests/kernels/test_decode_layer_sparse.py derives it, where no code flipped.
The 8-bit-vs-full-cache bound (attention/cache_error.py) holds the per-op path (tests/identities/
test_kv8_attention.py, `verify`); the one call is held to that path here, so it inherits it.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import fixture_dir

from mlaserve import LLM
from mlaserve.cache.quantized_rows import QuantizedRows, quantize
from mlaserve.config.row_format import RowFormat
from mlaserve.kernels import native, native_layers
from mlaserve.sampling.params import SamplingParams

NATIVE = native.status()
pytestmark = pytest.mark.skipif(not NATIVE.available, reason=f"native kernels unavailable: {NATIVE.detail}")
# fp32 rounding bound on |dlogprob| between the two paths: measured <= 1.43e-6 here (logprobs of magnitude ~5,
# ulp 4.8e-7), as test_decode_layer_sparse.py's 1.7e-6; a wrong row, scale or selection moves them by >= 1e-2
BOUND = 1e-5
PROMPTS = [[5, 9, 2, 7] * 6, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9] * 2]


def _ties(codes: str) -> torch.Tensor:
    """A [2, 128] block whose amax gives scale 1 exactly (y = x): values on the codes' midpoints."""
    if codes == "int8":
        mids = [0.5, 1.5, 2.5, -0.5, -3.5, 126.5, 100.5, -126.5]
        top = 127.0
    else:  # e4m3: mantissa midpoints (1 + 1/16 -> 1, 1 + 3/16 -> 1.25), subnormal ones (k + 1/2) 2^-9, the edge
        mids = [1.0625, 1.1875, -3.375, 0.5 * 2**-9, 1.5 * 2**-9, 7.5 * 2**-9, 2**-6 - 2**-12, 432.0]
        top = 448.0
    x = torch.zeros(2, 128)
    x[:, 0] = top
    x[0, 1 : 1 + len(mids)] = torch.tensor(mids)
    x[1, 1 : 1 + len(mids)] = -torch.tensor(mids)
    return x


@pytest.mark.parametrize("codes", ["int8", "fp8_e4m3"])
def test_c_quantizer_equals_the_torch_quantizer_bit_for_bit(codes):
    g = torch.Generator().manual_seed(0)
    decades = 10.0 ** torch.randint(-8, 4, (600, 1), generator=g).float()
    x = torch.randn(600, 256, generator=g) * decades
    x[0] = 0.0  # every value under AMAX_FLOOR: the floor's scale, zero codes
    x[1, :128] = float("nan")  # a NaN block reads back NaN; the other block of the row is untouched
    x[2] = torch.randn(256, generator=g) * 1e-6  # amax under the floor
    x = torch.cat([x, _ties(codes).repeat(1, 2)])
    fmt = RowFormat(codes, 256, 128)
    want_codes, want_scales = quantize(x, fmt)
    got_codes, got_scales = native_layers.quantize_rows(x, 128, codes == "fp8_e4m3")
    assert torch.equal(got_codes, want_codes)
    assert torch.equal(got_scales.isnan(), want_scales.isnan()) and got_scales[1, 0].isnan()
    finite = ~want_scales.isnan()
    assert torch.equal(got_scales[finite], want_scales[finite])
    ties = got_codes[-2:, 1:9]
    assert torch.equal(ties, want_codes[-2:, 1:9])  # the midpoints, ties to even as torch's


def _llm(name: str, gtype: str, **kw) -> LLM:
    path = fixture_dir(name) / f"model-{gtype}.gguf"
    if not path.exists():
        pytest.skip(f"../shared/fixtures/{name} has no {gtype} file")
    return LLM(str(path), kernels="native", enable_prefix_caching=False, trace="memory", **kw)


def _run(llm: LLM, monkeypatch) -> tuple[list, list, int]:
    calls = []
    real, real_stack = native_layers.decode_layer, native_layers.decode_layers
    monkeypatch.setattr(native_layers, "decode_layer", lambda *a: calls.append(1) or real(*a))
    # the layers' calls in one (GGUFDecodeStack): one per layer
    monkeypatch.setattr(native_layers, "decode_layers", lambda s, *a: calls.extend([1] * s.n) or real_stack(s, *a))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    monkeypatch.setattr(native_layers, "decode_layer", real)
    monkeypatch.setattr(native_layers, "decode_layers", real_stack)
    return [o.token_ids for o in outs], [[sorted(s.values()) for s in o.logprobs] for o in outs], len(calls)


def _states(llm: LLM) -> list[tuple[torch.Tensor, ...]]:
    """Every 8-bit state's tensors (codes, scales, kept), cloned."""
    out = []
    for name in ("latent", "index_keys"):
        for s in llm.runner.cache.state(name):
            if isinstance(s, QuantizedRows):
                out.append(tuple(t.clone() for t in s.tensors()))
    return out


@pytest.mark.parametrize(
    "name,codes,attention",
    [("ds3", "int8", "auto"), ("ds3", "fp8_e4m3", "auto"), ("ds32", "int8", "sparse"), ("ds32", "fp8_e4m3", "sparse")],
)
def test_one_call_layers_over_8bit_rows_equal_the_per_op_path(name, codes, attention, monkeypatch):
    llm = _llm(name, "q8_0", kv_cache_dtype=codes, attention=attention)
    model = llm.runner.model
    n = len(model.model.layers)
    assert all(layer.native_layer is not None for layer in model.model.layers) and model.native_decode is not None
    tok_a, lp_a, calls = _run(llm, monkeypatch)
    recs = llm.runner.tracer.records
    assert calls == 9 * n  # 9 decode steps after the prompts' step, every layer one call each
    assert "native" in {r["kernels"]["decode_layer"] for r in recs} and {r["kv_cache"] for r in recs} == {codes}
    fused_states = _states(llm)
    assert fused_states and (name != "ds32" or len(fused_states) == 2 * n)  # DSA: the index keys are 8-bit too
    # a fresh engine for the per-op run: the same requests on an empty pool take the same slots
    llm = _llm(name, "q8_0", kv_cache_dtype=codes, attention=attention)
    llm.runner.model.native_decode = None
    tok_b, lp_b, calls_b = _run(llm, monkeypatch)
    assert calls_b == 0 and tok_a == tok_b
    per_op_states = _states(llm)
    # layer 0's latent rows: the same input and the same C write both ways, so the same bytes. The later layers'
    # inputs differ by fp32 rounding (the MoE block's own differences, moe/block.c), the index keys' LayerNorm is
    # torch's per op and C's here: scales and k_pe within fp32 rounding (measured <= 1 ulp-ish: 7e-9 abs on scales
    # ~1e-2, 1e-6 on k_pe ~1), a code may round across a boundary (each side within its row's error bound)
    assert all(torch.equal(x, y) for x, y in zip(fused_states[0], per_op_states[0]))
    flips = 0
    for a, b in zip(fused_states, per_op_states):
        flips += int((a[0] != b[0]).sum())
        for x, y in zip(a[1:], b[1:]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    worst = max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for sa, sb in zip(ra, rb) for x, y in zip(sa, sb))
    print(f"{name} {codes}: one call vs per op over 8-bit rows, max |dlogprob| {worst:.2e}, {flips} codes flipped")
    written = sum(int((a[1] != 0).any(-1).sum()) * a[0].shape[1] for a in fused_states)  # codes of written rows
    assert flips <= 1e-3 * written, (flips, written)  # at most 1 code in 1,000 (tests/identities/test_kv8_*)
    if not flips:
        assert worst <= BOUND, worst


def test_a_layout_the_call_cannot_read_is_refused_by_name():
    """8-bit rows whose block does not divide the latent rank: refused (-6) with the reason, nothing written."""
    llm = _llm("ds3", "q8_0", kv_cache_dtype="int8")
    layer = llm.runner.model.model.layers[0].native_layer
    state = llm.runner.cache.state("latent")[0]
    bad = native_layers.rows_of(state)
    bad.block = 7
    step = native_layers.DecodeStepArgs(0)
    x = torch.zeros(0, layer.args.d)
    out = torch.empty(0, layer.args.d)
    rc = native.library().mls_decode_layer(
        ctypes.byref(layer.args), ctypes.byref(step), x.data_ptr(), out.data_ptr(), ctypes.byref(bad), None, 1
    )
    assert rc == -6 and "8-bit rows" in native_layers.LAYER_ERRORS[rc]


def test_c_reads_every_e4m3_code_as_torch_does():
    """The C kernels decode e4m3 codes 8 at a time (attention.c e4m3_scaled, bit tricks instead of the table):
    every finite code (subnormals and -0 included), read through mls_latent_mqa8 over one row (the softmax over
    one key is 1, so the output is the decoded row), equals torch's float8_e4m3fn -> fp32 times the scale."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0x00, 0x80], dtype=torch.uint8)  # 256
    fmt = RowFormat("fp8_e4m3", 256, 128, 0)
    rows = QuantizedRows(fmt, 2, torch.float32, "cpu", lambda n, w, dt, dev: torch.zeros(n, w, dtype=dt))
    rows.codes[0] = codes
    rows.scales[0] = torch.tensor([0.75, 3.0])
    want = codes.view(torch.float8_e4m3fn).float().view(2, 128) * rows.scales[0, :, None]
    q_lat, q_pe = torch.randn(1, 1, 256), torch.zeros(1, 1, 0)
    index = torch.zeros(1, 1, dtype=torch.int64)
    got = native_layers.latent_mqa8(q_lat, q_pe, index, rows, index, torch.ones(1, 1, 1, dtype=torch.bool), 1.0)
    assert torch.equal(got.view(2, 128), want)
    rows.codes[0, 200] = 0x7F  # e4m3fn's NaN code: NaN, as the table and torch read it, so the output is NaN
    assert (
        native_layers.latent_mqa8(q_lat, q_pe, index, rows, index, torch.ones(1, 1, 1, dtype=torch.bool), 1.0)
        .isnan()
        .all()
    )

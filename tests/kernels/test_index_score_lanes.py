"""The DSA index scores with the heads along the vector lanes (kernels/csrc/index_score.c), the decode top-k's
scoring where the build has AVX-512 and Hi is a multiple of 16 (at most 64):

- the AVX-512 form equals the scalar form bit for bit (the same FMA chain per head, the same 16-lane tree);
- both are within the fp32 bound derived below of a float64 reference, over fp32 keys and FP8 e4m3 keys;
- FP8 keys scored where they lie equal their dequantized fp32 rows scored (the decode is cache/quantized_rows'
  dequantizer, one rounding);
- the C top-k (mls_index_topk / mls_index_topk8) keeps the top-k of exactly these scores, which is the float64
  reference's top-k up to keys whose reference scores lie within twice the bound of the k-th; its agreement
  with the per-op path's torch top-k is reported.

The bound (u = 2^-24, gamma_n = n u / (1 - n u)): per head the FMA chain over Di products is off by at most
e_h = gamma_Di sum_d |q_hd k_d|, which ReLU does not grow; the head weights' products and the sums (ng - 1 FMAs
across the Hi / 16 groups, then a 4-level tree over 16 lanes) add at most gamma_(ng + 5) sum_h |w_h| (ReLU(s_h)
+ e_h). So |score - reference| <= sum_h |w_h| e_h + gamma_(ng + 5) sum_h |w_h| (ReLU(s_h) + e_h), per key.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.cache.quantized_rows import QuantizedRows
from mlaserve.config.row_format import index_key_format
from mlaserve.kernels import native, native_layers

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native kernels are not built")

U = 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _case(hi: int, di: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hi, di, generator=g)
    w = torch.randn(hi, generator=g) * (hi * di) ** -0.5
    # keys of magnitudes 0.1x..10x: the FP8 scales differ 100-fold, so a scale dropped or misread reorders scores
    keys = torch.randn(n, di, generator=g) * 10 ** (torch.rand(n, 1, generator=g) * 2 - 1)
    return q, w, keys


def _reference_and_bound(q, w, keys):
    """float64 scores and the per-key bound of the notation block."""
    qd, wd, kd = q.double(), w.double(), keys.double()
    s = kd @ qd.T  # [n, Hi]
    e = _gamma(q.shape[1]) * (kd.abs() @ qd.abs().T)
    ref = (s.relu() * wd).sum(1)
    ng = q.shape[0] // 16
    bound = (wd.abs() * e).sum(1) + _gamma(ng + 5) * (wd.abs() * (s.relu() + e)).sum(1)
    return ref, bound


@pytest.mark.parametrize("hi", [16, 32, 64])
@pytest.mark.parametrize("di", [128, 72])
def test_simd_equals_scalar_and_both_within_the_fp32_bound(hi, di):
    q, w, keys = _case(hi, di, 203, seed=hi + di)  # 203 keys: the last group of 4 is partial
    simd, ran = native_layers.index_scores(q, w, keys)
    scalar, ran_scalar = native_layers.index_scores(q, w, keys, simd=False)
    assert not ran_scalar
    if native.isa() == "avx512":
        assert ran  # the SIMD form is what ran
    assert torch.equal(simd, scalar)
    ref, bound = _reference_and_bound(q, w, keys)
    err = (simd.double() - ref).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3g}"
    # measured: the worst key uses ~1-10% of its bound (the bound assumes every rounding at its worst)
    assert (err / bound).max().item() > 0  # the comparison is live: fp32 arithmetic does round somewhere


@pytest.mark.parametrize("hi", [32, 64])
def test_fp8_keys_scored_in_place_equal_their_dequantized_rows(hi):
    q, w, keys = _case(hi, 128, 150, seed=7)
    fp8 = QuantizedRows.of(keys, index_key_format(128))
    dequantized = fp8.rows(torch.arange(150)).contiguous()
    got, _ = native_layers.index_scores(q, w, fp8)
    assert torch.equal(got, native_layers.index_scores(q, w, dequantized)[0])
    assert torch.equal(got, native_layers.index_scores(q, w, fp8, simd=False)[0])
    ref, bound = _reference_and_bound(q, w, dequantized)
    assert ((got.double() - ref).abs() <= bound).all()


def test_a_head_count_the_kernel_does_not_take_is_refused():
    q, w, keys = _case(16, 128, 4, seed=1)
    with pytest.raises(ValueError, match="24 heads"):
        native_layers.index_scores(torch.randn(24, 128), torch.randn(24), keys)


@pytest.mark.parametrize("fp8", [False, True])
def test_topk_keeps_the_reference_top_k_up_to_the_bound(fp8):
    """A decode step's top-k (4 requests of 3000 keys, k = 256, 32 heads as the DSA models) over fp32 or FP8 keys:
    exactly the top-k of the lanes scores, and the float64 reference's top-k but for keys within twice the bound
    of the k-th reference score; the agreement with torch's fp32 top-k (the per-op path) is printed."""
    from test_decode_layer_sparse import _torch_topk

    hi, di, k, lengths = 32, 128, 256, [3000, 2990, 2500, 3000]
    t, s = len(lengths), sum(lengths) + 1
    g = torch.Generator().manual_seed(11)
    q = torch.randn(t, hi, di, generator=g)
    w = torch.randn(t, hi, generator=g) * (hi * di) ** -0.5
    keys = torch.randn(s, di, generator=g)
    length = max(lengths)
    kv_slots = torch.full((t, length), s - 1, dtype=torch.int64)
    mask = torch.zeros(t, length, dtype=torch.bool)
    for b, n in enumerate(lengths):
        kv_slots[b, :n] = torch.randperm(s - 1, generator=g)[:n]
        mask[b, :n] = True
    if fp8:
        stored = QuantizedRows.of(keys, index_key_format(di))
        keys = stored.rows(torch.arange(s)).contiguous()  # what the scores are of: the dequantized keys
        idx, val = native_layers.index_topk8(q, w, stored, kv_slots, mask, k)
    else:
        idx, val = native_layers.index_topk(q, w, keys, kv_slots, mask, k)
    idx_t, val_t = _torch_topk(q, w, keys, kv_slots, mask, k)
    overlap = []
    for b, n in enumerate(lengths):
        rows = keys[kv_slots[b, :n]].contiguous()
        lanes, _ = native_layers.index_scores(q[b].contiguous(), w[b].contiguous(), rows)
        got = set(idx[b][val[b]].tolist())
        assert got == set(lanes.topk(k).indices.tolist())  # the top-k of exactly these scores
        ref, bound = _reference_and_bound(q[b], w[b], rows)
        kth = ref.topk(k).values[-1].item()
        slack = 2 * bound.max().item()
        sure = set((ref > kth + slack).nonzero().flatten().tolist())  # must be kept
        never = set((ref < kth - slack).nonzero().flatten().tolist())  # must not be
        assert sure <= got and not (never & got)
        overlap.append(len(got & set(idx_t[b][val_t[b]].tolist())) / k)
    print(f"top-k agreement with torch's fp32 scoring per request: {overlap}")
    assert min(overlap) >= 0.99  # near-ties aside (none expected at fp32 with these gaps), the same sets

"""The row ladder of bf16 prefill (kernels.bf16_prefill.bucket_rows): every bf16 GEMM's row count, the grouped
experts' groups and the dense linears' steps alike, is padded to a rung, so the row counts a process meets (and
the oneDNN primitives it keeps, one per row count and weight shape) grow with the log of the rows, while the
padding stays under a quarter of the rows (at most 31 rows below LADDER_FINE); the padded rows change no real
row beyond one bf16 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.kernels import bf16_prefill
from mlaserve.kernels.bf16_prefill import LADDER_FINE, LADDER_STEPS, ROW_BUCKET, bucket_rows, bucket_rows_tensor


def test_the_ladder_has_few_rungs_and_pads_little():
    """Break check: multiples of ROW_BUCKET all the way (the previous rule) give 128 rungs up to 4,096 rows."""
    rows = range(4097)
    rungs = {bucket_rows(r) for r in rows}
    # 0 and the multiples of 32 up to 128, then LADDER_STEPS per octave: (128, 256], ..., (2048, 4096]
    assert len(rungs) == 1 + LADDER_FINE // ROW_BUCKET + LADDER_STEPS * 5, sorted(rungs)
    for r in rows:
        b = bucket_rows(r)
        assert r <= b and b - r <= max(ROW_BUCKET - 1, r // LADDER_STEPS), (r, b)
    assert bucket_rows(2048) == 2048 and bucket_rows(512) == 512  # the usual step sizes pad nothing


def test_the_tensor_form_agrees_with_the_scalar_form():
    rows = torch.arange(70000, dtype=torch.int64)
    want = torch.tensor([bucket_rows(int(r)) for r in rows])
    assert torch.equal(bucket_rows_tensor(rows), want)


def test_a_dense_bf16_linear_runs_at_the_rung_and_keeps_its_rows(monkeypatch):
    """Break check: without the padding the GEMM sees 300 rows; the real rows' outputs within one bf16 rounding
    of the unpadded GEMM (both are bf16 roundings of fp32 sums of the same products, perhaps ordered differently)."""
    g = torch.Generator().manual_seed(2)
    m, k, n = 300, 64, 40
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16)
    seen, real = [], F.linear

    def spy(a, b, *rest):
        seen.append(a.shape[0])
        return real(a, b, *rest)

    monkeypatch.setattr(bf16_prefill.F, "linear", spy)
    got = bf16_prefill.linear(x, w)
    monkeypatch.setattr(bf16_prefill.F, "linear", real)
    assert seen == [bucket_rows(m)] == [320]
    assert got.shape == (m, n) and got.dtype == torch.float32
    want = F.linear(x.to(torch.bfloat16), w).float()
    u = 2**-8
    mags = x.abs().to(torch.bfloat16).float() @ w.float().abs().T
    bound = 2 * u * want.abs() + 2 * k * 2**-24 * (1 + u) * mags
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()

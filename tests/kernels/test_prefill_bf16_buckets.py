"""The bf16 grouped GEMM pads every group's rows to a multiple of ROW_BUCKET (oneDNN keeps a primitive per
distinct row count: a prefill's experts of every size grew the process by ~0.4 GiB), and the padding changes no
real row beyond bf16's rounding: the products equal per-group bf16 GEMMs of the unpadded rows within one bf16
rounding of the output (torch returns bf16; a row's sum may be ordered differently at another row count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.kernels import bf16_prefill

SIZES = [1, 5, 31, 32, 33, 0, 70]  # rows per expert: below, at and above a bucket, an expert with no rows


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, n = 64, 48
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    xs = torch.randn(int(offs[-1]), k, generator=g)
    ws = torch.randn(len(SIZES), n, k, generator=g).to(torch.bfloat16)
    return xs, ws, offs


def test_every_group_reaches_the_gemm_padded_to_a_bucket(monkeypatch):
    seen = []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    bf16_prefill.grouped(*_operands())
    (counts,) = seen
    assert all(c % bf16_prefill.ROW_BUCKET == 0 for c in counts), counts
    assert counts == [(s + 31) // 32 * 32 for s in SIZES]


def test_padding_changes_no_real_row_beyond_one_bf16_rounding():
    xs, ws, offs = _operands(1)
    got = bf16_prefill.grouped(xs, ws, offs)
    ends = [0, *offs.tolist()]
    want = torch.cat(
        [F.linear(xs[a:b].to(torch.bfloat16), ws[i]).float() for i, (a, b) in enumerate(zip(ends, ends[1:]))]
    )
    # both are bf16 roundings (u = 2^-8, the module's notation) of fp32 sums of the same bf16 products, perhaps
    # ordered differently: |got - want| <= 2u |want| + 2 (K 2^-24)(1 + u) sum_k |x_k| |W_k|
    u, k = 2**-8, xs.shape[1]
    mags = torch.cat(
        [
            xs[a:b].abs().to(torch.bfloat16).float() @ ws[i].float().abs().T
            for i, (a, b) in enumerate(zip(ends, ends[1:]))
        ]
    )
    bound = 2 * u * want.abs() + 2 * k * 2**-24 * (1 + u) * mags
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()

"""A prefill's decoded expert weights stay under ggml.EXPERT_BYTES at a time (the cap on that temporary, which
sets much of a prefill's peak memory), with the products of one uncapped call."""

from __future__ import annotations

import pytest
import torch

from mlaserve.gguf.convert.writer import quantize_q8_0
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native, panels

STATUS = native.status()


@pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
@pytest.mark.parametrize("bf16", [False, True])
def test_decoded_experts_never_exceed_the_cap(monkeypatch, bf16):
    """Break check: _decoded_grouped decoding every active expert at once records 6 experts' bytes here. bf16 prefill
    decodes to bf16: the same cap in bytes holds twice the experts."""
    monkeypatch.setattr(panels, "available", lambda: False)  # fp32: the decode path (builds without AVX-512)
    g = torch.Generator().manual_seed(3)
    t, e, n, k = GGML_TYPE_IDS["Q8_0"], 6, 64, 256
    raw = quantize_q8_0(torch.randn(e * n, k, generator=g)).view(e, n, -1)
    experts = torch.arange(e)
    offs = torch.cumsum(torch.full((e,), 3 * ggml.GEMV_ROWS), 0).to(torch.int32)  # many rows: decode, then GEMM
    xs = torch.randn(int(offs[-1]), k, generator=g)
    whole = ggml.expert_linear_native(xs, raw, t, k, experts, offs, bf16=bf16)  # the default cap holds all six
    seen: list[int] = []
    decode = native.dequantize_experts

    def recording(ggml_type, w, which, kk, dtype=torch.float32, out=None):
        out = decode(ggml_type, w, which, kk, dtype, out=out)
        seen.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(native, "dequantize_experts", recording)
    cap = 2 * n * k * 4  # two experts' fp32 weights (four in bf16)
    monkeypatch.setattr(ggml, "EXPERT_BYTES", cap)
    capped = ggml.expert_linear_native(xs, raw, t, k, experts, offs, bf16=bf16)
    size = 2 if bf16 else 4
    assert seen and max(seen) <= cap and sum(seen) == e * n * k * size, seen
    assert len(seen) == (2 if bf16 else 3)  # chunks of 4 (bf16) or 2 experts
    assert torch.equal(capped, whole)  # each expert's rows meet that expert alone: the same products

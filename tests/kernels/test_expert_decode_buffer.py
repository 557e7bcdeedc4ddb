"""A prefill's chunks of decoded expert weights (kernels.ggml._decoded_grouped, more experts than EXPERT_BYTES
holds; the fp32 path of builds without the AVX-512 panels) are decoded into one buffer, allocated once per call and
reused by every chunk, and the products are those of one uncapped call; gate and up kept as two stacks decode into
the halves of that same buffer."""

from __future__ import annotations

import pytest
import torch

from mlaserve.gguf.convert.writer import quantize_q8_0
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native, panels

STATUS = native.status()


def _operands(parts: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    e, n, k = 7, 32, 256
    stacks = tuple(quantize_q8_0(torch.randn(e * n, k, generator=g)).view(e, n, -1) for _ in range(parts))
    experts = torch.arange(e)
    offs = torch.cumsum(torch.full((e,), 2 * ggml.GEMV_ROWS), 0).to(torch.int32)  # many rows: decode, then GEMM
    xs = torch.randn(int(offs[-1]), k, generator=g)
    return xs, stacks if parts > 1 else stacks[0], experts, offs, n * parts, k


@pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("parts", [1, 2])
def test_every_chunk_is_decoded_into_one_reused_buffer(monkeypatch, bf16, parts):
    """Break check: a buffer allocated per chunk (the previous code) gives as many buffers as chunks."""
    monkeypatch.setattr(panels, "available", lambda: False)  # fp32: the decode path (builds without AVX-512)
    xs, w, experts, offs, n, k = _operands(parts)
    t = GGML_TYPE_IDS["Q8_0"]
    whole = ggml.expert_linear_native(xs, w, t, k, experts, offs, bf16=bf16)  # the default cap holds all seven
    outs: list[torch.Tensor] = []  # kept alive, so that a buffer per chunk could not reuse one address
    calls: list[int] = []
    decode = native.dequantize_experts

    def recording(ggml_type, stack, which, kk, dtype=torch.float32, out=None):
        assert out is not None, "decoded without a caller's buffer"
        outs.append(out)
        calls.append(which.shape[0])
        return decode(ggml_type, stack, which, kk, dtype, out=out)

    monkeypatch.setattr(native, "dequantize_experts", recording)
    size = 2 if bf16 else 4
    monkeypatch.setattr(ggml, "EXPERT_BYTES", 2 * n * k * size)  # two experts per chunk: chunks of 2, 2, 2, 1
    capped = ggml.expert_linear_native(xs, w, t, k, experts, offs, bf16=bf16)
    assert calls == ([2, 2, 2, 1] if parts == 1 else [2, 2, 2, 2, 2, 2, 1, 1]), calls  # per chunk, part by part
    buffers = {o.untyped_storage().data_ptr() for o in outs}
    assert len(buffers) == 1, f"{len(buffers)} decode buffers for {len(calls)} decodes"
    assert torch.equal(capped, whole)  # each expert's rows meet that expert alone: the same products

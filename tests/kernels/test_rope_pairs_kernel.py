"""DeepSeek-V4's rope in one C call (csrc/glue.c mls_rope_pairs, bound as V4Attention.rotate by the KernelPlan's
op sink_attention) against models/deepseek_v4/rope.rotate_trailing: bit for bit (the same fp32 products and
differences in the same order), rotating and de-rotating (sign -1), at one token and at enough rows to share out
over the threads, rows per token 1 (K=V rows), 3 and 16 (heads), the rope slice narrower than and as wide as the
row; a tensor outside its contract (not contiguous) takes the reference. Broken on purpose, a pair's sine
not negated for the de-rotation fails every sign -1 case."""

from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import native
from mlaserve.models.deepseek_v4.attention import V4Attention
from mlaserve.models.deepseek_v4.rope import rotate_trailing

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("shape,half", [((1, 512), 32), ((1, 16, 512), 32), ((300, 3, 128), 8), ((40, 64), 32)])
def test_native_rope_equals_the_reference_bit_for_bit(threads, sign, shape, half):
    g = torch.Generator().manual_seed(shape[0] * 7 + half)
    x = torch.randn(*shape, generator=g)
    cos, sin = torch.randn(shape[0], half, generator=g), torch.randn(shape[0], half, generator=g)
    want = rotate_trailing(x, cos, sin if sign > 0 else -sin)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = x.clone()
        got = V4Attention._rotate_native(y, cos, sin, sign)
    finally:
        torch.set_num_threads(prev)
    assert got is y  # in place
    assert torch.equal(got, want)


@needs_native
def test_a_strided_input_takes_the_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 128, generator=g).transpose(0, 1)  # not contiguous
    cos, sin = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    before = x.clone()
    got = V4Attention._rotate_native(x, cos, sin)
    assert torch.equal(x, before)  # the input untouched: the reference made a new tensor
    assert torch.equal(got, rotate_trailing(before, cos, sin))

"""DeepSeek-V4's rope in one C call (csrc/glue.c mls_rope_pairs, bound as V4Attention.rotate by the KernelPlan's
op sink_attention) against models/deepseek_v4/rope.rotate_trailing: bit for bit (the same fp32 products and
differences in the same order), rotating and de-rotating (sign -1), at one token and at enough rows to share out
over the threads, rows per token 1 (K=V rows), 3 and 16 (heads), the rope slice narrower than and as wide as the
row; a tensor outside its contract (not contiguous) takes the reference. Broken on purpose, a pair's sine
not negated for the de-rotation fails every sign -1 case. The same rope with the rows' RMSNorm before it in one call
(mls_norm_rope_pairs: the query heads unweighted, the K=V row with kv_norm's weight) against the torch norm and
rotate_trailing, within the rounding of the sum of squares."""

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


def _bound(n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """Elementwise bound on |native - reference| for rows normalised to n (the reference's): the two sums of the W
    squares differ only in their order. In the worst case their 1 / sqrt then differ by (W + 2) u relative (u =
    2^-24), but the rounding errors of W squares cancel like a random walk (~sqrt(W) u): measured at most 4.7 u on
    the normalised values over 20,480 rows of 512 (a 2-core AMX Xeon), so held at 16 u, and a rotated value
    x1 cos - x2 sin to that times |x1 cos| + |x2 sin| plus its own two roundings. A real fault (a dropped weight,
    eps or sign) is off by orders of magnitude more."""
    u = 2.0**-24
    rel = 16 * u
    out = rel * n.abs()
    shape = (cos.shape[0],) + (1,) * (n.dim() - 2) + (half,)
    c, s = cos.view(shape).abs(), sin.view(shape).abs()
    a, b = n[..., -2 * half :: 2].abs(), n[..., -2 * half + 1 :: 2].abs()
    out[..., -2 * half :: 2] = (rel + 2 * u) * (a * c + b * s)
    out[..., -2 * half + 1 :: 2] = (rel + 2 * u) * (b * c + a * s)
    return out


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape,half", [((1, 16, 512), 32), ((1, 512), 32), ((300, 3, 128), 8)])
def test_native_norm_and_rope_equal_the_reference_within_the_sums_rounding(threads, weighted, shape, half):
    """The query heads' unweighted RMSNorm (weight None) or the K=V row's kv_norm, then the rope, in one call
    (native_v4.norm_rope_pairs, which V4Attention._norm_rotate_native calls) against the torch norm and rotate_trailing. Broken
    on purpose (the weight left out, the eps dropped, the rope skipped) every case fails by orders of magnitude."""
    from torch.nn import functional as F

    from mlaserve.kernels import native_v4
    from mlaserve.models.deepseek_v4.norm import unweighted_rms_norm

    g = torch.Generator().manual_seed(shape[0] * 5 + half + weighted)
    x = torch.randn(*shape, generator=g) * 3.0
    x[0, ..., :7] *= 1e-3  # small values beside large ones in one row
    angles = torch.rand(shape[0], half, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    eps = 1e-6
    w = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    n = F.rms_norm(x, (shape[-1],), w, eps) if weighted else unweighted_rms_norm(x, eps)
    want = rotate_trailing(n, cos, sin)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = x.clone()
        got = native_v4.norm_rope_pairs(y, w, eps, cos, sin)
    finally:
        torch.set_num_threads(prev)
    assert got is y  # in place
    diff = (got - want).abs()
    assert torch.all(diff <= _bound(n, cos, sin, half)), f"max diff {diff.max():.3g}"
    assert not torch.equal(got[..., : -2 * half], x[..., : -2 * half])  # normalised, not left as it was


@needs_native
def test_the_fused_norm_and_rope_refuse_a_weight_of_another_width():
    from mlaserve.kernels import native_v4

    x, cos = torch.randn(2, 64), torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        native_v4.norm_rope_pairs(x, torch.ones(32), 1e-6, cos, cos)

"""int8 activations for the grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) against q8_K, held
to an independent numpy reference exactly.

The reference takes the weights' values from gguf-py's dequantizer (a third party's code) and the scale fields from
the block bytes (d, and each 16-value half's multiplier ls = 2 s + 1, IQ3_S 1 + 2 s), and recovers the integer code
of each value as value / (d * factor * ls) (factor IQ2_* 1/8, IQ3_XXS 1/4, IQ3_S 1; IQ1: 8 x the value over d * ls,
the grid value and its +-1/8 delta as 8 g +- 1), asserting every code an integer (so the reference's reading of the
scales is the layout's). Activations: llama.cpp's quantize_row_q8_K_ref (test_int8_more.q8k_reference). Then exact
integer sums S = sum_halves ls * sum w q_x per super-block and the fp32 operations of llama.cpp's
ggml_vec_dot_iq2_xxs_q8_K and kin: acc += (d_w d_x) S, y = factor * acc (IQ1: the delta folded into the integer
codes, so S = 8 sumi + sumi1 of llama.cpp's, one rounding fewer). Each step one IEEE fp32 operation, so every build
(VNNI, AVX2, scalar) must equal the reference bit for bit, at 1-16 rows and inside any batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import U, builds, grid_blocks, q8k_reference, with_build

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
GRIDS = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
FACTOR = {"IQ3_XXS": 0.25, "IQ3_S": 1.0}  # else 1/8
F32 = np.float32


def _u16(b: np.ndarray, off: int) -> np.ndarray:
    return b[..., off] | (b[..., off + 1] << 8)


def scales_of(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """raw [N, R] -> (d [N, nb] fp32, ls [N, nb, 16] int64: the multiplier of each 16-value half), from the bytes."""
    n = raw.shape[0]
    size = GGML_TYPES[GGML_TYPE_IDS[name]].type_size
    b = raw.reshape(n, -1, size).astype(np.int64)
    ls = np.zeros((*b.shape[:2], 8, 2), dtype=np.int64)
    for ib in range(8):
        if name in ("IQ2_XXS", "IQ3_XXS"):
            off = 2 + 8 * ib + 4 if name == "IQ2_XXS" else 66 + 4 * ib
            aux = _u16(b, off) | (_u16(b, off + 2) << 16)
            ls[..., ib, 0] = ls[..., ib, 1] = 2 * (aux >> 28) + 1
        elif name in ("IQ2_XS", "IQ2_S"):
            sc = b[..., (66 if name == "IQ2_XS" else 74) + ib]
            ls[..., ib, 0], ls[..., ib, 1] = 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1
        elif name == "IQ3_S":
            ls[..., ib, 0] = ls[..., ib, 1] = 1 + 2 * ((b[..., 106 + ib // 2] >> (4 * (ib % 2))) & 15)
        elif name == "IQ1_S":
            ls[..., ib, 0] = ls[..., ib, 1] = 2 * ((_u16(b, 34 + 2 * ib) >> 12) & 7) + 1
        else:
            sw, sh = _u16(b, 48 + 2 * (ib // 2)), 6 * (ib % 2)
            ls[..., ib, 0], ls[..., ib, 1] = 2 * ((sw >> sh) & 7) + 1, 2 * ((sw >> (sh + 3)) & 7) + 1
    if name == "IQ1_M":
        s = [_u16(b, 48 + 2 * w) for w in range(4)]
        bits = (s[0] >> 12) | ((s[1] & 0xF000) >> 8) | ((s[2] & 0xF000) >> 4) | (s[3] & 0xF000)
        d = bits.astype(np.uint16).view(np.float16).astype(F32)
    else:
        d = np.ascontiguousarray(raw.reshape(n, -1, size)[..., 0:2]).view(np.float16).astype(F32)[..., 0]
    return d, ls.reshape(n, -1, 16)


def codes_of(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (codes [N, K] int64, d [N, nb], ls [N, nb, 16]): gguf-py's values over their scales, asserted integers."""
    gguf = pytest.importorskip("gguf")
    d, ls = scales_of(raw, name)
    vals = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float64).reshape(raw.shape[0], -1)
    n, nb = d.shape
    per = d[..., None].astype(np.float64) * ls  # [N, nb, 16]
    per = np.repeat(per.reshape(n, -1), 16, -1)
    c = vals / per * (8.0 if name.startswith("IQ1") else 1.0 / FACTOR.get(name, 0.125))
    codes = np.rint(c)
    assert np.abs(c - codes).max() < 1e-3, f"{name}: the reference's scales do not divide gguf-py's values"
    return codes.astype(np.int64), d, ls


def reference(raw: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    q, dx = q8k_reference(x.numpy())
    codes, d, ls = codes_of(raw.numpy(), name)
    m, k = q.shape
    n, nb = d.shape
    halves = np.einsum("nbhj,mbhj->mnbh", codes.reshape(n, nb, 16, 16), q.astype(np.int64).reshape(m, nb, 16, 16))
    s = (halves * ls[None]).sum(-1)  # [M, N, nb] exact
    factor = F32(FACTOR.get(name, 0.125))
    y = np.zeros((m, n), dtype=F32)
    for i in range(m):
        for r in range(n):
            acc = F32(0)
            for blk in range(nb):
                acc = F32(acc + F32(F32(d[r, blk] * dx[i, blk]) * F32(s[i, r, blk])))
            y[i, r] = F32(acc * factor)
    return torch.from_numpy(y)


@needs_native
@pytest.mark.parametrize("name", GRIDS)
def test_int8_products_equal_the_reference_exactly_in_every_build(name, monkeypatch):
    t, k, n = GGML_TYPE_IDS[name], 512, 13
    raw = grid_blocks(name, n, k, seed=5)
    other = grid_blocks(name, n, k, seed=7)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, k, generator=g) * (torch.rand(16, 1, generator=g) * 4 + 0.1)
    x[0, :256] = 0.0  # an all-zero super-block: d 0, codes 0
    want, want_other = reference(raw, name, x), reference(other, name, x[:4])
    seen = []
    for flags in builds():
        seen.append(with_build(monkeypatch, flags))
        for rows in (1, 3, 4, 5, 16):
            assert torch.equal(native.gemm(t, x[:rows].contiguous(), raw, k, int8=True), want[:rows]), (seen[-1], rows)
        got = native.gemm(t, x[7:12].contiguous(), raw, k, int8=True)  # the same rows inside another batch
        assert torch.equal(got, want[7:12]), seen[-1]
        ys = native.grouped_gemm(t, x[:9].contiguous(), torch.stack([raw, other]), k, torch.tensor([1, 0]),
                                 torch.tensor([0, 4, 9]), int8=True)  # fmt: skip
        assert torch.equal(ys[4:9], want[4:9]) and torch.equal(ys[:4], want_other), seen[-1]
    assert len(set(seen)) == len(seen) >= 2, seen


@needs_native
@pytest.mark.parametrize("name", GRIDS)
def test_int8_products_within_the_activation_bound(name):
    """Against the exact float product: |y - y_exact| <= sum_j |w_j| |d_x(j)| / 2 + the fp32 rounding of both sides
    (2 K u sum |x w|); and not equal to it (the int8 path ran)."""
    t, k = GGML_TYPE_IDS[name], 1024
    raw = grid_blocks(name, 24, k, seed=8)
    w = ggml.dense(raw, t, k).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(9))
    dx = torch.from_numpy(np.abs(q8k_reference(x.numpy())[1])).double().repeat_interleave(256, 1)
    exact = x.double() @ w.T
    bound = (dx / 2) @ w.abs().T + 2 * k * U * (x.double().abs() @ w.abs().T)
    got = ggml.linear(x, raw, t, k, kernel="native", int8=True).double()
    assert ((got - exact).abs() <= bound).all()
    assert not torch.allclose(got, exact, rtol=1e-6, atol=0)
    assert native.takes_int8(t, 6)  # activations="auto" takes it

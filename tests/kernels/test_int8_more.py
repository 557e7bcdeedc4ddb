"""int8 activations for Q4_1, Q5_0, Q5_1, IQ4_NL (per-32 activation blocks) and IQ4_XS (q8_K), against an independent
numpy reference.

The reference follows llama.cpp's definitions, not our C: activations quantized per 32 values (d = max|x| / 127,
codes nearest(x / d), as csrc/int8.c's Q8_0-style blocks; IQ4_XS: quantize_row_q8_K_ref per 256), the weight's
integer codes read from the ggml layout (checked against gguf-py's dequantizer, a third party's code), exact
integer sums of code products, then the scales:
  Q5_0, IQ4_NL:  y = sum_b (d_w d_x) S_b                          (vec_dot_q5_0_q8_0, vec_dot_iq4_nl_q8_0)
  Q4_1, Q5_1:    y = sum_b (d_w d_x) S_b + (m_w d_x) X_b, X_b = sum of the block's activation codes
                                                                 (vec_dot_q4_1_q8_1: q8_1's s = d_x X_b)
  IQ4_XS:        y = sum_blk (d_w d_x) sum_ib (ls_ib - 32) S_ib  (vec_dot_iq4_xs_q8_K)
IQ4_XS's kernels run exactly those fp32 operations per super-block, so they equal the reference bit for bit. The
32-value kernels keep 8 fp32 lane accumulators (acc = fma(d_w d_x, S_lane, acc), the 8 lanes summed at the end,
csrc/x86/avx2.c q8rows_mr), so against the reference (the same fp32 products d_w d_x, summed in float64) they differ
by fp32 accumulation only: each lane is a chain of n = kb (2 kb with a min) fused multiply-adds, one rounding each,
then 3 pairwise additions, so |y - y_ref| <= gamma_{n+3} sum_b (|d_w d_x| sum |q_w q_x| + |m_w d_x| sum |q_x|),
gamma_n = n u / (1 - n u), u = 2^-24 (the standard bound for a recursive sum, Higham 3.1). Every build (AVX512-VNNI
vpdpbusd, AVX2 maddubs, scalar) runs the same integer lanes and the same fp32 operations, so the builds are also
held to each other bit for bit, and a row's result to its result alone (batch independence).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from int8_reference import U, builds, q8_0_reference, q8k_reference, with_build

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")
BLOCK32 = ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL"]
NEW = [*BLOCK32, "IQ4_XS"]
F32 = np.float32
IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64)
SCALES = {"Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0], "IQ4_XS": [0]}  # fp16 fields (d, m)


def blocks(name: str, rows: int, k: int, seed: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Random bits in every code and scale field, finite fp16 d (and m) in (0.001, 0.021): [*lead, rows, R]."""
    g = torch.Generator().manual_seed(seed)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    shape = (*lead, rows, k // t.block_size)
    raw = torch.randint(0, 256, (*shape, t.type_size), dtype=torch.uint8, generator=g)
    for off in SCALES[name]:
        d = (torch.rand(shape, generator=g) * 0.02 + 0.001).half()
        raw[..., off : off + 2] = d.view(torch.uint8).view(*shape, 2)
    return raw.flatten(-2).contiguous()


# ---------------------------------------------------------------- the reference (numpy, llama.cpp's definitions)


def f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(F32)[..., 0]


def codes_of(raw: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw [N, R] -> (codes [N, K] int64, d [N, K / 32] fp32 per 32 values, m [N, K / 32] fp32 or zeros): value =
    d * code + m. IQ4_XS: d holds the super-block's fp16 d repeated and m its integer sub-block scales ls - 32."""
    n = raw.shape[0]
    size = GGML_TYPES[GGML_TYPE_IDS[name]].type_size
    b = raw.reshape(n, -1, size).astype(np.int64)
    if name == "IQ4_XS":
        qs = b[..., 8:].reshape(n, -1, 8, 16)
        nib = np.concatenate([qs & 15, qs >> 4], -1)  # [N, nb, 8, 32]: value j low nibble, j + 16 high
        sh = b[..., 2] | (b[..., 3] << 8)
        ls = np.stack(
            [((b[..., 4 + ib // 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4) for ib in range(8)], -1
        )
        d = f16(raw.reshape(n, -1, size)[..., 0:2])
        return IQ4NL[nib].reshape(n, -1), np.repeat(d, 8, -1), (ls - 32).reshape(n, -1)
    qoff = {"Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "IQ4_NL": 2}[name]
    qs = b[..., qoff : qoff + 16]
    nib = np.concatenate([qs & 15, qs >> 4], -1)  # [N, nb, 32]
    if name in ("Q5_0", "Q5_1"):
        hoff = 2 if name == "Q5_0" else 4
        qh = b[..., hoff] | (b[..., hoff + 1] << 8) | (b[..., hoff + 2] << 16) | (b[..., hoff + 3] << 24)
        nib = nib | (((qh[..., None] >> np.arange(32)) & 1) << 4)
    codes = nib - 16 if name == "Q5_0" else IQ4NL[nib] if name == "IQ4_NL" else nib
    d = f16(raw.reshape(n, -1, size)[..., 0:2])
    m = f16(raw.reshape(n, -1, size)[..., 2:4]) if name in ("Q4_1", "Q5_1") else np.zeros_like(d)
    return codes.reshape(n, -1), d, m


def block32_reference(raw: torch.Tensor, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y_ref [M, N] float64, bound [M, N]): the per-block terms with fp32 d_w d_x (as the kernels form them),
    summed in float64, and the fp32 accumulation bound of the module docstring."""
    q, dx = q8_0_reference(x.numpy())
    codes, dw, mw = codes_of(raw.numpy(), name)
    m, k = q.shape
    n, kb = dw.shape
    qb = q.astype(np.int64).reshape(m, kb, 32)
    cb = codes.reshape(n, kb, 32)
    s = np.einsum("nbj,mbj->mnb", cb, qb)  # exact integer block sums
    sabs = np.einsum("nbj,mbj->mnb", np.abs(cb), np.abs(qb))
    xsum, xabs = qb.sum(-1), np.abs(qb).sum(-1)  # [M, kb]
    c = (dw[None] * dx[:, None]).astype(F32).astype(np.float64)  # [M, N, kb]: fp32 d_w * d_x
    cm = (mw[None] * dx[:, None]).astype(F32).astype(np.float64)
    y = (c * s).sum(-1) + (cm * xsum[:, None]).sum(-1)
    terms = (np.abs(c) * sabs).sum(-1) + (np.abs(cm) * xabs[:, None]).sum(-1)
    steps = (2 * kb if name in ("Q4_1", "Q5_1") else kb) + 3
    gamma = steps * U / (1 - steps * U)
    return torch.from_numpy(y), torch.from_numpy(gamma * terms)


def iq4_xs_reference(raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [M, N] fp32: exact integer sums per super-block, then acc += (d_w d_x) S, each a single fp32 rounding."""
    q, dx = q8k_reference(x.numpy())
    codes, dw, ls = codes_of(raw.numpy(), "IQ4_XS")
    m, k = q.shape
    n, nb = codes.shape[0], k // 256
    sub = np.einsum("nbil,mbil->mnbi", codes.reshape(n, nb, 8, 32), q.astype(np.int64).reshape(m, nb, 8, 32))
    s = (sub * ls.reshape(n, nb, 8)[None]).sum(-1)  # [M, N, nb]
    d = dw.reshape(n, nb, 8)[..., 0]
    y = np.zeros((m, n), dtype=F32)
    for i in range(m):
        for r in range(n):
            acc = F32(0)
            for blk in range(nb):
                acc = F32(acc + F32(F32(d[r, blk] * dx[i, blk]) * F32(s[i, r, blk])))
            y[i, r] = acc
    return torch.from_numpy(y)


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", NEW)
def test_reference_codes_decode_as_gguf_py(name):
    """The reference's codes and scales give gguf-py's dequantized values exactly (the reference reads the layout
    as llama.cpp does, independently of our C and torch decoders)."""
    gguf = pytest.importorskip("gguf")
    raw = blocks(name, 6, 512, seed=3)
    codes, d, m = codes_of(raw.numpy(), name)
    if name == "IQ4_XS":
        vals = ((d * m.astype(F32)).astype(F32).repeat(32, -1) * codes.astype(F32)).astype(F32)
    else:
        vals = (d.repeat(32, -1) * codes.astype(F32) + m.repeat(32, -1)).astype(F32)
    want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).astype(F32)
    assert np.array_equal(vals, want.reshape(6, -1)), name


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows of varied scale, with an all-zero 32-value block (d 0, codes 0) and one whose largest value is
    negative."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 0.1)
    x[0, 32:64] = 0.0
    if rows > 1:
        x[1, 64] = -9.0
    return x


@needs_native
@pytest.mark.parametrize("name", NEW)
def test_activation_quantization(name):
    """quantize_act gives the codes and scales of the reference (per 32 values, or q8_K per 256 for IQ4_XS)."""
    t = GGML_TYPE_IDS[name]
    x = _x(5, 512, seed=4)
    q, slots = native.quantize_act(t, x)
    if name == "IQ4_XS":
        want_q, want_d = q8k_reference(x.numpy())
        got_d = slots.view(5, 2, 8)[..., 0].numpy()
    else:
        want_q, want_d = q8_0_reference(x.numpy())
        got_d = slots.numpy()
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(got_d, want_d)


def _check(name: str, got: torch.Tensor, raw: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if name == "IQ4_XS":
        assert torch.equal(got, iq4_xs_reference(raw, x)), what
        return
    y, bound = block32_reference(raw, name, x)
    excess = (got.double() - y).abs() - bound
    assert (excess <= 0).all(), f"{what}: {excess.max().item():.3g} over the fp32 accumulation bound"


@needs_native
@pytest.mark.parametrize("name", NEW)
def test_int8_products_equal_the_reference_in_every_build(name, monkeypatch):
    """gemm at 1-16 rows and the grouped gemm, in each build: within the accumulation bound of the reference (IQ4_XS:
    equal to it); the builds bit for bit equal to each other; a row's result does not depend on its batch."""
    t, k, n = GGML_TYPE_IDS[name], 768, 19
    raw = blocks(name, n, k, seed=5)
    other = blocks(name, n, k, seed=7)
    x = _x(16, k, seed=6)
    seen, results = [], []
    for flags in builds():
        seen.append(with_build(monkeypatch, flags))
        full = native.gemm(t, x, raw, k, int8=True)
        _check(name, full, raw, x, seen[-1])
        for rows in (1, 2, 3, 4, 5, 8, 13):
            assert torch.equal(native.gemm(t, x[:rows].contiguous(), raw, k, int8=True), full[:rows]), (seen[-1], rows)
        for start in (3, 7):  # the same rows inside other batches
            got = native.gemm(t, x[start : start + 5].contiguous(), raw, k, int8=True)
            assert torch.equal(got, full[start : start + 5]), (seen[-1], start)
        experts, starts = torch.tensor([1, 0]), torch.tensor([0, 4, 9])
        ys = native.grouped_gemm(t, x[:9].contiguous(), torch.stack([raw, other]), k, experts, starts, int8=True)
        assert torch.equal(ys[4:9], full[4:9])
        _check(name, ys[:4], other, x[:4], f"{seen[-1]} grouped")
        results.append(full)
    assert len(set(seen)) == len(seen) >= 2, seen
    for flags, r in zip(seen[1:], results[1:]):
        assert torch.equal(r, results[0]), (seen[0], flags)


@needs_native
@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("rows", [1, 16])
def test_int8_products_within_the_activation_bound(name, rows):
    """Against the exact float product: each activation moves by at most |d_x| / 2 (its block's step), so
    |y - y_exact| <= sum_j |w_j| |d_x(j)| / 2, plus the fp32 rounding of both sides (2 K u sum |x w|, the
    summation-order bound of test_kernels.py); and the int8 path really ran (not equal to the float product)."""
    t, k = GGML_TYPE_IDS[name], 1024
    raw = blocks(name, 40, k, seed=8)
    w = ggml.dense(raw, t, k).double()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    if name == "IQ4_XS":
        dx = torch.from_numpy(np.abs(q8k_reference(x.numpy())[1])).double().repeat_interleave(256, 1)
    else:
        dx = torch.from_numpy(q8_0_reference(x.numpy())[1]).double().repeat_interleave(32, 1)
    exact = x.double() @ w.T
    bound = (dx / 2) @ w.abs().T + 2 * k * U * (x.double().abs() @ w.abs().T)
    got = ggml.linear(x, raw, t, k, kernel="native", int8=True).double()
    assert ((got - exact).abs() <= bound).all()
    assert not torch.allclose(got, exact, rtol=1e-6, atol=0)
    assert torch.equal(ggml.linear(x, raw, t, k, "native", int8=False), ggml.linear(x, raw, t, k, "native"))
    print(f"\n{name} rows {rows}: worst |y - exact| / bound {((got - exact).abs() / bound).max().item():.3f}")


@needs_native
def test_the_python_table_matches_the_library():
    """native.Q8_ACTIVATION_BITS (what takes_int8 reads) names exactly the types the library has int8 kernels for,
    activations="int8" (8) takes every new type and "auto" (int8 = 6) every one but Q5_0 / Q5_1, held exact with
    Q8_0 (tests/gguf/test_gguf_int8_default.py says why)."""
    lib_types = {t for t in GGML_TYPES if native.type_kernels(t) & 4}
    assert lib_types == set(native.Q8_ACTIVATION_TYPES)
    for name in NEW:
        assert native.takes_int8(GGML_TYPE_IDS[name], 8), name
        assert native.takes_int8(GGML_TYPE_IDS[name], 6) == (name not in ("Q5_0", "Q5_1")), name


@needs_native
@pytest.mark.parametrize("name", BLOCK32)
def test_nan_activation_stays_nan(name):
    """A NaN activation is not laundered into finite codes: its block's scale is NaN, so its row comes out NaN."""
    t, k = GGML_TYPE_IDS[name], 64
    raw = blocks(name, 8, k, seed=12)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(13))
    x[1, 40] = float("nan")
    y = ggml.linear(x, raw, t, k, kernel="native", int8=True)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    assert torch.allclose(y[0], F.linear(x[:1], ggml.dense(raw, t, k))[0], rtol=0.05, atol=0.05)


def test_auto_names_the_new_types_in_provenance():
    """activations="auto" on a GGUF with the native kernels records int8_6bit, and its reason names the per-32 and
    q8_K types it covers, the new ones among them."""
    from hf_models import make_config

    from mlaserve.config.engine import EngineOptions, resolve
    from mlaserve.config.model import ModelConfig

    cfg = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    eng = resolve(cfg, EngineOptions(device="cpu"), False, native_kernels=lambda: (True, "built"), gguf=True)
    why = {s.name: s for s in eng.provenance}["activations"].source
    assert eng.kernels.activations == "int8_6bit"
    assert (
        "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL" in why
        and "Q4_K / Q5_K / Q6_K / IQ4_XS / IQ3_XXS / IQ3_S / IQ2_XXS / IQ2_XS / IQ2_S / IQ1_S / IQ1_M" in why
    )

"""Q8_0 products of many rows with int16 activations on AVX512-VNNI (kernels/q8_0_int16.py, csrc/x86/q8_0_int16.c):
held to its own integer sums (the activations' codes rebuilt here in numpy, fp32 step by step as the module's
notation says), to fp64 by the bound derived in the module, to batch and thread independence, the grouped form to
the plain one, the route (bf16_prefill.INT16 where the process has AVX512-VNNI and no AMX-BF16 tiles), and in the
engine to the exact fp32 prefill of the same file. On a CPU without AVX512-VNNI the kernel tests skip and say so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import with_build
from test_bf16_pairs import case, q8_0

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import bf16_pairs, bf16_prefill, ggml, native, q8_0_int16

STATUS = native.status()
needs_units = pytest.mark.skipif(
    not STATUS.available or not q8_0_int16.available(),
    reason=f"no int16 products here: {q8_0_int16.detail() if STATUS.available else STATUS.detail}",
)
Q8_0 = GGML_TYPE_IDS["Q8_0"]
U = 2.0**-24  # fp32's unit roundoff
TINY = np.float32(2.0**-100)  # the module's floor: a block whose largest |x| is below it counts as zero


def codes(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The module's activation codes c [M, K] (int64) and scales d_x [M, K / 32] (fp32), each step in fp32 as its
    notation says: a = max |x| per block, d_x = a / 32767, c = rne(x * (32767 / a)); a below the floor: zero."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    a = np.abs(xb).max(-1)
    live = a >= TINY
    safe = np.where(live, a, np.float32(1))
    dx = np.where(live, safe / np.float32(32767), np.float32(0)).astype(np.float32)
    inv = (np.float32(32767) / safe).astype(np.float32)
    c = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int64) * live[..., None]
    assert np.abs(c).max(initial=0) <= 32767
    return c.reshape(x.shape[0], -1), dx


def weight_codes(w: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 weight's int8 codes q [N, K] and fp16 scales d [N, K / 32] (as fp64)."""
    blocks = w.numpy().reshape(w.shape[0], k // 32, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = blocks[..., 2:].view(np.int8).astype(np.int64).reshape(w.shape[0], k)
    return q, d


def bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The module's bound per output (fp64): sum_k |w_k| e_k + (K / 32 + 2) u (1 + 2^-20) sum_k |w_k| (|x_k| + e_k),
    e_k = d_x / 2 + 3.01 u |x_k|."""
    k = x.shape[1]
    _, dx = codes(x)
    e = torch.from_numpy(np.repeat(dx.astype(np.float64), 32, axis=1)) / 2 + 3.01 * U * x.double().abs()
    w = dense.double().abs()
    return e @ w.T + (k / 32 + 2) * U * (1 + 2.0**-20) * ((x.double().abs() + e) @ w.T)


@needs_units
@pytest.mark.parametrize(
    "m, n, k",
    # odd rows (8-row tiles' tails), partial 16-row panels, an odd block count (the unpack's pairs of blocks), more
    # rows than a work item's 256
    [(17, 1, 32), (16, 33, 96), (33, 70, 288), (50, 31, 544), (300, 20, 256), (48, 96, 2048)],
)
def test_products_are_their_integer_sums_and_within_the_derived_bound(m, n, k):
    """Two levels. Against the codes rebuilt here: y = sum_b d d_x S_b with S_b exact, within the fp32 steps' bound
    (K / 32 + 2) u per |term| (a kernel rounding a code another way, or dropping a block, is off by ~d_x |w| per
    value: far outside). Against fp64 on the reference dequantizer's values: within the module's bound, and more
    than 20x tighter than plain bf16 (int16's step is ~1/70 of bf16's by RMS)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = q8_0(n, k, g)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] *= 1e-3  # a block of small values next to large ones: scales per block, not per row
    y = q8_0_int16.linear(x, w, k).double()

    c, dx = codes(x)
    q, d = weight_codes(w, k)
    s = np.einsum("mbk,nbk->mnb", c.reshape(m, -1, 32), q.reshape(n, -1, 32))  # exact integer sums S_b
    terms = d[None] * dx.astype(np.float64)[:, None] * s
    own = torch.from_numpy(terms.sum(-1))
    fp32_steps = torch.from_numpy((k / 32 + 2) * U * (1 + 2.0**-20) * np.abs(terms).sum(-1))
    assert ((y - own).abs() <= fp32_steps).all(), ((y - own).abs() / fp32_steps).max().item()

    dense = ggml.dense(w, Q8_0, k).double()
    err = (y - x.double() @ dense.T).abs()
    b = bound(x, dense)
    assert (err <= b).all(), (err / b).max().item()
    plain = (bf16_prefill.linear(x, dense.float()).double() - x.double() @ dense.T).abs()
    assert err.max() * 20 < plain.max(), (err.max().item(), plain.max().item())


@needs_units
def test_a_rows_result_does_not_depend_on_the_batch_or_threads():
    """Each row the same bits alone, among 300 rows (two work items, a partial tile), and on 1 or 2 threads."""
    k = 544
    w, x = case(1, 300, 70, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = q8_0_int16.linear(x, w, k)
        torch.set_num_threads(1)
        y1 = q8_0_int16.linear(x, w, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)
    for i in (0, 17, 255, 256, 299):
        assert torch.equal(q8_0_int16.linear(x[i : i + 1], w, k)[0], y[i])


@needs_units
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_stays_in_its_row(bad):
    """A NaN or infinite activation makes its own row's outputs NaN and no other's (the engine's NaN checks name the
    request); a row of zeros (and of values below the floor) gives zeros."""
    k = 96
    w, x = case(2, 20, 40, k)
    x[3] = 0
    x[4] = 2.0**-110
    clean = q8_0_int16.linear(x, w, k)
    assert not clean[3].any() and not clean[4].any()
    x[5, 7] = bad
    y = q8_0_int16.linear(x, w, k)
    assert y[5].isnan().all()
    assert torch.equal(torch.cat([y[:5], y[6:]]), torch.cat([clean[:5], clean[6:]]))


@needs_units
def test_grouped_is_the_plain_product_per_group_and_part():
    """Experts of two parts (gate, up: stacks read in place), groups of 0, 1, 17 and 300 rows (two work items): each
    group's rows the plain product with its expert's rows of each part, bit for bit, in its columns; routed through
    ggml.expert_linear_native with the INT16 setting."""
    g = torch.Generator().manual_seed(3)
    e, i, k = 5, 24, 288
    gate = torch.stack([q8_0(i, k, g) for _ in range(e)])
    up = torch.stack([q8_0(i, k, g) for _ in range(e)])
    counts = [17, 0, 1, 300]
    experts = torch.tensor([0, 2, 3, 4])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g)
    ys = ggml.expert_linear_native(xs, (gate, up), Q8_0, k, experts, offs, bf16=bf16_prefill.INT16)
    lo = 0
    for a, c in zip(experts.tolist(), counts, strict=True):
        if c:
            want = torch.cat([q8_0_int16.linear(xs[lo : lo + c], p[a], k) for p in (gate, up)], dim=1)
            assert torch.equal(ys[lo : lo + c], want), a
        lo += c


@needs_units
def test_linear_native_takes_them_above_the_decode_rows():
    """ggml.linear_native with the INT16 setting: decode-sized calls (<= GEMV_ROWS rows) are the decode kernels' exact
    bits, more rows the int16 products'."""
    g = torch.Generator().manual_seed(4)
    k, n = 256, 48
    w = q8_0(n, k, g)
    x = torch.randn(ggml.GEMV_ROWS + 8, k, generator=g)
    small = x[: ggml.GEMV_ROWS]
    assert torch.equal(ggml.linear_native(small, w, Q8_0, k, bf16=bf16_prefill.INT16), native.gemm(Q8_0, small, w, k))
    assert torch.equal(ggml.linear_native(x, w, Q8_0, k, bf16=bf16_prefill.INT16), q8_0_int16.linear(x, w, k))


def test_the_setting_takes_them_for_q8_0_only_where_no_pairs_run(monkeypatch):
    """takes_bf16: Q8_0 under a cap below BF16_ALL takes the pairs where the AMX-BF16 tiles run, else int16 where the
    build has AVX512-VNNI, else fp32; cap 0 (prefill_matmul "float") fp32 always; other types never int16."""
    auto = 6
    for pairs, units, want in (
        (True, True, bf16_prefill.BF16_PAIRS),
        (False, True, bf16_prefill.INT16),
        (False, False, bf16_prefill.FP32),
    ):
        monkeypatch.setattr(bf16_pairs, "granted", lambda p=pairs: p)
        monkeypatch.setattr(q8_0_int16, "available", lambda u=units: u)
        assert bf16_prefill.takes_bf16(Q8_0, auto) == want
        assert bf16_prefill.takes_bf16(Q8_0, 0) == bf16_prefill.FP32
        assert bf16_prefill.takes_bf16(Q8_0, bf16_prefill.BF16_ALL) == bf16_prefill.BF16
        assert bf16_prefill.takes_bf16(GGML_TYPE_IDS["Q5_0"], 4) == bf16_prefill.FP32


def test_a_build_without_avx512_vnni_has_none(monkeypatch):
    """The same sources built without AVX512-VNNI: the library says so (the holders keep fp32) and the call refuses."""
    if not STATUS.available:
        pytest.skip(STATUS.detail)
    with_build(monkeypatch, ("-mno-avx512vnni",))
    assert not q8_0_int16.available()
    assert "no int16 products" in q8_0_int16.detail()
    w, x = case(6, 20, 16, 64)
    with pytest.raises(RuntimeError, match="rc -1"):
        q8_0_int16.linear(x, w, 64)


@needs_units
@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_engine_q8_0_prefill_far_inside_the_files_own_error(name, monkeypatch):
    """A fixture's Q8_0 file under auto (fast bf16 forced on) on a CPU without the AMX-BF16 tiles: its Q8_0 holders take
    the int16 products (the plan says so) and a 96-token prefill's logits move from the exact fp32 prefill's by what
    they add, against the file's own error (exact products vs transformers on the f32 weights). Plain bf16 adds
    0.54-0.57x it (bf16_prefill.py); int16's step is ~1/70 of bf16's by RMS (a uniform step of a_b / 32767, a_b ~2.5
    sigma, against bf16's 2^-8 relative step on both operands), so the bound is 0.57 / 32 of the file's (a 2x
    margin; measured: see the print), with the same top-1 token everywhere."""
    from conftest import fixture_dir
    from safetensors.torch import load_file

    from mlaserve import LLM

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    monkeypatch.setattr(bf16_pairs, "granted", lambda: False)
    folder = fixture_dir(name)
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    path = str(folder / "model-q8_0.gguf")
    fast, exact = LLM(path), LLM(path, prefill_matmul="float")
    reasons = " ".join(c.reason for c in fast.loaded.kernel_plan.choices)
    assert f"int16-activation prefill for Q8_0 ({q8_0_int16.detail()}" in reasons
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act = ((a - b).norm() / b.norm()).item()
    file = ((b - exp["hf_logits"]).norm() / exp["hf_logits"].norm()).item()
    print(f"\n{name} q8_0: int16 activations add {act:.2e} to the logits; the file's own error {file:.4f}")
    assert 0 < act <= 0.57 / 32 * file, (act, file)
    assert torch.equal(a.argmax(-1), b.argmax(-1))

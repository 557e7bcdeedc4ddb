"""Products with int16 activations for the 32-value block types (kernels/int16_prefill.py; Q8_0, Q4_0, Q5_0, IQ4_NL,
MXFP4): csrc/x86/int16_prefill.c on AVX512-VNNI (panels for many rows, the rows read in place for few),
csrc/x86/int16_rows.c on AVX2 (the rows read in place, QW_FEW at a time, at every row count). Held to their own integer sums (the activations' codes
rebuilt here in numpy, fp32 step by step as the module's notation says; the weights' codes from the reference
dequantizer's values over their block scales), to fp64 by the bound derived in the module, to batch and thread
independence, the grouped form to the plain one, the route (bf16_prefill.INT16 where the process has AVX512-VNNI
and no AMX-BF16 tiles), the two builds to each other's bits, and in the engine to the exact fp32 prefill of the same
file. On a CPU without AVX2 the kernel tests skip and say so."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int8_reference import with_build
from test_bf16_pairs import case, q8_0

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import bf16_pairs, bf16_prefill, ggml, int16_prefill, native

STATUS = native.status()
Q8_0 = GGML_TYPE_IDS["Q8_0"]
needs_units = pytest.mark.skipif(
    not STATUS.available or not int16_prefill.takes_rows(Q8_0),
    reason=f"no int16 products here: {int16_prefill.detail() if STATUS.available else STATUS.detail}",
)
needs_panels = pytest.mark.skipif(  # a prompt's products take them (AVX512-VNNI builds)
    not STATUS.available or not int16_prefill.takes(Q8_0),
    reason=f"no int16 prefill here: {int16_prefill.detail() if STATUS.available else STATUS.detail}",
)
NAMES = ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4"]
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


def blocks(name: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n rows of random valid blocks of a type: random code bytes, a finite scale of a few magnitudes (fp16; MXFP4's
    e8m0 exponent byte in 2^-8 .. 2^-3)."""
    if name == "Q8_0":
        return q8_0(n, k, g)
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    raw = torch.randint(0, 256, (n, k // 32, t.type_size), dtype=torch.uint8, generator=g)
    if name == "MXFP4":
        raw[..., 0] = torch.randint(120, 126, (n, k // 32), dtype=torch.uint8, generator=g)
    else:
        d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
        raw[..., :2] = d.view(torch.uint8).view(n, k // 32, 2)
    return raw.reshape(n, -1).contiguous()


def weight_codes(w: torch.Tensor, name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight's integer codes q [N, K] and block scales d [N, K / 32] (fp64): d from the block's bytes (fp16, or
    MXFP4's e8m0 as 2^(e - 128), its codes the doubled e2m1 values), q = the reference dequantizer's values / d, which
    must come out integers of at most 128 in size (the module's notation)."""
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    raw = w.numpy().reshape(w.shape[0], k // 32, t.type_size)
    if name == "MXFP4":
        d = np.ldexp(1.0, raw[..., 0].astype(np.int64) - 128)
    else:
        d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    values = ggml.dense(w, GGML_TYPE_IDS[name], k).double().numpy().reshape(w.shape[0], k // 32, 32)
    q = values / d[..., None]
    assert np.array_equal(q, np.rint(q)) and np.abs(q).max() <= 128
    return q.astype(np.int64).reshape(w.shape[0], k), d


def bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The module's bound per output (fp64): sum_k |w_k| e_k + (K / 32 + 2) u (1 + 2^-20) sum_k |w_k| (|x_k| + e_k),
    e_k = d_x / 2 + 3.01 u |x_k|."""
    k = x.shape[1]
    _, dx = codes(x)
    e = torch.from_numpy(np.repeat(dx.astype(np.float64), 32, axis=1)) / 2 + 3.01 * U * x.double().abs()
    w = dense.double().abs()
    return e @ w.T + (k / 32 + 2) * U * (1 + 2.0**-20) * ((x.double().abs() + e) @ w.T)


@needs_units
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "m, n, k",
    # odd rows (8-row tiles' tails), partial 16-row panels, an odd block count (the unpack's pairs of blocks), more
    # rows than a work item's 256; 1-3 rows (the weight rows read in place, no panel)
    [
        (17, 1, 32),
        (16, 33, 96),
        (33, 70, 288),
        (50, 31, 544),
        (300, 20, 256),
        (48, 96, 2048),
        (1, 33, 96),
        (2, 1, 32),
        (3, 70, 544),
    ],
)
def test_products_are_their_integer_sums_and_within_the_derived_bound(name, m, n, k):
    """Two levels. Against the codes rebuilt here: y = sum_b d d_x S_b with S_b exact, within the fp32 steps' bound
    (K / 32 + 2) u per |term| (a kernel rounding a code another way, or dropping a block, is off by ~d_x |w| per
    value: far outside). Against fp64 on the reference dequantizer's values: within the module's bound, and more
    than 30x tighter than plain bf16 over 30 outputs or more (int16's step is ~1/70 of bf16's by RMS; the cases here
    measure 55x and up)."""
    t = GGML_TYPE_IDS[name]
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = blocks(name, n, k, g)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] *= 1e-3  # a block of small values next to large ones: scales per block, not per row
    y = int16_prefill.linear(x, w, t, k).double()

    c, dx = codes(x)
    q, d = weight_codes(w, name, k)
    s = np.einsum("mbk,nbk->mnb", c.reshape(m, -1, 32), q.reshape(n, -1, 32))  # exact integer sums S_b
    terms = d[None] * dx.astype(np.float64)[:, None] * s
    own = torch.from_numpy(terms.sum(-1))
    fp32_steps = torch.from_numpy((k / 32 + 2) * U * (1 + 2.0**-20) * np.abs(terms).sum(-1))
    assert ((y - own).abs() <= fp32_steps).all(), ((y - own).abs() / fp32_steps).max().item()

    dense = ggml.dense(w, t, k).double()
    err = (y - x.double() @ dense.T).abs()
    b = bound(x, dense)
    assert (err <= b).all(), (err / b).max().item()
    if m * n >= 30:  # a statistic of the largest errors: two outputs (2 x 1) measured 18x, from luck alone
        plain = (bf16_prefill.linear(x, dense.float()).double() - x.double() @ dense.T).abs()
        assert err.max() * 30 < plain.max(), (err.max().item(), plain.max().item())


@needs_units
@pytest.mark.parametrize("name", NAMES)
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(name):
    """Each row the same bits alone, in twos and threes (the weight rows read in place), in 4 (the 16-row panels), 8,
    13 and 16 rows and among 300 (two work items, a partial tile; on an AMX CPU from 4 rows on the AMX-INT8 tiles),
    on 1 or 2 threads; 70 weight rows end in a partial group of 16."""
    k = 544
    t = GGML_TYPE_IDS[name]
    g = torch.Generator().manual_seed(1)
    w, x = blocks(name, 70, k, g), torch.randn(300, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = int16_prefill.linear(x, w, t, k)
        torch.set_num_threads(1)
        y1 = int16_prefill.linear(x, w, t, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)
    for i, m in ((0, 1), (17, 3), (255, 2), (256, 1), (297, 3), (299, 1), (40, 4), (100, 8), (3, 13), (284, 16)):
        assert torch.equal(int16_prefill.linear(x[i : i + m], w, t, k), y[i : i + m]), (i, m)


@needs_units
def test_every_int16_type_takes_the_amx_int8_tiles_where_the_process_has_them():
    """Every int16 type's products of 4 rows and more run on the AMX-INT8 tiles where this process has them (each
    int16 code as its high and low byte: the same integers; Q8_0's codes read in place, the others' unpacked per
    block), no other type's, and the kernel plan's words say so; the bits are held to the VNNI kernels' (1-3 rows,
    the weight rows read in place) by the row-count tests above."""
    rows = 4 if native.tiles_granted() else 0
    assert all(int16_prefill.tile_rows(GGML_TYPE_IDS[n]) == rows for n in ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4"))
    assert all(int16_prefill.tile_rows(GGML_TYPE_IDS[n]) == 0 for n in ("Q4_K", "Q6_K", "F32"))
    assert ("amx-int8 tiles from 4 rows" in int16_prefill.detail()) == native.tiles_granted()


@needs_units
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_stays_in_its_row(bad):
    """A NaN or infinite activation makes its own row's outputs NaN and no other's (the engine's NaN checks name the
    request); a row of zeros (and of values below the floor) gives zeros."""
    k = 96
    w, x = case(2, 20, 40, k)
    x[3] = 0
    x[4] = 2.0**-110
    clean = int16_prefill.linear(x, w, Q8_0, k)
    assert not clean[3].any() and not clean[4].any()
    x[5, 7] = bad
    y = int16_prefill.linear(x, w, Q8_0, k)
    assert y[5].isnan().all()
    assert torch.equal(torch.cat([y[:5], y[6:]]), torch.cat([clean[:5], clean[6:]]))


@needs_units
@pytest.mark.parametrize("name", ["Q8_0", "Q5_0"])
def test_grouped_is_the_plain_product_per_group_and_part(name):
    """Experts of two parts (gate, up: stacks read in place), groups of 0, 1, 5, 17 and 300 rows (two work items;
    on an AMX CPU the groups of 17 and 300 on the tiles, padded to 16-row passes): each group's rows the plain product
    with its expert's rows of each part, bit for bit, in its columns, and a group's first and last row alone the same
    bits; routed through ggml.expert_linear_native with the INT16 setting."""
    t = GGML_TYPE_IDS[name]
    g = torch.Generator().manual_seed(3)
    e, i, k = 5, 24, 288
    gate = torch.stack([blocks(name, i, k, g) for _ in range(e)])
    up = torch.stack([blocks(name, i, k, g) for _ in range(e)])
    counts = [17, 0, 1, 300, 5]
    experts = torch.tensor([0, 2, 3, 4, 1])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g)
    ys = ggml.expert_linear_native(xs, (gate, up), t, k, experts, offs, bf16=bf16_prefill.INT16)
    lo = 0
    for a, c in zip(experts.tolist(), counts, strict=True):
        if c:
            want = torch.cat([int16_prefill.linear(xs[lo : lo + c], p[a], t, k) for p in (gate, up)], dim=1)
            assert torch.equal(ys[lo : lo + c], want), a
            for j in {0, c - 1}:  # a row alone (the weight rows read in place): the bits of every row count's path
                one = torch.cat([int16_prefill.linear(xs[lo + j : lo + j + 1], p[a], t, k) for p in (gate, up)], dim=1)
                assert torch.equal(ys[lo + j : lo + j + 1], one), (a, j)
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
    assert torch.equal(ggml.linear_native(x, w, Q8_0, k, bf16=bf16_prefill.INT16), int16_prefill.linear(x, w, Q8_0, k))


def test_the_setting_takes_them_where_no_amx_bf16_tiles_run(monkeypatch):
    """takes_bf16 under a cap below BF16_ALL: where the AMX-BF16 tiles run, Q8_0 the pairs and the 4-5 bit types plain
    bf16; else where the build has AVX512-VNNI, int16 for Q8_0 and for the 32-value block types the cap takes (Q5_0
    at cap 6, not at 4), plain bf16 for the K-quants; else Q8_0 fp32. Cap 0 (prefill_matmul "float") fp32 always,
    BF16_ALL plain bf16 always."""
    auto = 6
    q5_0, q4_k = GGML_TYPE_IDS["Q5_0"], GGML_TYPE_IDS["Q4_K"]
    for pairs, units, q8, q5 in (
        (True, True, bf16_prefill.BF16_PAIRS, bf16_prefill.BF16),
        (False, True, bf16_prefill.INT16, bf16_prefill.INT16),
        (False, False, bf16_prefill.FP32, bf16_prefill.BF16),
    ):
        monkeypatch.setattr(bf16_pairs, "granted", lambda p=pairs: p)
        monkeypatch.setattr(int16_prefill, "takes", lambda t, u=units: u and t in (Q8_0, q5_0))
        assert bf16_prefill.takes_bf16(Q8_0, auto) == q8
        assert bf16_prefill.takes_bf16(q5_0, auto) == q5
        assert bf16_prefill.takes_bf16(q5_0, 4) == bf16_prefill.FP32
        assert bf16_prefill.takes_bf16(q4_k, auto) == bf16_prefill.BF16
        for t in (Q8_0, q5_0):
            assert bf16_prefill.takes_bf16(t, 0) == bf16_prefill.FP32
            assert bf16_prefill.takes_bf16(t, bf16_prefill.BF16_ALL) == bf16_prefill.BF16


@needs_units
@pytest.mark.parametrize("name", NAMES)
def test_an_avx2_build_has_the_rows_with_the_same_bits(name, monkeypatch):
    """The same sources built without AVX512-VNNI (-mno-avx512vnni: an AVX2 CPU's kernels, x86/int16_rows.c): the
    products at every row count with the bits of this process's build (on an AVX512-VNNI CPU its rows and panels: the
    same integer sums and float steps), and no panels, so a prompt's products stay fp32 (takes_bf16); built without
    AVX2 too (no SIMD) the library has none and the call refuses."""
    t = GGML_TYPE_IDS[name]
    g = torch.Generator().manual_seed(11)
    k, n = 288, 37
    w = blocks(name, n, k, g)
    x = torch.randn(40, k, generator=g)
    x[5, 3:40] *= 1e4  # blocks of very different sizes, and one below the floor
    x[6, :32] = 2.0**-110
    mine = [int16_prefill.linear(x[:m], w, t, k) for m in (1, 2, 3, 16, 40)]
    with_build(monkeypatch, ("-mno-avx512vnni",))
    assert int16_prefill.takes_rows(t) and not int16_prefill.takes(t)
    assert int16_prefill.detail().startswith("avx2 int16 pair products (vpmaddwd)")
    for m, y in zip((1, 2, 3, 16, 40), mine, strict=True):
        assert torch.equal(int16_prefill.linear(x[:m], w, t, k), y), m
    assert bf16_prefill.takes_bf16(Q8_0, 6) == (bf16_prefill.BF16_PAIRS if bf16_pairs.granted() else bf16_prefill.FP32)
    with_build(monkeypatch, ("-mno-avx512f", "-mno-avx2", "-mno-f16c"))
    assert not any(int16_prefill.takes_rows(GGML_TYPE_IDS[n]) for n in NAMES)
    assert int16_prefill.detail() == f"none: {int16_prefill.NO_UNITS}"
    with pytest.raises(RuntimeError, match="rc -1"):
        int16_prefill.linear(x, w, t, k)


@needs_panels
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
    assert f"int16-activation prefill for Q8_0 ({int16_prefill.detail()}" in reasons
    a, b = fast.prompt_logits(ids), exact.prompt_logits(ids)
    act = ((a - b).norm() / b.norm()).item()
    file = ((b - exp["hf_logits"]).norm() / exp["hf_logits"].norm()).item()
    print(f"\n{name} q8_0: int16 activations add {act:.2e} to the logits; the file's own error {file:.4f}")
    assert 0 < act <= 0.57 / 32 * file, (act, file)
    assert torch.equal(a.argmax(-1), b.argmax(-1))

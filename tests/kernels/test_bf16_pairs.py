"""Q8_0 products on the AMX-BF16 tiles with the activations as bf16 pairs (kernels/bf16_pairs.py,
csrc/x86/amx_bf16.c), held to fp64 by the bound derived in the module (its notation), to batch and thread
independence, the grouped form to the plain one, and in the engine to the exact fp32 prefill of the same file. On a
CPU without AMX-BF16 (or a kernel refusing the tile state) the kernel tests skip and say so; the engine's choice there
is fp32 (test_prefill_bf16.py)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import bf16_pairs, bf16_prefill, ggml, native

STATUS = native.status()
needs_tiles = pytest.mark.skipif(
    not STATUS.available or not bf16_pairs.granted(),
    reason=f"no bf16 tiles here: {bf16_pairs.tiles_detail() if STATUS.available else STATUS.detail}",
)
Q8_0 = GGML_TYPE_IDS["Q8_0"]
U = 2.0**-8  # bf16's unit roundoff


def q8_0(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n rows of random Q8_0 blocks (fp16 scales of a few magnitudes, codes over the whole int8 range)."""
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    q = torch.randint(-128, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    return torch.cat([d.view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)], 2).reshape(n, -1).contiguous()


def case(seed: int, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, x): n random Q8_0 rows of k values and m activation rows, from the seed."""
    g = torch.Generator().manual_seed(seed)
    return q8_0(n, k, g), torch.randn(m, k, generator=g)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The module's bound per output: (u^2 + (K / 32 + 65) 2^-24 (1 + 2u)) sum_k |x_k| |w_k| (fp64)."""
    k = x.shape[1]
    c = U**2 + (k / 32 + 65) * 2.0**-24 * (1 + 2 * U)
    return c * (x.double().abs() @ w.double().abs().T)


@needs_tiles
@pytest.mark.parametrize(
    "m, n, k",
    [(17, 1, 32), (16, 33, 96), (33, 70, 288), (50, 31, 544), (48, 96, 2048)],  # odd rows, partial tiles, depth chunks
)
def test_products_within_the_derived_bound(m, n, k):
    """Against fp64 on the reference dequantizer's values: within the bound everywhere, and more than 100x tighter
    than plain bf16 (which the bound would not hold: a kernel that dropped the remainder x_l, or a block's scale,
    fails here)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = q8_0(n, k, g)
    dense = ggml.dense(w, Q8_0, k).double()
    x = torch.randn(m, k, generator=g) * 3
    y = bf16_pairs.linear(x, w, k).double()
    err = (y - x.double() @ dense.T).abs()
    b = bound(x, dense)
    assert (err <= b).all(), (err / b).max().item()
    plain = (bf16_prefill.linear(x, dense.float()).double() - x.double() @ dense.T).abs()
    assert err.max() * 100 < plain.max(), (err.max().item(), plain.max().item())


@needs_tiles
def test_a_rows_result_does_not_depend_on_the_batch_or_threads():
    """Each row the same bits alone, among 50 rows (a partial activation tile), and on 1 or 2 threads."""
    k = 544
    w, x = case(1, 50, 70, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the weight blocks shared by two threads, then one thread taking them all
        y = bf16_pairs.linear(x, w, k)
        torch.set_num_threads(1)
        y1 = bf16_pairs.linear(x, w, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, y1)
    for i in (0, 17, 49):
        assert torch.equal(bf16_pairs.linear(x[i : i + 1], w, k)[0], y[i])


@needs_tiles
def test_nan_stays_in_its_row():
    """A NaN activation makes its own row's outputs NaN and no other's (the engine's NaN checks name the request)."""
    k = 96
    w, x = case(2, 20, 40, k)
    clean = bf16_pairs.linear(x, w, k)
    x[5, 7] = float("nan")
    y = bf16_pairs.linear(x, w, k)
    assert y[5].isnan().all()
    assert torch.equal(torch.cat([y[:5], y[6:]]), torch.cat([clean[:5], clean[6:]]))


@needs_tiles
def test_grouped_is_the_plain_product_per_group_and_part():
    """Experts of two parts (gate, up: stacks read in place), groups of 0, 1, 17 and 70 rows: each group's rows the
    plain product with its expert's rows of each part, bit for bit, in its columns."""
    g = torch.Generator().manual_seed(3)
    e, i, k = 5, 24, 288
    gate = torch.stack([q8_0(i, k, g) for _ in range(e)])
    up = torch.stack([q8_0(i, k, g) for _ in range(e)])
    counts = [17, 0, 1, 70]  # mean 22 rows per expert: above GEMV_ROWS, the many-rows path
    experts = torch.tensor([0, 2, 3, 4])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g)
    ys = ggml.expert_linear_native(xs, (gate, up), Q8_0, k, experts, offs, bf16=bf16_prefill.BF16_PAIRS)
    lo = 0
    for a, c in zip(experts.tolist(), counts, strict=True):
        if c:
            want = torch.cat([bf16_pairs.linear(xs[lo : lo + c], p[a], k) for p in (gate, up)], dim=1)
            assert torch.equal(ys[lo : lo + c], want), a
        lo += c


@needs_tiles
def test_grouped_experts_of_many_rows_take_the_plain_order():
    """An expert whose split activations pass the grouped call's share (80 rows of 4096 values: 5 MB) runs the plain
    product's own loop after the one-region experts: each group still the plain product, bit for bit."""
    g = torch.Generator().manual_seed(5)
    e, n, k = 3, 40, 4096
    w = torch.stack([q8_0(n, k, g) for _ in range(e)])
    counts, experts = [3, 80, 20], torch.tensor([2, 0, 1])
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), k, generator=g)
    ys = bf16_pairs.grouped(xs, (w,), k, experts, offs)
    lo = 0
    for a, c in zip(experts.tolist(), counts, strict=True):
        assert torch.equal(ys[lo : lo + c], bf16_pairs.linear(xs[lo : lo + c], w[a], k)), a
        lo += c


@needs_tiles
def test_linear_native_takes_them_above_the_decode_rows():
    """ggml.linear_native with the BF16_PAIRS setting: decode-sized calls (<= GEMV_ROWS rows) are the decode kernels'
    bits, more rows the pairs'."""
    g = torch.Generator().manual_seed(4)
    k, n = 256, 48
    w = q8_0(n, k, g)
    x = torch.randn(ggml.GEMV_ROWS + 8, k, generator=g)
    small = x[: ggml.GEMV_ROWS]
    assert torch.equal(
        ggml.linear_native(small, w, Q8_0, k, bf16=bf16_prefill.BF16_PAIRS), native.gemm(Q8_0, small, w, k)
    )
    assert torch.equal(ggml.linear_native(x, w, Q8_0, k, bf16=bf16_prefill.BF16_PAIRS), bf16_pairs.linear(x, w, k))


@needs_tiles
@pytest.mark.parametrize("name", ["ds3", "ds2lite"])
def test_engine_q8_0_prefill_far_inside_the_files_own_error(name, monkeypatch):
    """A fixture's Q8_0 file under auto (fast bf16 forced on): its Q8_0 holders take the pairs (the plan says so) and
    a 96-token prefill's logits move from the exact fp32 prefill's by what the pairs add, against the file's own
    error (exact products vs transformers on the f32 weights). Plain bf16 adds 0.54-0.57x it (bf16_prefill.py); the
    pairs keep ~u = 2^-8 of plain bf16's error, so the bound is u * 0.57 x the file's (measured: see the print),
    with the same top-1 token everywhere."""
    from conftest import fixture_dir
    from safetensors.torch import load_file

    from mlaserve import LLM

    monkeypatch.setenv("MLASERVE_FAST_BF16", "1")
    folder = fixture_dir(name)
    exp = load_file(str(folder / "expected.safetensors"))
    ids = exp["input_ids"].tolist()
    path = str(folder / "model-q8_0.gguf")
    pairs, exact = LLM(path), LLM(path, prefill_matmul="float")
    reasons = " ".join(c.reason for c in pairs.loaded.kernel_plan.choices)
    assert (
        f"bf16-pair prefill for Q8_0 ({bf16_pairs.tiles_detail()}: exact codes, activations as bf16 pairs, fp32 grade)"
        in reasons
    )
    a, b = pairs.prompt_logits(ids), exact.prompt_logits(ids)
    act = ((a - b).norm() / b.norm()).item()
    file = ((b - exp["hf_logits"]).norm() / exp["hf_logits"].norm()).item()
    print(f"\n{name} q8_0: the pairs add {act:.2e} to the logits; the file's own error {file:.4f}")
    assert 0 < act <= U * 0.57 * file, (act, file)
    assert torch.equal(a.argmax(-1), b.argmax(-1))

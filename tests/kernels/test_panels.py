"""fp32 products of many rows on decoded weight panels (kernels/panels.py, csrc/x86/panels.c): held to fp64 on
gguf-py's dequantization by the bound derived in the module, to batch and thread independence, the grouped form
(parts side by side, empty groups, experts in any order) to one product per group, and the engine's exact prefill
path (kernels/ggml.py) to take them. On a build without AVX-512 they are absent (the decode-then-GEMM path runs:
test_expert_decode_buffer.py) and the kernel tests skip and say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kernels import gguf_py_dense, random_blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, panels

STATUS = native.status()
needs_panels = pytest.mark.skipif(
    not STATUS.available or not panels.available(),
    reason=f"no panel products in this build: {STATUS.detail if not STATUS.available else 'it has no AVX-512'}",
)
U = 2.0**-24  # fp32's unit roundoff


def gamma(n: int) -> float:
    """The classic bound on n roundings in a row: n u / (1 - n u)."""
    return n * U / (1 - n * U)


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The module's bound per output, made rigorous: each of 16 lanes sums K / 16 products by fused multiply-adds
    (K / 16 roundings), then 4 levels of additions join the lanes: gamma(K / 16 + 4) sum_k |x_k| |w_k| (fp64)."""
    return gamma(x.shape[1] // 16 + 4) * (x.double().abs() @ w.double().abs().T)


def _case(name: str, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n weight rows of k values (random fields; the i-quants' valid blocks reaching every grid entry, from
    tests/gguf) and m activation rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    if not name.startswith("IQ"):
        return random_blocks(name, n, k, g), x
    from test_gguf_iquants import iq_blocks

    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    return torch.from_numpy(iq_blocks(name, n * k // t.block_size, seed)).reshape(n, -1).contiguous(), x


@pytest.fixture(autouse=True)
def _gguf_tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "gguf"))


@needs_panels
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ3_S"])
@pytest.mark.parametrize("m, n, k", [(1, 3, 256), (7, 9, 512), (37, 70, 1024), (20, 8, 2304)])
def test_products_within_the_derived_bound(name, m, n, k):
    """Against fp64 on gguf-py's values: within gamma(K / 16 + 4) everywhere (odd row counts: a partial activation
    tile; n not a multiple of 4: a partial panel). A kernel that skipped a 16-value step or a panel row fails."""
    t = GGML_TYPE_IDS[name]
    w, x = _case(name, m, n, k, seed=m * 7 + n)
    dense = gguf_py_dense(w, name).double()
    y = panels.linear(x, w, t, k).double()
    err = (y - x.double() @ dense.T).abs()
    b = bound(x, dense)
    assert (err <= b).all(), f"{name}: error / bound up to {(err / b).max().item():.3g}"


@needs_panels
def test_a_rows_result_does_not_depend_on_the_batch_or_threads():
    """Each row the same bits alone, among 50 rows (partial tiles), among 130 rows of 6144 values (three chunks of
    at most 60 rows, three depth blocks of 2048 whose accumulators wait in the stash), and on 1 or 2 threads."""
    t = GGML_TYPE_IDS["Q8_0"]
    for m, n, k in ((50, 70, 544), (130, 9, 6144)):
        w, x = _case("Q8_0", m, n, k, seed=k)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            y = panels.linear(x, w, t, k)
            torch.set_num_threads(1)
            y1 = panels.linear(x, w, t, k)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(y, y1)
        for i in (0, 17, m - 1):
            assert torch.equal(panels.linear(x[i : i + 1], w, t, k)[0], y[i])


@needs_panels
def test_the_grouped_form_is_each_groups_product():
    """Routed experts: two parts (gate, up) side by side, experts out of order, an empty group; each group's rows
    equal the plain product of that expert's rows, part by part, bit for bit."""
    t, e, n, k = GGML_TYPE_IDS["Q4_K"], 5, 12, 512
    g = torch.Generator().manual_seed(11)
    gate, up = (random_blocks("Q4_K", n, k, g, lead=(e,)) for _ in range(2))
    experts = torch.tensor([3, 0, 4, 1])
    counts = [9, 0, 23, 2]
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(counts), 0).tolist()])
    xs = torch.randn(sum(counts), k, generator=g)
    ys = panels.grouped(xs, (gate, up), t, k, experts, starts)
    assert ys.shape == (sum(counts), 2 * n)
    for a, ex in enumerate(experts.tolist()):
        rows = xs[starts[a] : starts[a + 1]]
        if rows.shape[0] == 0:
            continue
        want = torch.cat([panels.linear(rows, gate[ex], t, k), panels.linear(rows, up[ex], t, k)], dim=1)
        assert torch.equal(ys[starts[a] : starts[a + 1]], want)


@needs_panels
def test_dense_products_take_them_up_to_panel_rows(monkeypatch):
    """A dense weight's fp32 product of more than GEMV_ROWS and up to ggml.PANEL_ROWS rows runs on the panels (the
    weight is not decoded), more rows decode-then-BLAS; both within the fp32 bound of fp64."""
    t, n, k = GGML_TYPE_IDS["Q8_0"], 24, 512
    w, x = _case("Q8_0", ggml.PANEL_ROWS + 1, n, k, seed=4)
    dense = gguf_py_dense(w, "Q8_0").double()
    decoded: list[int] = []
    plain = native.dequantize

    def counting(*args, **kwargs):
        decoded.append(1)
        return plain(*args, **kwargs)

    monkeypatch.setattr(native, "dequantize", counting)
    few = ggml.linear_native(x[: ggml.PANEL_ROWS], w, t, k)
    assert not decoded and torch.equal(few, panels.linear(x[: ggml.PANEL_ROWS], w, t, k))
    many = ggml.linear_native(x, w, t, k)
    assert decoded
    for y, rows in ((few, x[: ggml.PANEL_ROWS]), (many, x)):
        exact = rows.double() @ dense.T
        assert ((y.double() - exact).abs() <= 2 * k * U * (rows.double().abs() @ dense.abs().T)).all()


@needs_panels
def test_the_exact_prefill_path_takes_them(monkeypatch):
    """kernels/ggml.py's fp32 many-rows grouped products (bf16 off) run here, not a decoded copy of the experts:
    no expert is decoded, and the result is the panels' own."""
    t, e, n, k = GGML_TYPE_IDS["Q8_0"], 4, 16, 256
    g = torch.Generator().manual_seed(2)
    w = random_blocks("Q8_0", n, k, g, lead=(e,))
    experts = torch.arange(e)
    offs = torch.cumsum(torch.full((e,), 2 * ggml.GEMV_ROWS), 0).to(torch.int32)  # many rows per expert
    xs = torch.randn(int(offs[-1]), k, generator=g)

    def refuse(*args, **kwargs):
        raise AssertionError("the experts were decoded")

    monkeypatch.setattr(native, "dequantize_experts", refuse)
    ys = ggml.expert_linear_native(xs, w, t, k, experts, offs)
    starts = torch.nn.functional.pad(offs.to(torch.int64), (1, 0))
    assert torch.equal(ys, panels.grouped(xs, (w,), t, k, experts, starts))

"""A prefill's routed experts run in chunks of whole experts (GGUFExperts._grouped, ggml.MOE_CHUNK_BYTES): the
activations held at once are bounded by the chunk, not by the step's (token, expert) pairs, and every expert's
product has the rows it has unchunked, so the result is the unchunked one bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_decompressed_head_blocks import _torch_peak

from mlaserve.gguf.convert.writer import quantize_q8_0
from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import ggml, native
from mlaserve.quant.ggml_linear import GGUFExperts

STATUS = native.status()
Q8_0 = GGML_TYPE_IDS["Q8_0"]


def _experts(e: int, d: int, inter: int, kernel: str) -> GGUFExperts:
    g = torch.Generator().manual_seed(5)
    ex = GGUFExperts(d, e, inter, Q8_0, Q8_0, "cpu")
    ex.kernel = kernel
    with torch.no_grad():
        ex.gate_proj.copy_(quantize_q8_0(torch.randn(e * inter, d, generator=g)).view(e, inter, -1))
        ex.up_proj.copy_(quantize_q8_0(torch.randn(e * inter, d, generator=g)).view(e, inter, -1))
        ex.down_proj.copy_(quantize_q8_0(torch.randn(e * d, inter, generator=g) * 0.05).view(e, d, -1))
    return ex


def _route(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(t, 256, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, torch.rand(t, k, generator=g), idx


@pytest.mark.parametrize(
    "kernel", ["torch", pytest.param("native", marks=pytest.mark.skipif(not STATUS.available, reason="no native"))]
)
def test_chunked_experts_equal_one_chunk_and_bound_the_activations(kernel, monkeypatch):
    """Break checks: with the chunks' loop over the whole set of pairs at once the bound fails (the activations of
    all 1,536 pairs held together); a chunk that split an expert would change that expert's product rows."""
    e, d, inter, t, k = 16, 256, 128, 256, 6
    ex = _experts(e, d, inter, kernel)
    x, w, idx = _route(t, e, k)
    per_pair = 4 * (2 * d + 3 * inter)
    with torch.no_grad():
        whole = ex(x, w, idx)  # the default cap (32 MiB) holds all 1,536 pairs: one chunk
        cap = 200 * per_pair  # ~2 experts' pairs (96 each) per chunk
        monkeypatch.setattr(ggml, "MOE_CHUNK_BYTES", cap)
        runs = ex._pair_chunks(torch.unique(idx, return_counts=True)[1], idx.numel(), d)
        assert len(runs) >= 7 and all(hi - lo <= cap // per_pair for _, _, lo, hi in runs)
        assert [r[0] for r in runs[1:]] == [r[1] for r in runs[:-1]] and runs[-1][1] == e  # whole experts, in order
        chunked = ex(x, w, idx)
        peak = _torch_peak(lambda: ex(x, w, idx))
    assert torch.equal(chunked, whole)
    # held at once: the output and the sorted pairs' bookkeeping (t k: order, tokens, weights), one chunk's
    # activations, and the decoded weights of the experts in a product (at most every expert's gate_up: the torch
    # kernel decodes them all, the native one the chunk's)
    decoded = e * 2 * inter * d * 4
    bound = t * d * 4 + t * k * 8 * 4 + cap + decoded
    whole_pairs = t * k * per_pair  # what the unchunked step held: 1,536 pairs' activations
    assert peak <= bound < whole_pairs, (peak, bound, whole_pairs)


def test_a_heavy_expert_is_a_chunk_of_its_own(monkeypatch):
    """An expert with more pairs than a chunk holds is not split (its product keeps every row of its own)."""
    ex = _experts(4, 256, 128, "torch")
    per_pair = 4 * (2 * 256 + 3 * 128)
    monkeypatch.setattr(ggml, "MOE_CHUNK_BYTES", 10 * per_pair)
    counts = torch.tensor([3, 25, 4, 4])
    assert ex._pair_chunks(counts, 36, 256) == [(0, 1, 0, 3), (1, 2, 3, 28), (2, 4, 28, 36)]


def test_every_chunk_takes_the_path_of_the_whole_step(monkeypatch):
    """The native products pick decode-and-dot (tiles) or decode-then-GEMM by the mean rows per active expert; a
    chunk passes the step's mean, so a chunk of a few crowded experts does not switch paths (it did: 975 pairs over
    15 experts, 65 > 64, then ggml.TILE_ROWS, took the bf16 GEMMs in a 512-token prefill whose mean was 48)."""
    e, d, inter, t, k = 16, 256, 128, 256, 6
    ex = _experts(e, d, inter, "torch")
    x, w, idx = _route(t, e, k)
    monkeypatch.setattr(ggml, "MOE_CHUNK_BYTES", 200 * 4 * (2 * d + 3 * inter))
    means = []

    def product(xs, *args):
        means.append(args[-1])
        return ggml.expert_linear_torch(xs, *args)

    with torch.no_grad():
        ex._grouped(x, w, idx, product)
    assert len(means) >= 14 and set(means) == {t * k / e}

"""The native latent MQA kernel (blocks.c mls_latent_mqa) against a float64 softmax attention, at head counts
and widths that exercise its register blocks (8 heads per score pass, 4 heads x 16 values per output pass)
and every remainder: heads 1, 3, 6, 8, 12, 16, 20 per query, r and dr not multiples of 8 or 16, one or two
threads, masked keys, contexts longer than one tile of rows, a query with no allowed key (NaN),
queries read through q_index from strided views. The attention-backend harness covers the model's use;
this pins the kernel's own blocking. fp32 result within 2e-6 of the float64 one (outputs are O(1)).
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import native, native_layers

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")


def reference(q_lat, q_pe, q_index, cache, slots, mask, scale):
    q = torch.cat([q_lat, q_pe], dim=-1).double()[q_index]  # [B, Q, H, c]
    rows = cache.double()[slots]  # [B, L, c]
    s = torch.einsum("bqhc,blc->bqhl", q, rows) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.einsum("bqhl,blr->bqhr", s.softmax(-1), rows[..., : q_lat.shape[-1]])


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h", [1, 3, 6, 8, 12, 16, 20])
@pytest.mark.parametrize("r,dr", [(32, 8), (40, 12), (256, 64), (19, 6)])
@pytest.mark.parametrize("length", [37, 300])  # 300: the output pass runs over several tiles of rows
def test_native_latent_mqa_equals_float64(h, r, dr, threads, length):
    g = torch.Generator().manual_seed(h * 100 + r + dr)
    b, nq, t, n_slots = 2, 3, 7, 2 * length + 16
    dn = 5  # q_pe is a view into a wider tensor, as the model splits q
    q = torch.randn(t, h, dn + dr, generator=g)
    q_pe = q[..., dn:]
    q_lat = torch.randn(t, h, r + 3, generator=g)[..., :r]  # strided heads too
    q_index = torch.randint(0, t, (b, nq), generator=g)
    cache = torch.randn(n_slots, r + dr, generator=g)
    slots = torch.randperm(n_slots, generator=g)[: b * length].view(b, length).contiguous()
    mask = torch.rand(b, nq, length, generator=g) < 0.7
    mask[1, 2] = False  # a query with no allowed key
    scale = (r + dr) ** -0.5
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_layers.latent_mqa(q_lat, q_pe, q_index, cache, slots, mask, scale)
    finally:
        torch.set_num_threads(prev)
    want = reference(q_lat, q_pe, q_index, cache, slots, mask, scale)
    assert got[1, 2].isnan().all() and want[1, 2].isnan().all()
    ok = mask.any(-1)
    err = (got[ok].double() - want[ok]).abs().max().item()
    assert err <= 2e-6, err


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("h", [6, 12, 16, 22])
def test_native_latent_mqa_does_not_depend_on_the_batch(h, threads):
    """A query's result is bit-identical alone and inside a batch of 3, so speculative verification (1 + k
    queries) and decode (1) agree exactly. Over 300 rows (3 tiles) the kernel shares the work three ways: with
    fewer queries than threads by tiles (alone on 2-4 threads, the batch on 4: each tile's partial kept, then
    folded), else by queries (1 thread; the batch on 2-3), a query's heads split over the threads where queries
    are fewer than threads but the tiles are one: a head's arithmetic is the same in each."""
    g = torch.Generator().manual_seed(h + 10 * threads)
    r, dr, t, length = 40, 12, 3, 300
    q = torch.randn(t, h, r + dr, generator=g)
    cache = torch.randn(1000, r + dr, generator=g)
    slots = torch.randperm(1000, generator=g)[: 3 * length].view(3, length).contiguous()
    mask = torch.rand(3, 1, length, generator=g) < 0.8
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native_layers.latent_mqa(q[..., :r], q[..., r:], torch.arange(3).view(3, 1), cache, slots, mask, 0.1)
        for i in range(3):
            alone = native_layers.latent_mqa(
                q[..., :r], q[..., r:], torch.tensor([[i]]), cache, slots[i : i + 1].contiguous(), mask[i : i + 1], 0.1
            )
            assert torch.equal(alone[0], batch[i])
    finally:
        torch.set_num_threads(prev)


@needs_native
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("h", [1, 16, 20])
def test_native_latent_mqa_by_tiles_equals_float64(h, threads):
    """Fewer queries than threads over several tiles: the work is shared by tiles (partials kept, folded in order);
    the result within fp32 rounding of the float64 one, and a query with no allowed key NaN there too."""
    g = torch.Generator().manual_seed(h + threads)
    r, dr, length = 64, 16, 700  # 6 tiles of 128 rows, the last partial
    q_lat, q_pe = torch.randn(2, h, r, generator=g), torch.randn(2, h, dr, generator=g)
    cache = torch.randn(length + 50, r + dr, generator=g)
    slots = torch.randperm(length + 50, generator=g)[:length].view(1, length).expand(2, length).contiguous()
    mask = torch.rand(2, 1, length, generator=g) < 0.9
    mask[1] = False
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_layers.latent_mqa(q_lat, q_pe, torch.tensor([[0], [1]]), cache, slots, mask, 0.1)
    finally:
        torch.set_num_threads(prev)
    want = reference(q_lat, q_pe, torch.tensor([[0], [1]]), cache, slots, mask, 0.1)
    assert got[1].isnan().all()
    err = (got[0].double() - want[0]).abs().max().item()
    assert err <= 2e-6, err

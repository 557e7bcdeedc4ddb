"""The decompressed path expands K / V ([L, H, dn + dv] per request, sized by the context times every head) for
one group of heads at a time (attention/backends/blocks.head_blocks): the same output as the reference
backend, and torch's allocations during the call bounded by the workspace, not by L x H.

Shapes of the standard benchmark model's attention (16 heads, dn 128, dr 64, dv 128, r 256), one prompt chunk
after cached context, fp32.
"""

from __future__ import annotations

import torch

from mlaserve.attention.backends import BACKENDS, blocks, torch_backend
from mlaserve.attention.metadata import build_segment_tensors
from mlaserve.attention.router import route
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk

H, DN, DR, DV, R = 16, 128, 64, 128, 256
PS = 16
# fp32: both sides sum the same products in a different order (the reference in one einsum per part); the
# harness's bound (test_attention_backends.FP32_TOL, from 5.1e-7 measured over 8 seeds)
FP32_TOL = 1e-5


def _case(queries: int, context: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pages = -(-(queries + context) // PS)
    order = torch.randperm(pages, generator=g).tolist()  # scattered over the pool
    batch = ForwardBatch.build([SeqChunk("r0", tuple(range(queries)), context, tuple(order))], PS, 1, "cpu")
    plan = route(batch, "decompressed", False, None, torch.float32, "torch")
    (seg,) = [build_segment_tensors(batch, s) for s in plan.segments]
    q = torch.randn(queries, H, DN + DR, generator=g)
    cache = torch.randn(pages * PS, R + DR, generator=g)
    kv_b = torch.randn(H * (DN + DV), R, generator=g) * R**-0.5
    return q[..., :DN], q[..., DN:], cache, kv_b, seg


def _decompressed(backend, case):
    q_nope, q_pe, cache, kv_b, seg = case
    return backend.decompressed(q_nope, q_pe, cache, kv_b, seg, (DN + DR) ** -0.5, DN)


def test_head_groups_equal_the_reference(monkeypatch):
    """A workspace of ~3 heads' K / V at this context: groups of 3, 3, 3, 3, 3, 1 heads; every valid query row
    within fp32 rounding of the reference backend (which expands every head at once, in its own ops)."""
    case = _case(queries=24, context=100)
    length = case[4].kv_slots.shape[1]
    per_head = length * 4 * (2 * (DN + DV) + 2 * (DN + DR))
    monkeypatch.setattr(blocks, "WORKSPACE_BYTES", 3 * per_head)
    groups = []
    real = blocks.head_blocks
    monkeypatch.setattr(torch_backend, "head_blocks", lambda n, b: groups.append(real(n, b)) or groups[-1])
    got = _decompressed(BACKENDS["torch"], case)
    want = _decompressed(BACKENDS["reference"], case)
    assert [s.stop - s.start for s in groups[0]] == [3, 3, 3, 3, 3, 1]
    valid = case[4].q_valid
    err = (got[valid] - want[valid]).abs().max().item()
    assert err <= FP32_TOL, f"max abs diff {err:.3g} > {FP32_TOL}"


def _torch_peak(fn) -> int:
    """The most bytes torch's CPU allocator held at once during fn() above what it held on entry (the
    profiler's memory events: each allocation and free, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


def test_expansion_is_bounded_by_the_workspace(monkeypatch):
    """A 32-token chunk after 992 cached tokens (L = 1024): expanding every head at once holds [k_nope | v], K
    twice and V (16 x 3.5 MiB = 56 MiB); in groups, at most one group's (<= the workspace) plus one block of
    scores (<= the workspace) plus the step-sized tensors (rows, q, the output parts), whatever L x H is."""
    workspace = 4 * 2**20
    monkeypatch.setattr(blocks, "WORKSPACE_BYTES", workspace)
    queries, context = 32, 992
    case = _case(queries, context)
    length = case[4].kv_slots.shape[1]
    per_head = length * 4 * (2 * (DN + DV) + 2 * (DN + DR))
    all_heads = H * per_head
    rows = length * (R + DR) * 4
    q_bytes = 2 * queries * H * (DN + DR) * 4  # cat([q_nope, q_pe]) and its [B, Q] gather
    out_bytes = 3 * queries * H * DV * 4  # the query blocks' parts, their cat, the groups' cat
    bound = 2 * max(workspace, per_head) + rows + q_bytes + out_bytes
    assert all_heads > 4 * bound  # the unblocked expansion alone would break the bound (the test can fail)
    peak = _torch_peak(lambda: _decompressed(BACKENDS["torch"], case))
    assert peak <= bound, f"torch held {peak / 2**20:.1f} MiB at once > bound {bound / 2**20:.1f} MiB"

"""DeepSeek-V4 identities that need no reference: CSA's sparse selection equals dense attention over the
visible compressed rows whenever they fit in index_topk; the state's snapshot continues exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from v4_models import build_hf_v4, ours_from_hf  # noqa: E402

from mlaserve.models.deepseek_v4.indexer import visible_rows  # noqa: E402


def _record_selections(model):
    seen = []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            original = comp.indexer.choose  # what attention calls per sequence

            def choose(q, weights, positions, *rest, _orig=original, _ratio=comp.ratio):
                mask = _orig(q, weights, positions, *rest)
                seen.append((mask, visible_rows(positions, mask.shape[1], _ratio)))
                return mask

            comp.indexer.choose = choose
    return seen


def test_sparse_equals_dense_when_the_rows_fit_in_topk():
    ids = torch.tensor([0, *range(5, 33)])  # 29 tokens: 7 CSA rows, all within index_topk=64
    model = ours_from_hf(build_hf_v4("all_kinds", seed=1, index_topk=64))
    seen = _record_selections(model)
    state = model.new_state(len(ids))
    with torch.no_grad():
        for i in range(0, len(ids), 3):
            model(ids[i : i + 3], state)
    assert seen and any(m.shape[1] >= 7 for m, _ in seen)
    for mask, visible in seen:
        assert torch.equal(mask, visible)
    # and with index_topk below the visible rows the selection is a strict subset (the sweep's configs)
    model = ours_from_hf(build_hf_v4("all_kinds", seed=1))  # index_topk 3
    seen = _record_selections(model)
    with torch.no_grad():
        model(ids, model.new_state(len(ids)))
    (mask, visible), *_ = seen
    assert torch.equal(mask & ~visible, torch.zeros_like(mask))
    assert int(mask.sum(-1).max()) == 3 and int(visible.sum(-1).max()) == 7


def test_a_snapshot_continues_exactly():
    """clone() is what preemption or a prefix-cache hit must restore: continuing from it equals continuing
    the original state, bit for bit (same operations on the same values)."""
    model = ours_from_hf(build_hf_v4("all_kinds", seed=1))
    ids = torch.tensor([0, *range(5, 27)])
    state = model.new_state(len(ids))
    with torch.no_grad():
        model(ids[:13], state)  # mid-window for CSA (13 % 4) and HCA (13 % 8)
        snap = state.clone()
        a = model(ids[13:], state)
        b = model(ids[13:], snap)
    assert torch.equal(a, b)


def test_a_token_outside_the_vocabulary_is_named_and_leaves_the_state_alone():
    model = ours_from_hf(build_hf_v4("hc2_learned", seed=1))
    state = model.new_state(8)
    with pytest.raises(ValueError, match=r"token id 96 at chunk index 2 \(position 2\) is outside the vocabulary"):
        model(torch.tensor([0, 5, 96]), state)
    assert state.length == 0


def test_grouped_experts_equal_the_loop_reference():
    """The grouped-GEMM experts (the default where rows align) against the per-expert loop, clamps binding."""
    model = ours_from_hf(build_hf_v4("all_kinds", seed=1))
    experts = model.model.layers[1].mlp.experts
    assert experts.impl == "grouped_mm"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(37)])
    w = torch.rand(37, 2, generator=g)
    with torch.no_grad():
        grouped = experts(x, w, idx)
        loop = experts._forward_loop(x, w, idx)
    # fp32, the same products summed in another grouping: measured ~1e-7 at |y| ~ 1
    assert (grouped - loop).abs().max().item() <= 1e-5
    assert ours_from_hf(build_hf_v4("hc2_learned", seed=1)).model.layers[0].mlp.experts.impl == "loop"  # hidden 35

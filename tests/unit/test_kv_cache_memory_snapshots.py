"""kv_cache_memory on stacks with page-boundary snapshots (Kimi-Linear's KDA states): with prefix caching on the
cache keeps one snapshot row per page of every snapshotted request state, allocated per page like the paged
rows, so the pool's size in pages must count them or the budget is overrun (measured before the fix: 5.3x the
budget in float32, 9.8x with int8 rows, on this tiny model). Every per-page byte (paged rows, their pad rows
aside, and snapshot rows) is counted from the allocated tensors and must fit the budget, filling it to within
one page."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kimi_linear_models import save_hf_kimi  # noqa: E402

from mlaserve import LLM  # noqa: E402

GIB = 0.001


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi_mem")
    save_hf_kimi("kda_mla_kda", folder)
    return folder


def _per_page_bytes(cache) -> tuple[int, int]:
    """(bytes of the pages, bytes of one page) as allocated: every paged state's rows and every snapshot row,
    each tensor's fixed pad row left out."""
    total = 0
    for layer in cache.layers:
        for s in layer.kind.paged:
            t = layer.tensors[s.name]
            parts = t.tensors() if hasattr(t, "tensors") else (t,)
            total += sum((p.shape[0] - 1) * p[0].numel() * p.element_size() for p in parts)
    for _, snap in cache.snapshot_pairs():
        total += (snap.shape[0] - 1) * snap[0].numel() * snap.element_size()
    return total, total // cache.num_pages


@pytest.mark.parametrize("codes", ["auto", "int8"])
@pytest.mark.parametrize("prefix", [True, False])
def test_the_pool_fits_the_budget_with_its_snapshot_rows(kimi, codes, prefix):
    llm = LLM(str(kimi), kv_cache_memory=GIB, enable_prefix_caching=prefix, kv_cache_dtype=codes)
    cache = llm.runner.cache
    assert cache.keeps_snapshots is prefix
    total, page = _per_page_bytes(cache)
    budget = int(GIB * 2**30)
    assert total <= budget < total + page, (total, page, budget)
    (pages,) = [s for s in llm.config.provenance if s.name == "num_pages"]
    assert ("page-boundary snapshots" in pages.source) is prefix, pages.source

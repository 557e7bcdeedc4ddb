"""GLM-5.3-Flash's pooled DSA indexer (models/pooled_indexer.py) against transformers 5.24's Glm5NextTextIndexer on
the same weights: the pooled keys, and per query the kept tokens (top index_topk // kpool pools expanded, plus
the incomplete tail), for kpool 2 and 4, index head counts 3 and 5, a 37-token sequence (pools complete and not,
selection partial: more pools complete than kept), pools computed chunk by chunk == all at once.

Bounds: pooled keys 1e-6 max abs (magnitude ~3, fp32, the same softmax and sum; measured 0); the tail tokens and
the number of kept pools equal exactly; the kept pools equal exactly wherever the cut is not inside a tie, and
their scores equal where it is (ReLU gives exact ties at 0 between pools no head scores positively, and either
side of such a tie is a right answer). Broken on purpose: the ape added after the softmax, the tail dropped,
or a pool selectable one token before it is complete: each changes the sets or the keys.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.config.model import IndexerConfig
from mlaserve.models.pooled_indexer import PooledIndexer

tf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

HIDDEN, QLORA, DI, N = 40, 24, 16, 37


def _pair(kpool: int, heads: int, topk: int, seed: int):
    from transformers import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        hidden_size=HIDDEN,
        q_lora_rank=QLORA,
        index_n_heads=heads,
        index_head_dim=DI,
        index_topk=topk,
        index_kpool=kpool,
    )
    ref = tf.Glm5NextTextIndexer(cfg, 0).eval()
    ours = PooledIndexer(HIDDEN, QLORA, IndexerConfig(heads, DI, topk, False, ("full",), kpool=kpool))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            value = torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 1.0)
            p.copy_(value)
            ours.get_parameter(name).copy_(value)
    return ref, ours


@pytest.mark.parametrize("kpool, heads, topk", [(2, 3, 8), (4, 5, 12), (4, 3, 64), (3, 6, 9)])
def test_kept_tokens_equal_transformers(kpool, heads, topk):
    ref, ours = _pair(kpool, heads, topk, seed=kpool * 10 + heads)
    g = torch.Generator().manual_seed(7)
    x, c_q = torch.randn(N, HIDDEN, generator=g), torch.randn(N, QLORA, generator=g)
    with torch.no_grad():
        want = ref(x[None], c_q[None], torch.ones(1, N, dtype=torch.bool), None)[0]  # [N, width], -1 = none
        q, k, gate, w = ours.project(x, c_q)
        whole = N // kpool * kpool
        pooled = ours.pool(k[:whole], gate[:whole])
        # chunk by chunk, as the engine keeps them: each pool once, when complete
        pieces = [ours.pool(k[a : a + kpool], gate[a : a + kpool]) for a in range(0, whole, kpool)]
        sel = ours.select(q, w, pooled, torch.arange(N))
        packed = torch.cat([k, gate, torch.ones(N, 1)], dim=-1)[None]
        ref_pooled = ref.get_pooled_states(packed)[0][0]
    assert (pooled - ref_pooled).abs().max().item() <= 1e-6
    assert torch.equal(torch.cat(pieces), pooled)
    scores = torch.einsum("qh,qhn->qn", w, torch.relu(torch.einsum("qhd,nd->qhn", q, pooled) * DI**-0.5))
    exact = 0
    for t in range(N):
        got = sorted(sel.index[t][sel.valid[t]].tolist())
        exp = sorted(i for i in want[t].tolist() if i >= 0)
        tail_start = t + 1 - (t + 1) % kpool
        assert (
            [i for i in got if i >= tail_start] == [i for i in exp if i >= tail_start] == list(range(tail_start, t + 1))
        )
        assert sel.tail[t] == (t + 1) % kpool
        ours_pools = sorted({i // kpool for i in got if i < tail_start})
        ref_pools = sorted({i // kpool for i in exp if i < tail_start})
        assert all(set(range(p * kpool, p * kpool + kpool)) <= set(exp) for p in ref_pools)  # whole pools
        assert len(ours_pools) == len(ref_pools) == sel.pools_selected[t] == min(topk // kpool, (t + 1) // kpool)
        # ReLU makes exact ties (several pools at score 0); where the cut falls inside a tie either pick is
        # right, so the kept pools' scores are compared, and the pools themselves wherever there is no tie
        assert scores[t, ours_pools].sort().values.tolist() == scores[t, ref_pools].sort().values.tolist(), t
        n = (t + 1) // kpool
        keep = len(ref_pools)
        s_sorted = scores[t, :n].sort(descending=True).values
        if keep == n or s_sorted[keep - 1] > s_sorted[keep]:
            assert ours_pools == ref_pools, f"query {t}: kept pools {ours_pools}, transformers {ref_pools}"
            exact += 1
    assert exact >= N // 2, "most queries were meant to have no tie at the cut"
    partial = topk // kpool < N // kpool  # (4, 3, 64): every complete pool kept, the rest partial
    assert bool((sel.pools_selected < sel.pools_scored).any()) == partial


@pytest.mark.parametrize("kpool, page", [(2, 8), (4, 16), (4, 4)])
@pytest.mark.parametrize("budget", [1, 3, 5, 64])
def test_pools_written_chunk_by_chunk_into_pages_equal_one_pass(kpool, page, budget):
    """Each chunk pools the pools it completes (completed_pools) into their paged rows (pool_rows) through a
    scattered block table; read back in pool order they equal pool() over the whole sequence, bit for bit."""
    from mlaserve.attention.pooled_metadata import completed_pools, pool_rows
    from mlaserve.cache.model_cache import ModelCache
    from mlaserve.config.layer_kinds import LayerKind, check_page_size, pooled_indexer_states

    _, ours = _pair(kpool, 3, 8, seed=1)
    n, num_pages = 45, 16
    x, c_q = torch.randn(n, HIDDEN), torch.randn(n, QLORA)
    kinds = (LayerKind(0, "mla_dsa", "pooled", pooled_indexer_states(DI, kpool)),)
    check_page_size(kinds, page)
    cache = ModelCache(kinds, num_pages, page, torch.float32)
    pools = cache.layers[0].tensors["index_pools"]
    table = tuple(reversed(range(num_pages)))[: -(-n // page)]  # pages out of order
    with torch.no_grad():
        _, k, gate, _ = ours.project(x, c_q)
        for a in range(0, n, budget):
            b = min(a + budget, n)
            done = completed_pools(a, b, kpool)
            if done:
                # a completed pool's tokens may be in earlier chunks: the [k | gate] rows are cached per token
                lo, hi = done.start * kpool, done.stop * kpool
                rows = torch.tensor(pool_rows(table, done, page, kpool))
                pools.index_copy_(0, rows, ours.pool(k[lo:hi], gate[lo:hi]))
        whole = ours.pool(k[: n // kpool * kpool], gate[: n // kpool * kpool])
    read = pools[torch.tensor(pool_rows(table, range(n // kpool), page, kpool))]
    assert torch.equal(read, whole)


def test_a_page_must_hold_whole_pools():
    from mlaserve.config.layer_kinds import LayerKind, check_page_size, pooled_indexer_states
    from mlaserve.config.model import ConfigError

    kinds = (LayerKind(3, "mla_dsa", "pooled", pooled_indexer_states(DI, 4)),)
    with pytest.raises(ConfigError, match="layer 3's index_pools keeps one row per 4 tokens; page_size must be"):
        check_page_size(kinds, 6)

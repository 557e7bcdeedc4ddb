"""Selection pins: a DSA indexer's top-k made to decide alike in the two runs of an identity.

Why: the top-k is discontinuous. Two keys whose scores lie within fp32 noise of each other at the k-th place swap
in or out when the scores' sums run in another order, and two routes of one prompt do run them in other orders:
one pass, chunks and token by token multiply matrices of different row counts (the q and keys entering the scores
then differ in their last bits), and the native backend's C scorer sums its heads in another order than the
reference's einsum. One swapped row then moves the attention output, and a random-weight model carries that
through its layers: `verify --index-topk 64` on the DSA benchmark model's Q8_0 file failed "native vs reference
backend, sparse top-64" at max|diff| 9.7e-2, top-1 100%, with a 192-word prompt (seen 2026-12-06), a near-tie no
fp32 tolerance holds. So the identity is kept exact modulo the top-k's decisions at ties, and the queries whose
decision was pinned are counted (the same scheme as DeepSeek-V4's rounding pins, verify_v4_pins.py):

Notation (per DSA indexer layer; per query at position t that selects: more allowed keys than k)
  s [L]      this run's scores of the query's keys, fp32 (sum_h w_h ReLU(q_h . key_p), the reference's formula)
  m [L]      sum_h |w_h| sum_d |q_hd key_pd|: the magnitude those fp32 sums round at
  A, B       the positions this run keeps, the recorded run's (sets of k)
  s_k        the k-th largest of s
  pin        A != B and every p in A xor B has |s_p - s_k| <= DELTA * m_p: B is a top-k of this run's scores up
             to fp32 noise
  out        B where pin, else A

A fault the identity exists to catch (a wrong key row read, a wrong position's mask, q from another token) moves the
scores far beyond DELTA, so the swapped positions are not near the k-th score and nothing is pinned: the logits
differ as before. DELTA = 1e-5 is the project's fp32 bound (reassociation over a few hundred products moves a sum
by ~1e-7 of its magnitude; q and keys from another schedule by up to ~1e-6).

Pins need each selection to be seen: the fused decode step (quant/ggml_layer.decode_step) selects inside one C call,
so a pinned run takes the per-op decode layers (held equal to the fused step by the suite): verify's token-by-token
check says so when it pinned. GLM-5.3-Flash's pooled indexer (models/pooled_indexer.py) is pinned the same way, its
decision the kept pools (s, m over the query's complete pools; its selection rebuilt from the pinned pools by
PooledIndexer.expand). DeepSeek-V4's CSA indexer is not pinned here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mlaserve.attention.backends.blocks import gather_rows
from mlaserve.models.indexer import Indexer, Selection
from mlaserve.models.pooled_indexer import PooledIndexer

DELTA = 1e-5


def scores_and_magnitudes(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Hi, Di], w [Hi] (Di^-0.5 folded in), keys [L, Di] -> (s [L], m [L]) of the notation, fp32."""
    q, w, keys = q.float(), w.float(), keys.float()
    s = (keys @ q.T).relu() @ w
    m = (keys.abs() @ q.abs().T) @ w.abs()
    return s, m


def swap_gap(s: torch.Tensor, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float | None:
    """s, m [L] of one query; a, b its kept positions in this run and the recorded one -> the widest
    |s_p - s_k| / m_p over the positions kept by one run alone (None: both kept the same)."""
    swapped = torch.tensor(sorted(set(a.tolist()) ^ set(b.tolist())), dtype=torch.long)
    if swapped.numel() == 0:
        return None
    kth = s[a].min()  # a is this run's top-k: its smallest kept score is the k-th largest
    return ((s[swapped] - kth).abs() / m[swapped].clamp(min=torch.finfo(torch.float32).tiny)).max().item()


def pin_query(s: torch.Tensor, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor, delta: float = DELTA) -> bool:
    """Whether b may stand for a: they differ, and every position kept by one run alone lies within delta * m of the
    k-th score."""
    gap = swap_gap(s, m, a, b)
    return gap is not None and gap <= delta


def _indexers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (Indexer, PooledIndexer))]


def _selecting(seg, topk: int) -> torch.Tensor:
    """[B, Q] the queries that select (more allowed keys than topk)."""
    return seg.q_valid & (seg.mask.sum(-1) > topk)


def _kept_pools(m: PooledIndexer, sel, positions: torch.Tensor, n: int):
    """A pooled selection's decision per query, flat over the leading dims: (positions [R], kept pools [R, k], which
    are complete [R, k], the selecting queries' rows (more complete pools than k), k)."""
    p = m.cfg.kpool
    k = min(m.cfg.topk // p, n)
    top, chosen = sel.index[..., : k * p : p] // p, sel.valid[..., : k * p : p]
    pos = positions.reshape(-1)
    return pos, top.reshape(-1, k), chosen.reshape(-1, k), ((pos + 1) // p > k).nonzero().flatten().tolist(), k


def _pin(stats: dict, want: torch.Tensor | None, got: torch.Tensor, scored) -> bool:
    """Whether this query takes the recorded choice want (the notation's pin), counted in stats; scored() -> (s, m)
    of the query, asked only where the two differ."""
    if want is None or want.shape != got.shape:
        stats["unrecorded"] += 1
    elif not torch.equal(want, got):
        gap = swap_gap(*scored(), got, want)
        if gap <= DELTA:
            stats["pinned"], stats["gap"] = stats["pinned"] + 1, max(stats["gap"], gap)
            return True
        stats["differ"] += 1
    return False


@contextmanager
def recorded(model: nn.Module) -> Iterator[dict]:
    """-> {indexer: {position t: kept positions (DSA) or pools (pooled), sorted, of the selecting query at t}} of the
    runs inside the block (one sequence: the key axis is the sequence's positions)."""
    log: dict[nn.Module, dict[int, torch.Tensor]] = {m: {} for m in _indexers(model)}

    def wrap(m: nn.Module) -> Callable:
        def select(q, w, keys, seg, topk, backend) -> Selection:
            sel = type(m).select(m, q, w, keys, seg, topk, backend)
            for b, j in _selecting(seg, topk).nonzero().tolist():
                log[m][int(seg.q_pos[b, j])] = sel.index[b, j][sel.valid[b, j]].sort().values
            return sel

        def select_pools(q, w, pooled, positions):
            sel = type(m).select(m, q, w, pooled, positions)
            pos, top, chosen, rows, _ = _kept_pools(m, sel, positions, pooled.shape[-2])
            for i in rows:
                log[m][int(pos[i])] = top[i][chosen[i]].sort().values
            return sel

        return select_pools if isinstance(m, PooledIndexer) else select

    with _installed(log, wrap):
        yield log


@contextmanager
def pinned(model: nn.Module, log: dict) -> Iterator[dict]:
    """Runs inside the block take the recorded run's selection where the notation's pin holds -> stats: queries
    pinned, queries whose selection differed and was not pinned (`differ`), the widest |s_p - s_k| / m_p of a
    pinned swap, and `unrecorded` (selecting queries the record has not: nothing pinned there)."""
    stats = {"pinned": 0, "differ": 0, "gap": 0.0, "unrecorded": 0}

    def wrap(m: nn.Module) -> Callable:
        def select(q, w, keys, seg, topk, backend) -> Selection:
            sel = type(m).select(m, q, w, keys, seg, topk, backend)
            index = sel.index.clone()
            for b, j in _selecting(seg, topk).nonzero().tolist():
                want, got = log[m].get(int(seg.q_pos[b, j])), sel.index[b, j][sel.valid[b, j]].sort().values
                t = seg.q_index[b, j]

                def scored(b=b, t=t):
                    rows = gather_rows(keys, seg.kv_slots[b : b + 1])[0]
                    return scores_and_magnitudes(q[t], w[t] * m.cfg.head_dim**-0.5, rows)

                if _pin(stats, want, got, scored):
                    index[b, j, : want.shape[0]] = want
            return Selection(index, seg.mask.gather(2, index))

        def select_pools(q, w, pooled, positions):
            sel = type(m).select(m, q, w, pooled, positions)
            n = pooled.shape[-2]
            pos, top, chosen, rows, k = _kept_pools(m, sel, positions, n)
            top, chosen = top.clone(), chosen.clone()
            qs, ws, per_seq = q.reshape(-1, *q.shape[-2:]), w.reshape(-1, w.shape[-1]), positions.shape[-1]
            for i in rows:
                t, keys = int(pos[i]), pooled if pooled.dim() == 2 else pooled[i // per_seq]

                def scored(i=i, t=t, keys=keys):  # the query's complete pools: the ones either run may keep
                    complete = (t + 1) // m.cfg.kpool
                    return scores_and_magnitudes(qs[i], ws[i] * m.cfg.head_dim**-0.5, keys[:complete])

                want = log[m].get(t)
                if _pin(stats, want, top[i][chosen[i]].sort().values, scored):
                    top[i], chosen[i] = want, True
            return m.expand(top.view(*positions.shape, k), chosen.view(*positions.shape, k), positions, n)

        return select_pools if isinstance(m, PooledIndexer) else select

    with _installed(log, wrap), per_op_decode(model):
        yield stats


@contextmanager
def _installed(log: dict, wrap: Callable) -> Iterator[None]:
    try:
        for m in log:  # an instance attribute over the method, for this block only
            m.select = wrap(m)
        yield
    finally:
        for m in log:
            vars(m).pop("select", None)


@contextmanager
def per_op_decode(model: nn.Module) -> Iterator[None]:
    """The model's decode steps layer by layer (the fused C step selects where no pin can see it)."""
    fused = getattr(model, "native_decode", None)
    try:
        if fused is not None:
            model.native_decode = None
        yield
    finally:
        if fused is not None:
            model.native_decode = fused


def has_fused_decode(model: nn.Module) -> bool:
    """Whether the model's decode steps run fused (the native layers' one call), which a pinned run sets aside."""
    return getattr(model, "native_decode", None) is not None


def has_selections(log: dict | None) -> bool:
    return bool(log) and any(log.values())


def describe(stats: dict) -> str:
    parts = []
    if stats["pinned"]:
        parts.append(
            f"{stats['pinned']} selecting queries pinned to the recorded top-k (swapped keys' scores within "
            f"{stats['gap']:.2g} x their magnitude of the k-th)"
        )
    if stats["differ"]:
        parts.append(f"{stats['differ']} selections differ beyond fp32 noise")
    if stats["unrecorded"]:
        parts.append(f"{stats['unrecorded']} selecting queries not in the record: none pinned there")
    return "; ".join(parts)  # "": every top-k decided alike


def pinned_run(model: nn.Module, log: dict | None, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, str]:
    """run() with the recorded run's selections pinned (no selections recorded: as it is) -> (its result, what was
    pinned; "" when nothing was recorded)."""
    if not has_selections(log):
        return run(), ""
    with pinned(model, log) as stats:
        out = run()
    return out, describe(stats)

"""Rounding pins: DeepSeek-V4's official roundings, made to decide alike in the two runs of an identity.

Why: the official roundings (models/deepseek_v4/official.py: FP8 e4m3 of a K=V row's non-rope part, FP4 of the
indexer's rotated rows) are discontinuous. A value within fp32 noise of a rounding boundary (the midpoint of
two codes, or a block amax at a power of two where the scale doubles) lands one code away when its fp32 sums
run in another order, and two schedules of one prompt (one pass, chunks, token by token) multiply matrices of
different row counts, for which BLAS picks different kernels. On an Intel Xeon with AVX-512 / AMX the rows a
rounding receives differ between the schedules in their last bits (measured: <= 1.9e-6 on rows of norm ~1);
on an AMD EPYC they came out bit for bit. Measured there (tests/identities/test_deepseek_v4_official_engine.py's
model): 14-200 FP8 codes per layer one step apart between a 9-token-chunked and a one-pass prefill of 30
tokens, the logits 6.4e-3 apart; the first flipped values lay 1e-7..3e-7 either side of a midpoint. No fp32
tolerance holds that, and making the rows bit-exact would take every GEMM upstream (all layers) computed the
same way for any row count. So the identity is kept exact modulo the rounding's decisions, and the decisions
that differ are counted:

Notation (per rounding module, rows in the order the module is called; the two runs round the same rows)
  a [R, D]   this run's rows entering the rounding;  b [R, D]  the recorded run's rows at the same places
  q          the columns the rounding changes (FP8: the non-rope part; FP4: all)
  near_r     max_q |a_r - b_r| <= DELTA           (the row is the same row up to fp32 noise)
  pin        near_r and round(a)_rq != round(b)_rq (a boundary lies between a and b)
  out        round(b) where pin, else round(a)    (the recorded run's decision; both through the same code)

A fault the identity exists to catch (a wrong row read, a carry resumed wrong, a snapshot of the wrong page)
moves the rows it touches far beyond DELTA (>= 1e-2 measured), so they are not pinned and the logits differ
as before; nor is a wrong rounding hidden, since the pinned value is the same rounding's output at the other
run's input. DELTA = 1e-5 is the project's fp32 bound, 5x the largest pre-rounding difference measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mlaserve.models.deepseek_v4.official import FP8KVRows, HadamardFP4Rows

DELTA = 1e-5


def rounded_columns(module: nn.Module, width: int) -> int:
    """The leading columns a rounding module changes (the rest pass through)."""
    return module.fmt.quantized if isinstance(module, FP8KVRows) else width


def pin(a: torch.Tensor, b: torch.Tensor, ra: torch.Tensor, rb: torch.Tensor, q: int, delta: float = DELTA):
    """a, b [R, D] the rows entering a rounding, ra, rb their roundings -> (out [R, D], pinned values, the
    widest |a - b| of a pinned row)."""
    near = (a[:, :q] - b[:, :q]).abs().amax(dim=-1, keepdim=True) <= delta
    flip = torch.zeros_like(ra, dtype=torch.bool)
    flip[:, :q] = near & (ra[:, :q] != rb[:, :q])
    rows = flip.any(dim=-1)
    gap = (a[rows, :q] - b[rows, :q]).abs().max().item() if rows.any() else 0.0
    return torch.where(flip, rb, ra), int(flip.sum()), gap


def _roundings(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (FP8KVRows, HadamardFP4Rows))]


@contextmanager
def recorded(model: nn.Module) -> Iterator[dict]:
    """-> {module: [rows [R, D] entering it, per call]} of the runs inside the block."""
    log: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in _roundings(model)}

    def wrap(m: nn.Module):
        def forward(rows: torch.Tensor) -> torch.Tensor:
            log[m].append(rows.detach().reshape(-1, rows.shape[-1]).clone())
            return type(m).forward(m, rows)

        return forward

    try:
        for m in log:  # an instance attribute over the method, for this block only
            m.forward = wrap(m)
        yield log
    finally:
        for m in log:
            vars(m).pop("forward", None)


@contextmanager
def pinned(model: nn.Module, log: dict) -> Iterator[dict]:
    """Runs inside the block take the recorded run's decisions (notation above) -> stats: pinned values, the
    widest gap of a pinned row, and `unaligned` (a module rounded rows the record has not: nothing pinned there)."""
    stats = {"pinned": 0, "gap": 0.0, "unaligned": 0}
    ref = {m: torch.cat(rows) if rows else None for m, rows in log.items()}
    cursor = dict.fromkeys(log, 0)

    def wrap(m: nn.Module):
        def forward(rows: torch.Tensor) -> torch.Tensor:
            a = rows.reshape(-1, rows.shape[-1])
            ra = type(m).forward(m, a)
            c, n = cursor[m], a.shape[0]
            cursor[m] = c + n
            if ref[m] is None or c + n > ref[m].shape[0] or ref[m].shape[1] != a.shape[1]:
                stats["unaligned"] += n
                return ra.view(rows.shape)
            b = ref[m][c : c + n]
            out, count, gap = pin(a, b, ra, type(m).forward(m, b), rounded_columns(m, a.shape[1]))
            stats["pinned"] += count
            stats["gap"] = max(stats["gap"], gap)
            return out.view(rows.shape)

        return forward

    try:
        for m in log:
            m.forward = wrap(m)
        yield stats
    finally:
        for m in log:
            vars(m).pop("forward", None)
        stats["unaligned"] += sum(max(0, (r.shape[0] if r is not None else 0) - cursor[m]) for m, r in ref.items())


def describe(stats: dict) -> str:
    if stats["unaligned"]:
        return f"{stats['unaligned']} rows rounded in one run only: no decision pinned for them"
    if not stats["pinned"]:
        return "every rounding decided alike"
    return f"{stats['pinned']} rounded values pinned to the one pass's decision (rows within {stats['gap']:.2g})"


def has_roundings(model: nn.Module) -> bool:
    return bool(_roundings(model))


def pinned_run(model: nn.Module, log: dict | None, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, str]:
    """run() with the recorded run's decisions pinned (log None: as it is) -> (its result, what was pinned)."""
    if log is None:
        return run(), ""
    with pinned(model, log) as stats:
        out = run()
    return out, describe(stats)

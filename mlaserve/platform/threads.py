"""How many CPU threads the engine's torch ops use, chosen from the model's size, and a warning when
the machine is already busy.

Why a rule at all (measured on 2-core EPYCs, torch's OpenMP pool):
- A tiny model (the embedded 4.7M-parameter one, the test models) is bound by per-op overhead, not by
  arithmetic: a second thread gains nothing, and when another process holds the second core every
  op's OpenMP barrier waits for it: 64 tokens took ~20 s with 2 threads vs 0.9 s with 1 thread on a
  loaded 2-core machine, and `mlaserve verify` 1 min 50 s vs 8 s.
- A large model (the 0.7B benchmark model) streams hundreds of MB of weights per token: prefill and
  batched decode scale with threads (prefill ~1.8x with 2 threads), so it gets every core.
config/engine.py SMALL_MODEL_PARAMS is the line between them (threads are resolved there, with provenance).
"""

from __future__ import annotations

import os
import warnings

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def apply_threads(threads: int) -> None:
    """torch's intra-op pool is process-wide: the engine sets it once, at load."""
    torch.set_num_threads(threads)
    warn_if_busy(threads)


def warn_if_busy(threads: int) -> str | None:
    """Warn when the machine's recent load leaves fewer free cores than threads: OpenMP threads then
    wait at every op's barrier for a core another process holds (several-fold slower)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    # Our own load (this process loading the model) counts in the average too: warn only when others
    # hold more than the cores left over.
    free = usable_cores() - load
    if threads > 1 and free < threads - 1:
        msg = (
            f"the machine is busy (load average {load:.1f} on {usable_cores()} cores): {threads} threads will "
            f"stall on each other; pass --threads {max(1, int(free + 1))} (or threads=...) for steadier speed"
        )
        warnings.warn(msg, stacklevel=3)
        return msg
    return None

"""Several machines: under `torchrun` the rendezvous comes from the environment torchrun gives
every process it starts (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The engine configuration
does not: every process parses the same command line, and rank 0 checks every rank's echo as on
one machine. Rank 0 runs the front end; every other rank serves steps until rank 0 stops.

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr HOST0 --master-port 29500 \\
        -m mlaserve.entrypoints.cli generate --model PATH --tensor-parallel-size 2 "Hello"
"""

from __future__ import annotations

import os

from mlaserve.config.engine import EngineOptions
from mlaserve.config.model import ConfigError

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank() -> int | None:
    """This process's rank when a launcher started it (None otherwise)."""
    if not all(k in os.environ for k in _TORCHRUN_ENV):
        return None
    return int(os.environ["RANK"])


def torchrun_rendezvous(n: int):
    """(store, rank, world size) under torchrun for rank 0 of an N-rank group; None when this
    process was not started by a launcher."""
    rank = torchrun_rank()
    if rank is None:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != n:
        raise ConfigError(f"torchrun started {world} processes but the group has {n} ranks: they must be equal")
    if rank != 0:
        raise ConfigError(f"rank {rank} under torchrun serves steps (serve_torchrun_rank); only rank 0 runs the engine")
    from mlaserve.distributed.collectives import environment_store

    return environment_store()


def serve_torchrun_rank(path: str, opts: EngineOptions) -> None:
    """A rank >= 1 under torchrun: load its slice, echo its configuration, serve until stopped."""
    from mlaserve.distributed.collectives import environment_store
    from mlaserve.distributed.worker import serve

    world = int(os.environ["WORLD_SIZE"])
    n = opts.tensor_parallel_size * opts.expert_parallel_size
    if world != n:
        raise ConfigError(
            f"torchrun started {world} processes but tensor_parallel_size x expert_parallel_size={n}: they must be equal"
        )
    store, rank, world = environment_store()
    serve(store, rank, world, str(path), opts)

"""A tensor-parallel worker (rank > 0): started by rank 0 with its configuration as data, it
loads its slice of the weights, echoes its effective configuration, then runs every step rank 0
broadcasts until told to stop. It never samples: its logits slice and route record go to rank 0.

Messages from rank 0 (broadcast_object): ("step", chunks, preempted) | ("stop",).
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass, replace

import torch

from mlaserve.config.engine import EngineConfig, EngineOptions

JOINED = "mlaserve/joined/"  # store key a worker sets once connected (rank 0 waits for it)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is told, as data (no environment variables)."""

    path: str
    options: EngineOptions
    rank: int
    world_size: int
    host: str
    port: int
    trace: bool


def effective_config(cfg: EngineConfig) -> dict[str, str]:
    """The configuration a rank runs with, field by field (the model config included), for
    rank 0 to compare across ranks."""
    return {f.name: repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "provenance"}


def rank_echo(rank: int, cfg: EngineConfig, model: torch.nn.Module) -> dict:
    """What a rank reports at start: its effective config (must agree across ranks) and its own
    slice: local heads, weight bytes held, threads."""
    params = {id(p): p for p in list(model.parameters()) + list(model.buffers())}
    return {
        "rank": rank,
        "config": effective_config(cfg),
        "num_local_heads": model.cfg.num_heads,
        "vocab_rows": model.cfg.vocab_size,
        "weight_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "num_threads": torch.get_num_threads(),
    }


def worker_main(spec: WorkerSpec, errors) -> None:
    """Process entry point. Any exception goes to rank 0 through `errors` (rank, summary,
    traceback) before the process exits, which also fails rank 0's pending collective."""
    try:
        _run(spec)
    except BaseException as e:  # noqa: BLE001 -- everything is reported, then the process exits
        errors.put((spec.rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        errors.close()
        errors.join_thread()
        raise SystemExit(1) from None


def _run(spec: WorkerSpec) -> None:
    from mlaserve.distributed.collectives import Collectives, worker_store
    from mlaserve.distributed.sharding import vocab_sizes
    from mlaserve.executor.model_runner import ModelRunner
    from mlaserve.loading.model_loader import load_model
    from mlaserve.observability.trace import MemoryTracer

    store = worker_store(spec.host, spec.port, spec.world_size)
    store.set(f"{JOINED}{spec.rank}", "1")
    comm = Collectives(store, spec.rank, spec.world_size)
    loaded = load_model(spec.path, spec.options, comm=comm)
    # Process-wide settings: each rank applies its own (resolved) configuration.
    torch.set_num_threads(loaded.config.threads)
    if loaded.config.malloc_tuning:
        from mlaserve.platform.allocator import keep_freed_memory

        keep_freed_memory()
    tracer = MemoryTracer(maxlen=1) if spec.trace else None
    runner = ModelRunner(loaded.model, loaded.config, tracer, rank=spec.rank)
    comm.gather_objects(rank_echo(spec.rank, loaded.config, loaded.model))
    sizes = vocab_sizes(loaded.config.model.vocab_size, spec.world_size)
    while True:
        msg = comm.broadcast_object()
        if msg[0] == "stop":
            return
        _, chunks, preempted = msg
        before = replace(comm.stats)
        _, logits = runner.execute(chunks, preempted)
        comm.gather_logits(logits, sizes)
        if spec.trace:  # a worker's record is sent after its step, so it carries the step's all-reduces
            comm.gather_objects({**runner.tracer.records.pop(), "comm": comm.stats.since(before)})

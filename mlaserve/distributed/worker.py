"""A tensor-parallel worker (rank > 0): started by rank 0 with its configuration as data, it
loads its slice of the weights, echoes its effective configuration, then runs every step rank 0
broadcasts until told to stop. It never samples: its logits slice and route record go to rank 0.

Messages from rank 0 (broadcast_object): ("step", chunks, preempted, trace) | ("draft", chunks, rows,
step_no, source, trace): an MTP pass over the rows `source` names ("trunk": the last step's hidden states,
"draft": the last pass's output, or the rows themselves; distributed/group.py TensorParallelDrafter) |
("hold", slots) | ("end_draft",) | ("rollback", kept): the deeper drafts' ring hold and a verify step's
rollback (DeepSeek-V4 under expert parallelism; group.py) | ("stop",).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass, replace

import torch

from mlaserve.config.engine import EngineConfig, EngineOptions
from mlaserve.gguf.quants import GGML_TYPES

JOINED = "mlaserve/joined/"  # store key a worker sets once connected (rank 0 waits for it)
ERROR = "mlaserve/error/"  # store key of a failed rank's report


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker started by rank 0 is told, as data (no environment variables)."""

    path: str
    options: EngineOptions
    rank: int
    world_size: int
    host: str
    port: int


# Per-process resources, not the model's math: machines of a torchrun group may differ in cores.
PER_PROCESS = ("runtime.threads", "provenance")


def effective_config(cfg: EngineConfig) -> dict[str, str]:
    """The configuration a rank runs with, field by field as "part.field" (the model config whole), for
    rank 0 to compare across ranks and name each field that differs (threads are echoed apart: see rank_echo)."""
    out = {}
    for part in dataclasses.fields(cfg):
        value = getattr(cfg, part.name)
        fields = dataclasses.fields(value) if part.name != "model" and dataclasses.is_dataclass(value) else ()
        items = [(f"{part.name}.{f.name}", getattr(value, f.name)) for f in fields] or [(part.name, value)]
        out.update((name, repr(v)) for name, v in items if name not in PER_PROCESS)
    return out


def rank_echo(rank: int, cfg: EngineConfig, model: torch.nn.Module) -> dict:
    """What a rank reports at start: its effective config (must agree across ranks) and its own
    slice: local heads, weight bytes held, threads."""
    params = {id(p): p for p in list(model.parameters()) + list(model.buffers())}
    # DeepSeek-V4's runner model (V4Serving) keeps its own config as .config (heads under .attention); never split
    v4 = getattr(model, "config", None) if not hasattr(model, "cfg") else None
    return {
        "rank": rank,
        "config": effective_config(cfg),
        "num_local_heads": v4.attention.num_heads if v4 is not None else model.cfg.num_heads,
        "vocab_rows": (v4 or model.cfg).vocab_size,
        "weight_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "num_threads": torch.get_num_threads(),
        "routed_experts": routed_experts(model),
        # what the load read from the checkpoint (an expert-parallel rank: its own experts only) and the process's
        # peak resident memory so far (rank 0's includes its front end)
        "file_bytes_read": getattr(model, "file_bytes_read", None),
        "peak_rss_bytes": peak_rss_bytes(),
        **held_weights(model),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set (getrusage: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def routed_experts(model: torch.nn.Module) -> list[dict]:
    """Expert parallel: each MoE layer's experts this rank holds and their bytes (empty in one process / TP)."""
    from mlaserve.distributed.expert_parallel import expert_bytes

    out = []
    # DeepSeek-V4's runner model wraps the stack as .inner: its layers named as the checkpoint's (model.layers.N)
    for name, m in getattr(model, "inner", model).named_modules():
        shard = getattr(m, "expert_shard", None)
        if shard is not None:
            s = shard.shard
            out.append({"layer": name, "experts": [s.start, s.stop], "bytes": expert_bytes(shard.experts)})
    return out


def held_weights(model: torch.nn.Module) -> dict:
    """The rank's weights kept in a stored form: holders by class and form ("GGUFLinear gguf Q8_0": count),
    the bytes of their stored tensors (uint8 blocks, float8), the kernel plan's digest and the load notes on
    what the rank holds other than its even slice."""
    holders: dict[str, int] = {}
    stored = 0
    for module in model.modules():
        if hasattr(module, "describe"):
            key = f"{type(module).__name__} {module.describe()[0]}"
        elif hasattr(module, "type_k"):  # GGUFHeads: attn_k_b / attn_v_b blocks (the absorbed W_UK / W_UV)
            key = f"{type(module).__name__} gguf {GGML_TYPES[module.type_k].name}"
        else:
            continue
        holders[key] = holders.get(key, 0) + 1
        own = module.parameters(recurse=False)
        stored += sum(p.numel() * p.element_size() for p in own if not p.dtype.is_floating_point or p.itemsize == 1)
    plan = getattr(model, "kernel_plan", None)
    return {
        "holders": dict(sorted(holders.items())),
        "stored_bytes": stored,
        "kernel_plan": plan.digest if plan is not None else None,
        "notes": list(getattr(model, "rank_notes", ())),  # wider spans, FP8 scale grids (loading/model_loader.py)
    }


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker started by rank 0 (one machine)."""
    from mlaserve.distributed.collectives import worker_store

    store = worker_store(spec.host, spec.port, spec.world_size)
    store.set(f"{JOINED}{spec.rank}", "1")
    serve(store, spec.rank, spec.world_size, spec.path, spec.options)


def serve(store, rank: int, world_size: int, path: str, options: EngineOptions) -> None:
    """Run rank `rank` until rank 0 says stop. Any exception is written to the store for rank 0
    (ERROR + rank: "Type: message" and the traceback) before the process exits; the exit also
    fails rank 0's pending collective, so rank 0 reads the report at once. A heartbeat thread
    beats all along, for rank 0's watchdog to tell a stuck rank (heartbeat.py).

    Exit after "stop", in order, while the interpreter is whole: the collectives are closed (gloo's threads
    joined: collectives.py, Exit), then the heartbeat thread is joined (heartbeat.py, Exit); the store (no
    thread of its own) and the model go with the interpreter. Only spawn.py's parent watch is left, blocked in a
    plain read: ended at finalization, it unwinds C frames alone, no C++ destructor."""
    from mlaserve.distributed.heartbeat import Heartbeat

    heartbeat = Heartbeat(store, rank).start()
    try:
        _serve(store, rank, world_size, path, options)
    except BaseException as e:  # noqa: BLE001 -- everything is reported, then the process exits
        store.set(f"{ERROR}{rank}", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        heartbeat.stop()
        _exit_failed()
    heartbeat.stop()


def _exit_failed() -> None:
    """A failed rank's exit: status 1 at once, after its report is in the store and its output flushed. Its
    collectives stay open (one may still be pending, and freeing the group would wait for gloo's timeout), so
    finalizing the interpreter could let one of gloo's threads end in std::terminate (collectives.py, Exit) and
    turn the rank's status 1 into SIGABRT: rank 0 would name a crash instead of the report it has."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _serve(store, rank: int, world_size: int, path: str, options: EngineOptions) -> None:
    from mlaserve.distributed.collectives import Collectives
    from mlaserve.distributed.mesh import logits_sizes
    from mlaserve.executor.model_runner import ModelRunner
    from mlaserve.loading.model_loader import load_model
    from mlaserve.observability.trace import MemoryTracer

    comm = Collectives(store, rank, world_size)
    loaded = load_model(path, options, comm=comm)
    # Process-wide settings: each rank applies its own (resolved) configuration.
    torch.set_num_threads(loaded.config.runtime.threads)
    if loaded.config.runtime.malloc_tuning:
        from mlaserve.platform.allocator import keep_freed_memory

        keep_freed_memory()
    runner = ModelRunner(loaded.model, loaded.config, MemoryTracer(maxlen=1), rank=rank)
    # the runner's config: the loaded one with the cache's rules applied, as rank 0's runner compares it
    comm.gather_objects(rank_echo(rank, runner.cfg, loaded.model))
    par = loaded.config.parallel
    sizes = logits_sizes(loaded.config.model.vocab_size, par.tensor_parallel_size, par.expert_parallel_size)
    hidden = g = None  # the last step's hidden states and the last MTP pass's output (an MTP pass reads them)
    while True:
        msg = comm.broadcast_object()
        if msg[0] == "stop":  # the last collective: free the groups now, not at interpreter exit (collectives.py Exit)
            comm.close()
            return
        before = replace(comm.stats)
        received = getattr(loaded.model, "expert_received", None)
        before_received = received.snapshot() if received is not None else None
        if msg[0] == "draft":  # speculative decoding: one MTP pass, as rank 0 runs it
            _, chunks, rows, step_no, source, trace = msg
            if isinstance(source, str):
                rows_in = {"trunk": hidden, "draft": g}[source]
            else:  # the rows themselves: a paused request's catch-up rows, which only rank 0 kept
                rows_in = source
                comm.stats.add_rows(source)
            _, logits, g = runner.drafter.forward(chunks, rows_in, rows, step_no)
            if sizes is not None:  # expert parallel alone: rank 0 has the whole vocabulary's logits
                comm.gather_logits(logits, sizes)
            if trace:
                rec = {**runner.tracer.records.pop(), "comm": comm.stats.since(before)}
                if received is not None:  # expert parallel: the MTP layer's pairs on this rank's experts
                    rec["experts_received"] = received.since(before_received)
                comm.gather_objects(rec)
            continue
        if msg[0] == "hold":  # DeepSeek-V4 under expert parallelism: its drafter's rings, its request states
            runner.drafter.hold(msg[1])
            continue
        if msg[0] == "end_draft":
            runner.drafter.end_draft()
            continue
        if msg[0] == "rollback":
            runner.rollback(msg[1])
            continue
        _, chunks, preempted, trace = msg
        _, logits, hidden = runner.execute_with_hidden(chunks, preempted)
        if sizes is not None:  # expert parallel: rank 0 has the whole vocabulary's logits
            comm.gather_logits(logits, sizes)
        if trace:  # a worker's record is sent after its step, so it carries the step's all-reduces
            rec = {**runner.tracer.records.pop(), "comm": comm.stats.since(before)}
            if received is not None:  # expert parallel: what this rank's experts ran this step (load balance)
                rec["experts_received"] = received.since(before_received)
            comm.gather_objects(rec)

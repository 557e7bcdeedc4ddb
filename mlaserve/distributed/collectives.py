"""Every place ranks talk. Nothing else in mlaserve calls torch.distributed.

Per step (rank 0 -> all, then all -> rank 0):
  broadcast_object  the step's work (scheduled SeqChunks + preemptions: plain data) from rank 0; an MTP
                    pass's, with a paused request's catch-up rows of hidden states (counted: CommStats)
  all_reduce        sum of partial hidden states: after o_proj, after the MLP / MoE, after the
                    vocab-parallel embedding (2 * layers + 1 per step); expert parallel: the
                    routed experts' partial sums, one per MoE layer (nothing else: the rest is replicated)
  gather_logits     each rank's vocabulary slice of the logits, concatenated on rank 0 (TP only)
  subgroup          TP x EP: the tensor-parallel and expert-parallel groups' all-reduces (distributed/mesh.py)
  gather_objects    each rank's route record (when tracing) for rank 0's ledger
At start: gather_objects of each rank's effective configuration (checked on rank 0).

A group is its own gloo ProcessGroup over a TCPStore (no process-global default group), so an
application can hold several engines, and a peer that dies fails the next collective at once
(the socket closes) instead of hanging. A peer that is alive but stuck is another matter: rank 0
waits in slices of WAIT_SLICE and gives up as soon as its watchdog (heartbeat.py) names a hung rank.

Exit (close): gloo runs each collective on its own threads, and the thread drops the collective's last
reference to its tensors only after wait() has returned here. A tensor whose Python object died meanwhile
owns that object (torch keeps it alive), so the drop takes the GIL. When that thread asks for the GIL just
before the interpreter finalizes and gets it during finalization (the process group freed then, its
destructor releases the GIL to join its threads), CPython ends the thread with pthread_exit, whose unwinding
meets the tensor's noexcept destructor: std::terminate, "terminate called without an active exception",
SIGABRT after a healthy stop (tests/distributed/test_clean_exit.py reproduces it). So a rank closes its
collectives once its last one is done, while the interpreter is whole: freeing the process group joins
gloo's threads, which finish their drops first.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective blocks at most this long for a peer that is alive but silent (a hung rank).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
CONNECT_TIMEOUT = timedelta(seconds=120)
# Rank 0 checks its watchdog's verdict this often while it waits for a collective (a wait that
# times out is harmless: the collective goes on and the next slice picks it up).
WAIT_SLICE = timedelta(seconds=0.25)


class CollectiveAbandoned(RuntimeError):
    """Rank 0 stopped waiting for a collective: a rank was found hung (the message says which)."""


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous on a free local port (store.port tells the workers where)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False)


def worker_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, False, timeout=CONNECT_TIMEOUT)


def environment_store() -> tuple[dist.Store, int, int]:
    """(store, rank, world size) of a launcher's rendezvous (torchrun: MASTER_ADDR, MASTER_PORT,
    RANK, WORLD_SIZE; its agent's store when it offers one), under a prefix of our own."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    return dist.PrefixStore("mlaserve", store), rank, world_size


@dataclass
class CommStats:
    """Running totals of this rank's all-reduces (the per-step hot path): count, payload bytes and
    seconds spent in them (waiting for the slowest rank included); and the hidden-state rows rank 0 sent in a
    draft message (a paused request's catch-up rows under speculative decoding: distributed/group.py
    TensorParallelDrafter), counted by the rank that receives them (add_rows)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    catch_up_rows: int = 0
    catch_up_bytes: int = 0

    def add_rows(self, rows: torch.Tensor) -> None:
        """Rows [R, D] received from rank 0: R rows, their payload R x D x element size (the pickle's framing of
        the message around them is not counted)."""
        self.catch_up_rows += rows.shape[0]
        self.catch_up_bytes += rows.numel() * rows.element_size()

    def since(self, before: CommStats) -> dict:
        return {
            "all_reduces": self.all_reduces - before.all_reduces,
            "all_reduce_bytes": self.all_reduce_bytes - before.all_reduce_bytes,
            "all_reduce_ms": round(1e3 * (self.all_reduce_s - before.all_reduce_s), 3),
            "catch_up_rows": self.catch_up_rows - before.catch_up_rows,
            "catch_up_bytes": self.catch_up_bytes - before.catch_up_bytes,
        }


class Collectives:
    """The collectives of one tensor-parallel group, seen from one rank."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, interrupt: Callable[[], str | None] | None = None
    ) -> None:
        """interrupt (rank 0): returns why to stop waiting for a collective (a hung or dead rank), or None."""
        self.rank, self.world_size, self._store = rank, world_size, store
        self._pg = dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
        self._interrupt = interrupt
        self.stats = CommStats()
        self._subgroups: list[Collectives] = []

    def subgroup(self, name: str, members: list[int]) -> Collectives:
        """Collectives among some of this group's ranks (TP x EP, distributed/mesh.py): its own gloo group over
        a prefix of the store; every member calls it with the same name and members. Its all-reduces count
        in this rank's stats (the ledger's `comm`)."""
        store = dist.PrefixStore(f"mlaserve/group/{name}", self._store)
        sub = Collectives(store, members.index(self.rank), len(members), self._interrupt)
        sub.stats = self.stats
        self._subgroups.append(sub)  # closed with this group (close)
        return sub

    def close(self) -> None:
        """Free this group's gloo process groups (its subgroups' first), which joins their threads (module
        docstring: Exit). Only after every collective is done: freeing a group with one pending waits for it.
        A model that still holds a reducer of it keeps the Python object; a collective on it then raises."""
        for sub in self._subgroups:
            sub.close()
        self._subgroups = []
        self._pg = _CLOSED  # our reference was the group's last one: freeing it joins its threads

    def _wait(self, work) -> None:
        """work.wait(), in slices when an interrupt is set, so that rank 0 fails the step as soon
        as a rank is found hung instead of after COLLECTIVE_TIMEOUT. The abandoned collective stays
        pending in gloo: the group is failed from then on (group.py keeps it from being freed,
        which would block until the timeout)."""
        if self._interrupt is None:
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # done meanwhile, or failed: wait() returns or raises its error
                    work.wait()
                    return
            reason = self._interrupt()
            if reason is not None:
                raise CollectiveAbandoned(reason)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (every rank gets the same bits: gloo reduces each chunk once)."""
        buf = x.contiguous()
        t0 = time.perf_counter()
        self._wait(self._pg.allreduce([buf]))
        s = self.stats
        s.all_reduces, s.all_reduce_bytes = s.all_reduces + 1, s.all_reduce_bytes + buf.numel() * buf.element_size()
        s.all_reduce_s += time.perf_counter() - t0
        return buf

    def gather_logits(self, local: torch.Tensor, vocab_sizes: tuple[int, ...]) -> torch.Tensor | None:
        """Each rank's logits [T, V_rank] -> [T, sum V_rank] on rank 0 (None elsewhere). Slices may
        differ by one column (a vocabulary that does not split evenly): padded to the widest."""
        width = max(vocab_sizes)
        buf = torch.zeros(local.shape[0], width, dtype=local.dtype)
        buf[:, : local.shape[1]] = local
        if self.rank != 0:
            self._wait(self._pg.gather([], [buf], dist.GatherOptions()))
            return None
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        self._wait(self._pg.gather([parts], [buf], dist.GatherOptions()))  # root: rank 0
        return torch.cat([p[:, :v] for p, v in zip(parts, vocab_sizes)], dim=1)

    def broadcast_object(self, obj=None):
        """Rank 0's obj on every rank (pickled into a byte tensor: length first, then bytes)."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self._pg.broadcast([size], _root(0)))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(int(size))
        buf = buf.to(torch.uint8)
        self._wait(self._pg.broadcast([buf], _root(0)))
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def gather_objects(self, obj) -> list | None:
        """Every rank's obj, in rank order, on rank 0 (None elsewhere)."""
        data = pickle.dumps(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(self._pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]))
        width = max(int(s) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.rank != 0:
            self._wait(self._pg.gather([], [buf], dist.GatherOptions()))
            return None
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        self._wait(self._pg.gather([parts], [buf], dist.GatherOptions()))  # root: rank 0
        return [pickle.loads(p[: int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]


class _Closed:
    """The process group of closed Collectives: any collective on it is an error."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"collective {name} on closed collectives (the group has stopped)")


_CLOSED = _Closed()


def _root(rank: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts

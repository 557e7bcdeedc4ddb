"""Where a rank sits when tensor and expert parallelism are combined (TP x EP), and the groups it reduces over.

Notation
  T = tensor_parallel_size, E = expert_parallel_size, W = T * E processes, g a process's rank in [0, W)
  g = e * T + t   t: its tensor-parallel rank (its heads, its slice of every intermediate dim and vocabulary)
                  e: its expert-parallel rank (its range of every MoE layer's routed experts)
  TP group        the T ranks of one e: attention, dense MLP, shared expert and embedding partial sums
                  (the decoder layer's all-reduces), and the vocabulary slices of the logits
  EP group        the E ranks of one t: the routed experts' partial sums of that t's intermediate units
A MoE layer under TP x EP: rank (e, t) runs its experts' t-units on the tokens routed to them -> all-reduce
over the EP group (= the routed partial of t's units over every expert, what rank t alone holds under TP)
-> + the shared expert's t-units -> the decoder layer's all-reduce over the TP group: the one-process sum.
Everything is replicated across the E TP groups (each computes every token); rank 0 gathers the logits
from its own TP group (the other groups' copies are not sent).
With T == 1 or E == 1 the one group is the whole world (no subgroup is made).
Whole experts (expert groups TP does not split: FP4, INT4; loading/model_loader.py decides): the routed experts
are spread over all W processes instead (expert_range over W), their partials all-reduced over the world, and
only the processes with t == 0 add that sum before the TP all-reduce (the others add 0), so it counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.distributed.sharding import vocab_sizes


@dataclass(frozen=True)
class Place:
    """A process's tensor- and expert-parallel ranks (plain data, from its world rank)."""

    rank: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int


def place_of(rank: int, tp_size: int, ep_size: int) -> Place:
    return Place(rank, rank % tp_size, tp_size, rank // tp_size, ep_size)


def reducers(comm, place: Place):
    """(TP group's all_reduce, EP group's all_reduce) for this process; comm is the world's Collectives.
    Every process makes its TP group, then its EP group, so the members of each meet in the same order."""
    if place.tp_size == 1 or place.ep_size == 1:
        return comm.all_reduce, comm.all_reduce
    t, e, tp, ep = place.tp_rank, place.ep_rank, place.tp_size, place.ep_size
    tp_group = comm.subgroup(f"tp{e}", [e * tp + i for i in range(tp)])
    ep_group = comm.subgroup(f"ep{t}", [i * tp + t for i in range(ep)])
    return tp_group.all_reduce, ep_group.all_reduce


def logits_sizes(vocab_size: int, tp_size: int, ep_size: int) -> tuple[int, ...] | None:
    """Each world rank's share of the logits rank 0 gathers: the TP group of e = 0 its vocabulary slices, the
    other groups' (copies) nothing; None without tensor parallelism (every rank has the whole vocabulary)."""
    if tp_size == 1:
        return None
    return vocab_sizes(vocab_size, tp_size) + (0,) * (tp_size * (ep_size - 1))

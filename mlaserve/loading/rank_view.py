"""What this process reads of a checkpoint under tensor and expert parallelism: its config (its heads, intermediate
and vocabulary rows), the source its fill reads (slices of the TP rank, the routed experts of the EP rank), and the
groups its partial sums are reduced over (distributed/mesh.py). In one process: the checkpoint as it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaserve.config.model import ModelConfig
from mlaserve.distributed.expert_parallel import expert_range
from mlaserve.distributed.expert_source import ExpertRangeSource
from mlaserve.distributed.mesh import Place, place_of, reducers
from mlaserve.distributed.sharding import ShardedSource, rank_config, unit_spans, vocab_range
from mlaserve.loading.loaded import Checkpoint
from mlaserve.quant.at_load import BLOCK as BLOCK_AT_LOAD


@dataclass(frozen=True)
class RankView:
    model_cfg: ModelConfig  # this rank's (rank_config under TP), else the checkpoint's
    source: Any  # what the fill reads: the checkpoint's source, sliced (TP), its experts ranged (EP)
    sharded: Any  # the TP slices (ShardedSource), else the checkpoint's source
    ranged: ExpertRangeSource | None  # the EP range of routed experts, else None
    rank_args: dict  # build_model's vocabulary start and TP all-reduce
    place: Place | None  # this process's TP and EP ranks (None in one process)
    whole: bool  # TP x EP with expert groups TP does not split (FP4 / INT4): whole experts over every process
    ep_rank: int
    ep_n: int
    ep_reduce: Any  # the all-reduce of the routed experts' partial sums (None without EP)


def rank_view(ck: Checkpoint, comm) -> RankView:
    engine_cfg, scheme = ck.engine_cfg, ck.scheme
    n, ep = engine_cfg.parallel.tensor_parallel_size, engine_cfg.parallel.expert_parallel_size
    model_cfg, source, sharded, ranged, rank_args = ck.model_cfg, ck.source, ck.source, None, {}
    # TP x EP with expert groups TP does not split (FP4 / INT4): whole experts spread over every process
    whole = n > 1 and ep > 1 and scheme is not None and scheme.expert_dtype != "fp8"
    place, ep_rank, ep_n, ep_reduce, tp_reduce = None, 0, 1, None, None
    if n * ep > 1:  # this process's TP and EP ranks and the groups it reduces over (distributed/mesh.py)
        place = place_of(comm.rank, n, ep)
        tp_reduce, ep_reduce = reducers(comm, place)
        # whole experts: ranges over all n x ep processes, their partials summed over the world
        ep_rank, ep_n, ep_reduce = (comm.rank, n * ep, comm.all_reduce) if whole else (place.ep_rank, ep, ep_reduce)
    if n > 1:  # this rank's heads / intermediate / vocabulary rows, read as slices
        rank = place.tp_rank
        # an intermediate split inside the blocks kept per rank: a wider span (dequantized: narrowed exactly)
        # quantization at load: each rank quantizes its own slices, on the blocks one process quantizes
        at_load = BLOCK_AT_LOAD if engine_cfg.kernels.quantization is not None else 1
        quantized = engine_cfg.kernels.gguf_weights == "quantized" or at_load > 1
        spans = unit_spans(source, ck.model_cfg, rank, n, at_load) if quantized else {}
        model_cfg = rank_config(ck.model_cfg, rank, n, spans)
        source = sharded = ShardedSource(source, ck.model_cfg, rank, n, spans, whole_experts=whole)
        rank_args = {"vocab_start": vocab_range(ck.model_cfg.vocab_size, rank, n)[0], "all_reduce": tp_reduce}
    if ep > 1:  # this rank's routed experts only: the others' are neither listed nor read (distributed/expert_source)
        e = model_cfg.moe.n_routed_experts
        source = ranged = ExpertRangeSource(source, e, *expert_range(e, ep_rank, ep_n))
    return RankView(model_cfg, source, sharded, ranged, rank_args, place, whole, ep_rank, ep_n, ep_reduce)

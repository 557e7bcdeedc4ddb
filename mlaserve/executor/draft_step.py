"""The preamble every MTP drafter runs before its layer: the draft chunks as a batch over the drafter's own cache,
the route of its one-layer stack, and the ledger's draft record (executor/drafter.py: the MLA families' and
GLM-5.3-Flash's MTP layer; executor/drafter_v4.py: DeepSeek-V4's). One function, so the drafters cannot drift apart
in how a draft step is built, routed or recorded."""

from __future__ import annotations

from collections.abc import Callable

from mlaserve.attention.plan import StepRoute
from mlaserve.attention.router import route_step
from mlaserve.config.engine import EngineConfig
from mlaserve.config.layer_kinds import LayerKind
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.observability.trace import step_record


def build_draft_step(
    cfg: EngineConfig,
    layer_kinds: tuple[LayerKind, ...],
    pad_slot: int,
    tracer,
    chunks: list[SeqChunk],
    step_no: int,
    ledger: Callable[[ForwardBatch, object], dict] | None,
    sparse: bool,
    *route_extra,
    rank: int = 0,
) -> tuple[ForwardBatch, StepRoute]:
    """-> (the draft chunks' batch, its route). route_extra: route_step's trailing arguments a drafter needs
    (DeepSeek-V4's: csa_dense, its implementation label). Records the step when the tracer is on; the record's
    `layers` says the MTP layer's checkpoint index, and under tensor parallelism `rank` the rank that ran it
    (as the runner's records do)."""
    batch = ForwardBatch.build(
        chunks, cfg.cache.page_size, cfg.scheduler.decode_threshold, cfg.runtime.device, pad_slot
    )
    plan = route_step(
        batch,
        layer_kinds,
        cfg.attention.mla_path,
        sparse,
        cfg.attention.index_topk,
        cfg.runtime.dtype,
        cfg.attention.backend,
        *route_extra,
        index_scores=cfg.attention.index_scores,
    )
    if tracer.enabled:
        rec = step_record(step_no, batch, plan, 1, ())
        rec["layers"] = f"mtp ({cfg.model.num_layers})"
        rec = rec | (ledger(batch, plan) if ledger else {})
        tracer.record({"rank": rank, **rec} if cfg.parallel.world_size > 1 else rec)
    return batch, plan

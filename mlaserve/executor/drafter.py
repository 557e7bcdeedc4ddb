"""Runs the MTP layer over a step's draft work: its own latent cache, the same pages and route rules.

Notation
  chunks   one SeqChunk per drafting request: token_ids = the *next* tokens t_{i+1} at the trunk's
           positions i (the MTP row at position i is computed from h_i and t_{i+1})
  hidden   [R, D] rows the MTP reads as h_i: the trunk's final hidden states (depth 1) or the MTP's
           own output g (deeper drafts); rows[request_id] = the first of that request's rows
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.engine import EngineConfig
from mlaserve.config.kv_cache import quantize_states
from mlaserve.config.layer_kinds import declare_layers
from mlaserve.executor.draft_step import build_draft_step
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.step_context import StepContext
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.models.mtp import cache_config


def make_drafter(model, cfg: EngineConfig, tracer, rank: int = 0):
    """The MTP drafter of the runner's model: DeepSeek-V4's (its mHC streams and a sliding ring per request,
    executor/drafter_v4.py; one process or expert parallelism) or the MLA families' (this module). rank: the tensor-parallel
    rank, named in its ledger records as the runner's are."""
    if getattr(model, "mtp_drafts_streams", False):
        from mlaserve.executor.drafter_v4 import V4Drafter  # only a V4 model reaches it

        return V4Drafter(model, cfg, tracer, rank)
    return Drafter(model, cfg, tracer, rank)


class Drafter:
    def __init__(self, model: MLAForCausalLM, cfg: EngineConfig, tracer, rank: int = 0) -> None:
        """Under tensor parallelism every rank has one, over its slice of the MTP layer and its own copy of
        the cache (replicated, as the trunk's); rank 0's is wrapped by distributed/group.py's
        TensorParallelDrafter, which runs each pass on every rank."""
        # Deeper drafts reuse the first MTP layer (DeepSeek-V3 and GLM-5 ship one), as vLLM does.
        self.model, self.cfg, self.tracer, self.rank = model, cfg, tracer, rank
        self.layer = model.mtp[0]
        self.sparse = cfg.attention.sparse and self.layer.layout.indexer
        # the MTP layer as a stack of one: its kind (with an indexer or not) and its own cache states
        mtp_cfg = cache_config(cfg.model, self.layer.layout)
        self.layer_kinds = quantize_states(declare_layers(mtp_cfg, self.sparse), cfg.cache.kv_cache_dtype, mtp_cfg)
        self.cache = ModelCache(
            self.layer_kinds,
            cfg.cache.num_pages,
            cfg.cache.page_size,
            cfg.runtime.dtype,
            cfg.runtime.device,
            prefault=cfg.cache.kv_prefault,
        )

    def forward(
        self,
        chunks: list[SeqChunk],
        hidden: torch.Tensor,
        rows: dict[str, int],
        step_no: int,
        ledger: Callable[[ForwardBatch, object], dict] | None = None,
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """-> (batch, logits at the chunks' logits rows [n, vocab] float32, g [T, D] in batch order)."""
        cfg = self.cfg
        batch, plan = build_draft_step(
            cfg,
            self.layer_kinds,
            self.cache.pad_slot,
            self.tracer,
            chunks,
            step_no,
            ledger,
            self.sparse,
            rank=self.rank,
        )
        src = [rows[s.request_id] + j for s in batch.seqs for j in range(s.query_len)]
        with torch.inference_mode():
            step = StepContext.build(batch, plan, self.model.rope, cfg.runtime.dtype)
            h = hidden[torch.tensor(src, dtype=torch.long, device=hidden.device)]
            g = self.layer(batch.input_ids, h, step, self.model.rope, self.cache.layers[0])
            logits = self.layer.logits(g[batch.logits_indices])
        return batch, logits, g

    def hold(self, slots: list[int]) -> None:
        """Before the deeper drafts (DeepSeek-V4's drafter keeps its rings here); the MLA layer keeps nothing."""

    def end_draft(self) -> None:
        """After a step's deeper drafts: nothing to put back (their latent rows are never read before the
        next MTP pass rewrites those positions)."""

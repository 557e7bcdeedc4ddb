"""DeepSeek-V4's MTP drafter: the MTP layer (models/deepseek_v4/mtp.py) over its own one-layer cache, a sliding
ring per request slot (the block is a sliding-window V4 layer: no paged rows).

Notation
  chunks   one SeqChunk per drafting request (engine/speculative.py): token_ids = the next tokens t_{i+1} at the
           trunk's positions i, state_slot = the request's slot (the same slot number as the trunk's), reset_state
           where the request's MTP rows start (position 0, or a prefix hit: the ring starts empty there)
  hidden   [R, N*D] rows the layer reads as H_i: the trunk's mHC streams after its last layer, flattened (depth
           1), or the layer's own output streams (deeper drafts); rows[request_id] = its first row
Deeper drafts (num_speculative_tokens > 1) write ring rows at draft positions past the last verified one; those
overwrite rows of positions p - W that the next step's first MTP pass still reads. The drafter keeps the
slots' rings as they were before the first deeper pass and puts them back at `end_draft` (the same engine
step), so the ring always holds verified positions only, as a plain (non-speculative) run of the layer would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.engine import EngineConfig
from mlaserve.config.layer_kinds import declare_layers
from mlaserve.executor.draft_step import build_draft_step
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.step_context import StepContext
from mlaserve.models.deepseek_v4.mtp import mtp_config


class V4Drafter:
    def __init__(self, model, cfg: EngineConfig, tracer, rank: int = 0) -> None:
        # model: the runner's V4Serving; drafts at every depth reuse the first MTP layer (the release ships one)
        # rank: the expert-parallel rank, named in its ledger records as the runner's are
        self.model, self.cfg, self.tracer, self.rank = model, cfg, tracer, rank
        self.layer = model.inner.mtp[0]
        self.hc, self.hidden = cfg.model.hc.hc_mult, cfg.model.hidden_size
        self.layer_kinds = declare_layers(mtp_config(cfg.model), False)
        self.cache = ModelCache(
            self.layer_kinds,
            cfg.cache.num_pages,
            cfg.cache.page_size,
            cfg.runtime.dtype,
            cfg.runtime.device,
            num_slots=cfg.scheduler.max_num_seqs,
            prefault=cfg.cache.kv_prefault,
            snapshots=False,  # a request at a prefix hit starts its MTP ring empty (reset), never from a page
        )
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, their rings before deeper drafts)

    def forward(
        self,
        chunks: list[SeqChunk],
        hidden: torch.Tensor,
        rows: dict[str, int],
        step_no: int,
        ledger: Callable[[ForwardBatch, object], dict] | None = None,
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """-> (batch, logits at the chunks' logits rows [n, vocab] float32, output streams [T, N*D])."""
        cfg = self.cfg
        batch, plan = build_draft_step(
            cfg,
            self.layer_kinds,
            self.cache.pad_slot,
            self.tracer,
            chunks,
            step_no,
            ledger,
            False,  # no indexer in the MTP block (a sliding-window layer)
            False,
            self.model.v4_implementation,
            rank=self.rank,
        )
        src = [rows[s.request_id] + j for s in batch.seqs for j in range(s.query_len)]
        with torch.inference_mode():
            step = StepContext.build(batch, plan, self.model.rope, cfg.runtime.dtype)
            if batch.reset_slots:
                self.cache.reset_states(torch.tensor(batch.reset_slots, dtype=torch.long, device=cfg.runtime.device))
            h = hidden[torch.tensor(src, dtype=torch.long, device=hidden.device)].view(-1, self.hc, self.hidden)
            g = self.model.draft(self.layer, batch.input_ids, h, step, self.cache)
            logits = self.model.draft_logits(self.layer, g[batch.logits_indices])
        return batch, logits, g.flatten(1)

    def hold(self, slots: list[int]) -> None:
        """Before the first deeper draft pass: keep these slots' rings (put back by end_draft)."""
        if self._held is None and slots:
            idx = torch.tensor(slots, dtype=torch.long, device=self.cfg.runtime.device)
            self._held = (idx, self.cache.layers[0].tensors["window"].index_select(0, idx))

    def end_draft(self) -> None:
        """After the step's deeper drafts: the held rings back, so only verified positions stay in them."""
        if self._held is not None:
            idx, rings = self._held
            self.cache.layers[0].tensors["window"].index_copy_(0, idx, rings)
            self._held = None

"""Owns the model and its cache; executes one step: chunks -> batch -> route -> forward -> logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaserve.attention.router import route_step
from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.engine import EngineConfig
from mlaserve.config.layer_kinds import declare_layers
from mlaserve.executor.drafter import Drafter
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.step_context import StepContext
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.observability.trace import NullTracer, step_record


class ModelRunner:
    def __init__(self, model: MLAForCausalLM, cfg: EngineConfig, tracer=None, rank: int = 0) -> None:
        """rank: this process's tensor-parallel rank (named in its ledger records when TP > 1)."""
        self.model, self.cfg, self.rank = model, cfg, rank
        # every layer's kind and the cache states it keeps, declared once (config/layer_kinds.py)
        self.layer_kinds = declare_layers(cfg.model, cfg.sparse)
        self.cache = ModelCache(
            self.layer_kinds, cfg.num_pages, cfg.page_size, cfg.dtype, cfg.device, prefault=cfg.kv_prefault
        )
        self.tracer = tracer or NullTracer()
        self.step_count = 0
        self.drafter = Drafter(model, cfg, self.tracer) if cfg.speculative == "mtp" else None

    def execute(self, chunks: list[SeqChunk], preempted: tuple = ()) -> tuple[ForwardBatch, torch.Tensor]:
        """-> (batch, logits [len(batch.logits_indices), vocab] float32). `preempted`: the scheduler's
        Preemption records of this step, written to the ledger with the route."""
        batch, logits, _ = self.execute_with_hidden(chunks, preempted)
        return batch, logits

    def execute_with_hidden(
        self, chunks: list[SeqChunk], preempted: tuple = (), ledger: Callable | None = None
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """execute() that also returns the final hidden states [T, D] (the MTP layer's input);
        `ledger`: extra fields for this step's record (speculative verification)."""
        cfg = self.cfg
        batch = ForwardBatch.build(chunks, cfg.page_size, cfg.decode_threshold, cfg.device, self.cache.pad_slot)
        plan = route_step(
            batch, self.layer_kinds, cfg.mla_path, cfg.sparse, cfg.index_topk, cfg.dtype, cfg.attention_backend
        )
        with torch.inference_mode():
            step = StepContext.build(batch, plan, self.model.rope, cfg.dtype)
            native = self.model.fused_decode(step, self.cache)  # decided before the math, recorded with the route
            if self.tracer.enabled:
                rec = step_record(self.step_count, batch, plan, cfg.model.num_layers, preempted)
                rec["kernels"] = self._kernels_record(native)
                rec = rec | (ledger(batch, plan) if ledger else {})
                self.tracer.record({"rank": self.rank, **rec} if cfg.tensor_parallel_size > 1 else rec)
            self.step_count += 1
            hidden = self.model(batch.input_ids, step, self.cache, native)
            logits = self.model.logits(hidden[batch.logits_indices])
        return batch, logits, hidden

    def _kernels_record(self, native: tuple | None) -> dict:
        """The ledger's kernel fields: the load's KernelPlan by its digest (`mlaserve inspect` prints the plan)
        and whether this step's decoder layers run as one native call each."""
        plan = getattr(self.model, "kernel_plan", None)
        return {"plan": plan.digest if plan is not None else None, "decode_layer": "native" if native else "per_op"}

    def prompt_logits(self, request_id: str, ids: list[int], pages: list[int]) -> torch.Tensor:
        """Logits at every position of ids [len, vocab], prefilled through `pages` in chunks of
        max_num_batched_tokens (the engine's normal path: paged cache, routed attention)."""
        ps, budget = self.cfg.page_size, self.cfg.max_num_batched_tokens
        out, done = [], 0
        while done < len(ids):
            chunk = tuple(ids[done : done + budget])
            table = tuple(pages[: -(-(done + len(chunk)) // ps)])
            out.append(self.execute([SeqChunk(request_id, chunk, done, table, all_logits=True)])[1])
            done += len(chunk)
        return torch.cat(out)

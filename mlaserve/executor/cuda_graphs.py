"""CUDA graphs for pure decode steps: one capture per GraphPlan key (batch bucket, context bucket, route shape),
replayed with the step's inputs copied into the captured buffers.

Capture (the first step of a key): the padded step (executor/padded_decode.py run_padded) runs twice on a side
stream (warm-up: cuBLAS handles, allocator blocks), then once under torch.cuda.graph with one memory pool shared
by every graph (a step replays one graph at a time and its outputs are copied out before the next). Its cache
writes repeat the same rows at the same slots (a function of the step's inputs), so warming up changes nothing.
The capture's time and the pool's growth are kept per key (`captures`) and logged. Replay: copy the new padded
step's tensors into the captured ones, replay, copy the real rows' logits and hidden states out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from mlaserve.cache.model_cache import ModelCache
from mlaserve.executor.graph_plan import GraphPlan
from mlaserve.executor.padded_decode import PaddedStep, run_padded

log = logging.getLogger(__name__)
WARMUP_RUNS = 2


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the captured step's input tensors (PaddedStep.tensors order)
    logits: torch.Tensor  # [P, V] the captured outputs
    hidden: torch.Tensor  # [P, D]


class DecodeGraphs:
    """The captured decode graphs of one runner (device cuda)."""

    def __init__(self, model, cache: ModelCache) -> None:
        self.model, self.cache = model, cache
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures: list[dict] = []  # per capture: bucket, context_pages, capture_s, pool bytes
        self.replays = 0  # steps replayed (the first step of a key included: it replays after its capture)

    def captured(self, plan: GraphPlan) -> bool:
        """Whether the plan's graph exists (else this step captures it first)."""
        return plan.key in self.graphs

    def run(self, plan: GraphPlan, padded: PaddedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [n, V], hidden [n, D]) of the plan's real rows, by replay (capturing first if new)."""
        g = self.graphs.get(plan.key)
        if g is None:
            g = self.graphs[plan.key] = self._capture(plan, padded)
        else:
            for dst, src in zip(g.inputs, padded.tensors(), strict=True):
                dst.copy_(src, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        n = plan.real_rows
        return g.logits[:n].clone(), g.hidden[:n].clone()

    def _capture(self, plan: GraphPlan, padded: PaddedStep) -> _Graph:
        torch.cuda.synchronize()
        reserved0, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run_padded(self.model, self.cache, padded)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, hidden = run_padded(self.model, self.cache, padded)
        torch.cuda.synchronize()
        rec = {
            "bucket": plan.bucket,
            "context_pages": plan.context_pages,
            "capture_s": time.perf_counter() - t0,
            "reserved_bytes_added": torch.cuda.memory_reserved() - reserved0,
        }
        self.captures.append(rec)
        log.info("captured decode graph %s", rec)
        return _Graph(graph, padded.tensors(), logits, hidden)

    def summary(self) -> dict:
        """Graphs captured, total capture time and memory added (the benchmark's figures)."""
        return {
            "graphs": len(self.graphs),
            "replays": self.replays,
            "capture_s": sum(c["capture_s"] for c in self.captures),
            "reserved_bytes_added": sum(c["reserved_bytes_added"] for c in self.captures),
            "captures": list(self.captures),
        }

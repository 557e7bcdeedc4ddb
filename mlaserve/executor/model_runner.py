"""Owns the model and its cache; executes one step: chunks -> batch -> route -> forward -> logits.

Request-addressed states (config/layer_kinds.py): when the stack declares any, the cache keeps
max_num_seqs state slots, prefix caching runs off unless every such state has page-boundary snapshots or is
empty at page boundaries (the reason recorded in the config's provenance), and before each step the runner
zeroes the slots the batch names in reset_slots (chunks that start their sequence) and restores those in
restores from their pages' snapshot rows (chunks that start at a prefix hit), so a layer always finds its
request's state as of the chunk's context_len. Speculative decoding is refused with them (a rejected draft would
have advanced a state that cannot be rolled back) unless the model rolls its states back (`rolls_back`, the
protocol of models/rollback.py: DeepSeek-V4, GLM-5.3-Flash): then a verify step keeps the model's tape (`self.tape`,
from `model.verify_tape`; what it holds is the model's business) and `rollback` hands it back to the model with the
verdict, in the same engine step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from mlaserve.attention.plan import StepRoute
from mlaserve.attention.router import route_step
from mlaserve.cache.disk_tier import DiskTier, model_identity
from mlaserve.cache.model_cache import ModelCache
from mlaserve.config.engine import EngineConfig
from mlaserve.config.kv_cache import quantize_states
from mlaserve.config.layer_kinds import LayerKind, declare_layers, prefix_caching_blocker, request_states
from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import Setting
from mlaserve.executor.drafter import make_drafter
from mlaserve.executor.forward_batch import ForwardBatch, SeqChunk
from mlaserve.executor.graph_plan import GraphPlan, GraphSettings, plan_graph
from mlaserve.executor.padded_decode import PaddedStep, capture_blocker, pad_decode_step, run_padded
from mlaserve.executor.step_context import StepContext
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.observability.trace import NullTracer, step_record


class ModelRunner:
    def __init__(
        self,
        model: MLAForCausalLM,
        cfg: EngineConfig,
        tracer=None,
        rank: int = 0,
        layer_kinds: tuple[LayerKind, ...] | None = None,
        v4_csa_dense: bool = False,
    ) -> None:
        """rank: this process's tensor-parallel rank (named in its ledger records when TP > 1). layer_kinds:
        the stack's kinds and states (default: declared from the config, config/layer_kinds.py).
        v4_csa_dense: DeepSeek-V4's CSA layers attend every visible compressed row instead of the indexer's
        top-k (`mlaserve verify`'s sparse-vs-dense identity, verify_v4.py; not an engine option), recorded in
        each step's route (attention/router.py route_v4)."""
        self.model, self.rank = model, rank
        self.v4_csa_dense = v4_csa_dense
        # every layer's kind and the cache states it keeps, declared once (config/layer_kinds.py)
        if layer_kinds is None:
            layer_kinds = declare_layers(cfg.model, cfg.attention.sparse)
        # 8-bit latent rows and index keys (kv_cache_dtype): the states' formats, decided here once
        self.layer_kinds = quantize_states(layer_kinds, cfg.cache.kv_cache_dtype, cfg.model)
        self.cfg = cfg = with_request_state_rules(cfg, self.layer_kinds, getattr(model, "rolls_back", False))
        slots = cfg.scheduler.max_num_seqs if request_states(self.layer_kinds) else 0
        self.cache = ModelCache(
            self.layer_kinds,
            cfg.cache.num_pages,
            cfg.cache.page_size,
            cfg.runtime.dtype,
            cfg.runtime.device,
            num_slots=slots,
            prefault=cfg.cache.kv_prefault,
            # snapshots serve prefix hits only (preemption without them recomputes from token 0): kept with
            # prefix caching on, and then only for stacks whose request states declare them
            snapshots=cfg.cache.enable_prefix_caching,
        )
        # the live storage of the cache rows in a word (the ledger's kv_cache; `inspect` prints the whole layout)
        self.kv_cache_layout = (
            str(cfg.runtime.dtype).removeprefix("torch.")
            if cfg.cache.kv_cache_dtype == "auto"
            else cfg.cache.kv_cache_dtype
        )
        self.tracer = tracer or NullTracer()
        self.step_count = 0
        self.drafter = make_drafter(model, cfg, self.tracer, rank) if cfg.speculative.method == "mtp" else None
        # the prefix cache's disk tier (prefix_cache_dir): pages keyed by the hash chain and what the rows are
        # (the weights' identity, dtype, layout incl. kv_cache_dtype, page size, sparse switch; DeepSeek-V4's
        # official-code roundings, which change the rows and snapshots a page holds); with MTP speculation a page
        # holds the MTP layer's rows too (page_layout), so such files are read only by an engine that drafts
        self.disk_tier = None
        if cfg.cache.prefix_cache_dir is not None and cfg.cache.enable_prefix_caching:
            identity = model_identity(
                f"{cfg.model!r}|{cfg.runtime.dtype}|{cfg.cache.kv_cache_dtype}|{cfg.cache.page_size}|"
                f"sparse={cfg.attention.sparse}" + (f"|{v4!r}" if (v4 := cfg.attention.v4_numerics).official else ""),
                model.state_dict(),
            )
            self.disk_tier = DiskTier(
                cfg.cache.prefix_cache_dir,
                int(cfg.cache.prefix_cache_dir_gib * 2**30),
                identity,
                self.page_layout(),
            )
        # the last verify step's rollback tape (models that roll back request states), consumed by rollback()
        self.tape = None
        # CUDA graphs of pure decode steps (cuda_graphs; executor/graph_plan.py decides per step, cuda_graphs.py
        # captures and replays): decided from the config once here, per step in execute
        self.graph_settings = GraphSettings(
            enabled=cfg.runtime.cuda_graphs,
            max_batch=cfg.runtime.cuda_graph_max_batch,
            page_size=cfg.cache.page_size,
            num_pages=cfg.cache.num_pages,
            disabled_why=f"cuda_graphs off ({_source(cfg, 'cuda_graphs')})",
            request_states=bool(self.cache.num_slots),
            quantized_cache=cfg.cache.kv_cache_dtype != "auto",
            model_blocker=capture_blocker(model),
        )
        self.graphs = None
        if cfg.runtime.cuda_graphs:
            from mlaserve.executor.cuda_graphs import DecodeGraphs  # torch.cuda's graph API: cuda only

            self.graphs = DecodeGraphs(model, self.cache)

    @property
    def tracer(self):
        return self._tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        """One ledger for the trunk and the MTP drafter: `mlaserve serve` swaps in its RouteTap after the
        load, and the drafter's `draft` records must follow (they feed /debug/routes and the MTP metrics)."""
        self._tracer = tracer
        if getattr(self, "drafter", None) is not None:
            self.drafter.tracer = tracer

    def _paged_caches(self) -> list[tuple[str, ModelCache]]:
        """The caches whose rows a page holds, with their part-name prefixes: the trunk's and, under MTP
        speculation, the drafter's own cache (same pages, same block tables): a prefix hit read from disk must
        bring the MTP's rows of the pages as an in-memory hit keeps them, or the drafter would attend over zero
        or a freed page's stale rows there."""
        out = [("", self.cache)]
        drafter_cache = getattr(getattr(self, "drafter", None), "cache", None)
        if drafter_cache is not None:
            out.append(("mtp.", drafter_cache))
        return out

    def page_layout(self) -> dict[str, tuple[str, tuple]]:
        """Every page part of every paged cache (the disk tier's layout): name -> (dtype name, page shape)."""
        return {p + k: v for p, c in self._paged_caches() for k, v in c.page_layout().items()}

    def gather_pages(self, pages: list[int]) -> dict[str, torch.Tensor]:
        """A copy of these pages' rows in every paged cache, per part [n, *page shape] (the disk writer's)."""
        return {p + k: v for p, c in self._paged_caches() for k, v in c.gather_pages(pages).items()}

    def load_pages(self, pages: list[int], parts: list[dict[str, torch.Tensor]]) -> None:
        """Write pages read from disk into every paged cache's rows of these pages."""
        for p, c in self._paged_caches():
            c.load_pages(pages, [{k[len(p) :]: v for k, v in d.items() if k.startswith(p)} for d in parts])

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
        batch, plan = self._batch_and_route(chunks)
        self._check_state_slots(batch)
        with torch.inference_mode():
            # a replayed step needs no eager StepContext (its padded one is built in _replay); a model with native
            # decode layers (CPU only) is never replayed
            graph = plan_graph(batch, plan, self.graph_settings, getattr(self.model, "native_decode", None) is not None)
            step = None if graph.replay else StepContext.build(batch, plan, self.model.rope, cfg.runtime.dtype)
            # decided before the math, recorded with the route
            native = None if graph.replay else self.model.fused_decode(step, self.cache)
            if self.tracer.enabled:
                rec = step_record(self.step_count, batch, plan, cfg.model.num_layers, preempted)
                rec["kernels"] = self._kernels_record(native)
                rec["kv_cache"] = self.kv_cache_layout
                rec["graph"] = graph.to_record()
                if graph.replay and self.graphs is not None:  # this step captures its bucket's graph first
                    rec["graph"]["capture"] = not self.graphs.captured(graph)
                rec = rec | (ledger(batch, plan) if ledger else {})
                self.tracer.record({"rank": self.rank, **rec} if cfg.parallel.world_size > 1 else rec)
            self.step_count += 1
            if batch.reset_slots:  # sequences that start here start from a zeroed state (plain data, decided
                # by the scheduler: SeqChunk.reset_state), before any layer reads its slot
                self.cache.reset_states(torch.tensor(batch.reset_slots, dtype=torch.long, device=cfg.runtime.device))
            if batch.restores:  # sequences that start at a prefix hit: their states as of the hit's last page
                slots, pages = zip(*batch.restores)
                dev = cfg.runtime.device
                self.cache.restore_states(
                    torch.tensor(slots, dtype=torch.long, device=dev), torch.tensor(pages, dtype=torch.long, device=dev)
                )
            self.tape = None
            if graph.replay:  # a pure decode step: its bucket's graph (plan_graph refused every other step)
                logits, hidden = self._replay(batch, plan, graph)
                return batch, logits[batch.logits_indices], hidden
            if self.cache.num_slots and any(step.drafts):  # a verify step over request states: the model's tape
                ids = tuple(s.request_id for s in batch.seqs)
                self.tape = self.model.verify_tape(step, self.cache, ids)
                hidden = self.model(batch.input_ids, step, self.cache, native, tape=self.tape)
            else:
                hidden = self.model(batch.input_ids, step, self.cache, native)
            logits = self.model.logits(hidden[batch.logits_indices])
        return batch, logits, hidden

    def _batch_and_route(self, chunks: list[SeqChunk]) -> tuple[ForwardBatch, StepRoute]:
        """The step's batch and its route (plain data, before the math): execute's, and padded_step's the same."""
        cfg = self.cfg
        batch = ForwardBatch.build(
            chunks,
            cfg.cache.page_size,
            cfg.scheduler.decode_threshold,
            cfg.runtime.device,
            self.cache.pad_slot,
            snapshots=self.cache.keeps_snapshots,
        )
        route = route_step(
            batch,
            self.layer_kinds,
            cfg.attention.mla_path,
            cfg.attention.sparse,
            cfg.attention.index_topk,
            cfg.runtime.dtype,
            cfg.attention.backend,
            self.v4_csa_dense,
            # DeepSeek-V4: the softmax its model was built to run (V4Serving), recorded as what ran
            getattr(self.model, "v4_implementation", "torch:padded_batch+batched_state"),
            cfg.attention.index_scores,
        )
        return batch, route

    def _replay(self, batch: ForwardBatch, route, graph: GraphPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden) of the step's real rows through its bucket's CUDA graph."""
        padded = pad_decode_step(batch, route, graph, self.model.rope, self.cfg.runtime.dtype, self.cfg.cache.page_size)
        return self.graphs.run(graph, padded)

    def padded_step(self, chunks: list[SeqChunk]) -> tuple[PaddedStep, GraphPlan]:
        """A pure decode step's padded form (what a graph captures and replays) and its graph plan, planned as if
        cuda_graphs were on and the weights capturable (model_blocker): the CPU tests' handle on the graph's body
        (fp32 ones included, to compare with transformers), the GPU tests' reference of a replay."""
        cfg = self.cfg
        batch, route = self._batch_and_route(chunks)
        graph = plan_graph(batch, route, replace(self.graph_settings, enabled=True, model_blocker=None))
        if not graph.replay:
            raise ValueError(f"padded_step: this step is not one a graph replays ({graph.reason})")
        with torch.inference_mode():
            return pad_decode_step(batch, route, graph, self.model.rope, cfg.runtime.dtype, cfg.cache.page_size), graph

    def padded_eager(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, GraphPlan]:
        """(logits [n, V] of the real rows, graph plan) of a pure decode step run padded, eagerly."""
        padded, graph = self.padded_step(chunks)
        with torch.inference_mode():
            logits, _ = run_padded(self.model, self.cache, padded)
        return logits[: graph.real_rows], graph

    def rollback(self, kept: dict[str, int]) -> None:
        """After the last verify step's verdict: kept[request_id] tokens of its chunk stay (1 + accepted drafts);
        the model puts the request states of the rest back (a model without request states needs nothing: its
        rejected rows are never read and the next step rewrites them)."""
        tape, self.tape = self.tape, None
        if tape is None:
            return
        self.model.rollback(tape, [kept[rid] for rid in tape.request_ids], self.cache, self.cfg.cache.page_size)

    def _check_state_slots(self, batch: ForwardBatch) -> None:
        """A model with request states needs every sequence's slot (in range); one without takes none."""
        if not batch.seqs or (not self.cache.num_slots and batch.state_slots is None):
            return  # today's models: nothing to check
        if self.cache.num_slots and batch.state_slots is None:
            raise ValueError(
                f"request {batch.seqs[0].request_id}: this model keeps request states; no state slot given"
            )
        if not self.cache.num_slots and batch.state_slots is not None:
            raise ValueError(f"request {batch.seqs[0].request_id}: a state slot given, and this model keeps none")
        for s in batch.seqs:
            if s.state_slot is not None and not 0 <= s.state_slot < self.cache.num_slots:
                raise ValueError(
                    f"request {s.request_id}: state slot {s.state_slot} outside [0, {self.cache.num_slots})"
                )

    def _kernels_record(self, native) -> dict:
        """The ledger's kernel fields: the load's KernelPlan by its digest (`mlaserve inspect` prints the plan),
        whether this step's decoder layers run as one native call each (decode_layer), and on such a step whether
        those calls are made as one for the whole trunk or layer by layer (decode_calls: "one", "per_layer")."""
        plan = getattr(self.model, "kernel_plan", None)
        rec = {"plan": plan.digest if plan is not None else None, "decode_layer": "native" if native else "per_op"}
        if native:
            rec["decode_calls"] = "one" if native.stack is not None else "per_layer"
        return rec

    def prompt_logits(
        self, request_id: str, ids: list[int], pages: list[int], state_slot: int | None = None
    ) -> torch.Tensor:
        """Logits at every position of ids [len, vocab], prefilled through `pages` in chunks of
        max_num_batched_tokens (the engine's normal path: paged cache, routed attention). state_slot: the
        request states' slot on a model that keeps them (zeroed at the first chunk); None otherwise."""
        ps, budget = self.cfg.cache.page_size, self.cfg.scheduler.max_num_batched_tokens
        out, done = [], 0
        while done < len(ids):
            chunk = tuple(ids[done : done + budget])
            table = tuple(pages[: -(-(done + len(chunk)) // ps)])
            fresh = state_slot is not None and done == 0
            seq = SeqChunk(request_id, chunk, done, table, all_logits=True, state_slot=state_slot, reset_state=fresh)
            out.append(self.execute([seq])[1])
            done += len(chunk)
        return torch.cat(out)


def _source(cfg: EngineConfig, name: str) -> str:
    """A setting's provenance source (the option's reason) for the runner's records."""
    return next((s.source for s in cfg.provenance if s.name == name), "not recorded")


def with_request_state_rules(
    cfg: EngineConfig, layers: tuple[LayerKind, ...], rolls_back: bool = False
) -> EngineConfig:
    """The engine rules a stack's request states impose, applied to the resolved config: prefix caching off
    (recorded with its reason) when a request state lacks page-boundary snapshots; speculative decoding
    refused unless the model rolls its states back after rejected drafts (rolls_back). A stack without
    request states gets cfg back unchanged (the same object)."""
    if not request_states(layers):
        return cfg
    if cfg.speculative.method is not None and not rolls_back:
        index, s = request_states(layers)[0]
        raise ConfigError(
            f"speculative={cfg.speculative.method!r}: layer {index}'s request state {s.name!r} would advance through "
            "drafts that verification rejects, and it cannot be rolled back; run without speculative decoding"
        )
    reason = prefix_caching_blocker(layers)
    if reason is None or not cfg.cache.enable_prefix_caching:
        return cfg
    note = Setting("enable_prefix_caching", False, f"engine: {reason}")
    kept = tuple(s for s in cfg.provenance if s.name != "enable_prefix_caching")
    return replace(cfg, cache=replace(cfg.cache, enable_prefix_caching=False), provenance=kept + (note,))

"""`mlaserve verify`: the engine's identities, checked on the user's own model and prompt.

Each check runs the same prompt through two routes that must agree and reports the max |diff|
of the logits and top-1 agreement:
  absorbed vs decompressed   every token through MQA vs every token through MHA
  chunked vs one pass        prefill in chunks of 7 tokens vs one forward
  decode path vs one pass    the prompt fed one token per step (every step a decode)
  sparse vs dense            DSA models, prompt within index_topk: the indexer must keep every row
  DeepSeek-V4                chunk ends at every residue mod each compression ratio, prefill then decode,
                             batch vs alone, CSA sparse vs dense within index_topk (verify_v4.py)
  backend vs reference       the configured attention backend against `reference` (the plain oracle),
                             on each path, and for DSA models on a sparse step whose top-k really selects
                             (index_topk lowered to half the prompt when the prompt fits in it)
  8-bit cache vs full        with kv_cache_dtype int8 / fp8_e4m3 (verify_kv8.py): every attention call within
                             the bound derived from the scales, the logits and (DSA) the top-k agreement
                             reported; the identities above then run over the full cache
  16-bit cache vs full       the same with kv_cache_dtype float16 / bfloat16, the bound from the unit roundoff
  bf16 vs fp32 index scores  with index_scores="bf16" (verify_index_scores.py): the kept positions' overlap and
                             the logits, reported
Where a DSA route selects, the second run of each pair takes the first's top-k at ties within fp32 noise
(verify_selection_pins.py), as DeepSeek-V4's schedules take the one pass's rounding decisions (verify_v4_pins.py).
What these cannot see: a fault that every route shares. Wrong weights (a converter that swapped two heads
of kv_b, a mis-sliced shard, a drifted quantized layer), model code outside attention (rope, norms, MoE
routing, the indexer's projections) and a config read wrongly all give the same wrong answer on every
route, so the routes agree. `mlaserve verify MODEL --against OTHER` (verify_against.py) compares with
another copy of the model instead and names the layer where they part ways.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mlaserve.config.engine import EngineConfig
from mlaserve.config.layer_kinds import LATENT_KINDS
from mlaserve.entrypoints import verify_selection_pins as selection_pins
from mlaserve.entrypoints.llm import LLM
from mlaserve.entrypoints.verify_index_scores import index_score_checks
from mlaserve.entrypoints.verify_kv8 import kv8_pairs
from mlaserve.entrypoints.verify_v4 import is_v4, v4_pairs
from mlaserve.entrypoints.verify_v4_kv8 import v4_kv8_checks
from mlaserve.entrypoints.verify_v4_pins import has_roundings, pinned_run, recorded
from mlaserve.executor.model_runner import ModelRunner


@dataclass(frozen=True)
class Check:
    name: str
    max_abs_diff: float
    top1_agreement: float
    tolerance: float | None  # None: informational (reduced precision, where routes round differently)
    note: str = ""  # what the numbers are, where they are not a logits comparison (verify_kv8.py)

    @property
    def passed(self) -> bool:
        if self.tolerance is None:
            return True
        return self.max_abs_diff <= self.tolerance and self.top1_agreement == 1.0


def logits_with(llm: LLM, cfg: EngineConfig, ids: list[int]) -> torch.Tensor:
    """Prompt logits through a fresh runner (own small cache) with the given switches."""
    cfg = replace(cfg, cache=replace(cfg.cache, num_pages=-(-len(ids) // cfg.cache.page_size) + 1))
    runner = ModelRunner(llm.loaded.model, cfg)
    slot = 0 if runner.cache.num_slots else None  # its own cache: slot 0 is free (request states only)
    return runner.prompt_logits("verify", ids, list(range(cfg.cache.num_pages)), slot)


def run_checks(llm: LLM, ids: list[int], tolerance: float | None = None) -> list[Check]:
    cfg = llm.config
    # exact compute: the routes agree to reassociation noise. A lossy switch (bf16 dtype, int8 / int16 activations,
    # bf16 prefill products, bf16 index scores) rounds each route at different points (a product's kernel follows
    # its row count) and a rounding can flip an MoE expert choice or a DSA selection, so the numbers are reported,
    # not judged (the `mlaserve verify` command sets the switches auto left lossy exact: commands/verification.py)
    lossy = lossy_switches(cfg)
    tol = tolerance if tolerance is not None else (None if lossy else 1e-4)
    unjudged = f"reported: {', '.join(lossy)} round each route differently" if lossy and tol is None else ""
    base = replace(cfg, scheduler=replace(cfg.scheduler, max_num_batched_tokens=max(len(ids), 1)))
    # the identities over full rows: over 8-bit rows two routes may round a value to neighbouring codes
    base = replace(base, cache=replace(base.cache, kv_cache_dtype="auto"))
    # the MLA paths and attention backends exist only for kinds over latent rows (a DeepSeek-V4 stack has
    # none: its checks are token by token here and its own in verify_v4.py; a pair that cannot differ is not listed)
    latent = any(k.attention in LATENT_KINDS for k in llm.runner.layer_kinds)
    v4 = is_v4(llm.runner.layer_kinds)  # V4 chunks by its compression ratios instead (verify_v4.py)
    # V4's official roundings decide a value within fp32 noise of a boundary by the schedule's summation order:
    # the one pass's decisions are recorded and the other one-sequence schedules take them (verify_v4_pins.py)
    # a DSA top-k within fp32 noise of a tie decides by the schedule's summation order the same way: the one pass's
    # selections are recorded and the other schedules take them where this run's scores tie (verify_selection_pins.py)
    model, log = llm.loaded.model, None
    with selection_pins.recorded(model) as picks:
        if v4 and has_roundings(model):
            with recorded(model) as log:
                full = logits_with(llm, base, ids)
        else:
            full = logits_with(llm, base, ids)
    pairs = []
    if not v4:
        chunked = replace(base, scheduler=replace(base.scheduler, max_num_batched_tokens=7))
        got, note = _pinned(model, log, picks, lambda: logits_with(llm, chunked, ids))
        pairs.append(("chunked prefill (7) vs one pass", got, full, note))
    token_by_token = replace(base, scheduler=replace(base.scheduler, max_num_batched_tokens=1))
    decoded, note = _pinned(model, log, picks, lambda: logits_with(llm, token_by_token, ids))
    if selection_pins.has_selections(picks) and selection_pins.has_fused_decode(model):
        note = "; ".join(n for n in (note, "per-op decode layers (the fused step's top-k is not seen)") if n)
    pairs.append(("token-by-token decode vs one pass", decoded, full, note))
    if latent:
        paths = [replace(base, attention=replace(base.attention, mla_path=p)) for p in ("absorbed", "decompressed")]
        pairs.insert(0, ("absorbed vs decompressed", *pinned_pair(llm, *paths, ids)))
    if cfg.model.indexer is not None and cfg.attention.index_topk:
        short = ids[: cfg.attention.index_topk]
        pairs.append(
            (
                f"sparse vs dense within index_topk ({len(short)} tokens)",
                logits_with(llm, replace(base, attention=replace(base.attention, sparse=True)), short),
                logits_with(llm, replace(base, attention=replace(base.attention, sparse=False)), short),
            )
        )
    pairs += _backend_pairs(llm, base, ids) if latent else []
    pairs += v4_pairs(llm, base, ids, full, decoded, log) if v4 else []
    if v4 and cfg.cache.kv_cache_dtype != "auto":
        # DeepSeek-V4's 8-bit pools hold exactly the values the official FP8 rounding makes (config/kv_cache.py
        # _quantize_v4), and the model rounds the full cache's rows the same way: an identity, not a bound
        codes = cfg.cache.kv_cache_dtype
        eight = logits_with(llm, replace(base, cache=replace(base.cache, kv_cache_dtype=codes)), ids)
        pairs.append((f"8-bit cache ({codes}) vs full cache + official FP8 rounding", eight, full))
    checks = [_compare(name, a, b, tol, "; ".join(n for n in (*note, unjudged) if n)) for name, a, b, *note in pairs]
    if cfg.cache.kv_cache_dtype != "auto" and not v4:
        checks += kv8_pairs(llm, base, ids, logits_with, Check)
    if cfg.cache.kv_cache_dtype != "auto" and v4:  # the 8-bit rows against the exact ones (verify_v4_kv8.py)
        checks += v4_kv8_checks(llm, base, ids, logits_with, Check)
    if cfg.attention.index_scores == "bf16" and len(ids) > 1:
        checks += index_score_checks(llm, base, ids, logits_with, Check)
    return checks


def _pinned(model, log: dict | None, picks: dict, run) -> tuple[torch.Tensor, str]:
    """run() with the one pass's decisions pinned: DeepSeek-V4's roundings (log) or a DSA stack's top-k (picks;
    neither when nothing was recorded) -> (its logits, what was pinned)."""
    if log is not None:
        return pinned_run(model, log, run)
    return selection_pins.pinned_run(model, picks, run)


def lossy_switches(cfg: EngineConfig) -> list[str]:
    """The engine's switches that round beyond fp32 reassociation, as "name value" (empty: exact compute)."""
    out = [] if cfg.runtime.dtype == torch.float32 else [f"dtype {str(cfg.runtime.dtype).removeprefix('torch.')}"]
    out += [
        f"{n} {v}"
        for n, v in (("activations", cfg.kernels.activations), ("prefill_matmul", cfg.kernels.prefill_matmul))
        if v != "float"
    ]
    return out + (["index_scores bf16"] if cfg.attention.index_scores == "bf16" else [])


def _backend_pairs(llm: LLM, base: EngineConfig, ids: list[int]) -> list[tuple[str, torch.Tensor, torch.Tensor, str]]:
    """The configured backend vs `reference` on the same route: absorbed, decompressed and, for a DSA
    model, a sparse step that selects (top-k below the prompt length, so index_topk really runs)."""
    name = base.attention.backend
    routes = [
        (f"{p} path", replace(base, attention=replace(base.attention, mla_path=p)))
        for p in ("absorbed", "decompressed")
    ]
    if base.model.indexer is not None and base.attention.index_topk and len(ids) > 1:
        k = min(base.attention.index_topk, len(ids) // 2)
        routes.append((f"sparse top-{k}", replace(base, attention=replace(base.attention, sparse=True, index_topk=k))))
    pairs = []
    for label, cfg in routes:
        reference = replace(cfg, attention=replace(cfg.attention, backend="reference"))
        pairs.append((f"{name} vs reference backend, {label}", *pinned_pair(llm, cfg, reference, ids)))
    return pairs


def pinned_pair(llm: LLM, a: EngineConfig, b: EngineConfig, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The prompt's logits under a and under b, b's DSA top-k pinned to a's where b's scores tie
    (verify_selection_pins.py) -> (a's, b's, what was pinned)."""
    model = llm.loaded.model
    with selection_pins.recorded(model) as picks:
        first = logits_with(llm, a, ids)
    second, note = selection_pins.pinned_run(model, picks, lambda: logits_with(llm, b, ids))
    return first, second, note


def tensor_parallel_check(llm: LLM, ids: list[int], n: int, options: dict) -> Check:
    """The same prompt through N ranks (the model split, logits gathered) vs this one process."""
    lossy = lossy_switches(llm.config)
    tol = None if lossy else 1e-4
    options = {**options, "tensor_parallel_size": n}
    name = f"tensor parallel {n} vs one process"
    note = f"reported: {', '.join(lossy)} round each split differently" if lossy else ""
    try:
        with LLM(str(llm.loaded.path), **options) as split:
            got = split.prompt_logits(ids)
        return _compare(name, got, llm.prompt_logits(ids), tol, note)
    except FloatingPointError:  # NaN/Inf logits (prompt_logits refuses them): a failed check, not a crash
        return Check(name, float("nan"), 0.0, 0.0 if tol is None else tol)


def _compare(name: str, a: torch.Tensor, b: torch.Tensor, tol: float | None, note: str = "") -> Check:
    note = f"tol {tol:g}; {note}" if note and tol is not None else note
    return Check(name, (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item(), tol, note)


def format_checks(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    lines = [f"{'check':<{w}}  max|diff|   top-1    result"]
    for c in checks:
        if c.note:
            verdict = f"{'info' if c.tolerance is None else 'ok' if c.passed else 'FAIL'}: {c.note}"
        elif c.tolerance is None:
            verdict = "info (run with --dtype float32 to judge)"
        else:
            verdict = f"{'ok' if c.passed else 'FAIL'} (tol {c.tolerance:g})"
        lines.append(f"{c.name:<{w}}  {c.max_abs_diff:9.2e}  {c.top1_agreement:6.1%}   {verdict}")
    return "\n".join(lines)

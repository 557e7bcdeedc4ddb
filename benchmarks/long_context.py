"""Long-context decode: dense vs sparse (DSA) attention on the DSA variant of the standard model.

    python benchmarks/long_context.py [--dtype float32|bfloat16] [--batch B] [--quick] [--threads 2]

The cache is filled with synthetic rows instead of a real prefill (a 16K prefill of a 0.7B model
takes minutes on 2 cores): pages are allocated from the engine's pool, every layer's latent rows
([RMSNorm'd c_kv * norm weight | k_pe ~ N(0,1)]) and indexer keys (LayerNorm'd with the model's
k_norm) are written at the request's slots, then single-token decode chunks with context_len = N
are timed through `runner.execute` (forward + logits of that token; no scheduling or sampling).
--batch B runs B such requests (each with its own pages and rows, all at context N) in one step.
Dense = LLM(..., attention="dense") (indexer skipped, MQA over all N rows); sparse = the default
(indexer scores all N keys, keeps top index_topk=2048, MQA over those).
The indexer's share of the sparse step is timed by wrapping Indexer.project and Indexer.select.
Results: a table on stdout, benchmarks/results/long_context[-quick].json, and docs/long_context.png
when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_DIR,
    count_params,
    ensure_model,
    environment,
    fill_mlaserve_cache,
    fmt,
    mem_available_gib,
    print_table,
    rss_gib,
    write_json,
)

PAGE_SIZE = 16
FULL = dict(contexts=[1024, 4096, 16384, 32768], reps=5, warmup=2)
QUICK = dict(contexts=[1024, 4096], reps=3, warmup=1)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REPO = Path(__file__).resolve().parent.parent


class IndexerClock:
    """Wraps Indexer.project / Indexer.select (class-level) and sums their wall time while on."""

    def __init__(self) -> None:
        from mlaserve.models.indexer import Indexer

        self.cls, self.on = Indexer, False
        self.total = {"project": 0.0, "select": 0.0}
        self.orig = {k: getattr(Indexer, k) for k in self.total}
        for k, fn in self.orig.items():
            setattr(Indexer, k, self._wrap(k, fn))

    def _wrap(self, key, fn):
        def wrapper(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[key] += time.perf_counter() - t0

        return wrapper

    def reset(self) -> None:
        self.total = dict.fromkeys(self.total, 0.0)

    def restore(self) -> None:
        for k, fn in self.orig.items():
            setattr(self.cls, k, fn)


def memory_plan(folder: Path, dtype: torch.dtype, contexts: list[int], cfg: dict, batch: int) -> tuple[list[int], dict]:
    """Both engines are resident at once (dense and sparse, interleaved). Drop contexts whose two
    models + two caches (+ 2 GiB headroom) would not fit in 90% of MemAvailable."""
    esize = torch.empty((), dtype=dtype).element_size()
    model_gib = count_params(folder) * esize / 2**30
    latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * cfg["num_hidden_layers"] * esize
    index = cfg["index_head_dim"] * cfg["num_hidden_layers"] * esize
    per_tok = 2 * latent + index  # dense cache (latent only) + sparse cache (latent + indexer keys)
    avail = mem_available_gib()
    keep, plan = (
        [],
        {"available_gib": avail, "model_gib": model_gib, "cache_bytes_per_token_both": per_tok, "contexts": {}},
    )
    for n in contexts:
        need = 2 * model_gib + batch * (n + 2 * PAGE_SIZE) * per_tok / 2**30 + 2.0
        ok = need < 0.9 * avail
        plan["contexts"][n] = {"need_gib": need, "fits": ok}
        if ok:
            keep.append(n)
        else:
            print(f"[memory] context {n}: needs ~{need:.1f} GiB, {avail:.1f} GiB available -- skipped", flush=True)
    return keep, plan


class Engine:
    """One LLM (dense or sparse) with `batch` requests whose pages hold n_max synthetic rows each."""

    def __init__(self, folder: Path, mode: str, dtype: str, n_max: int, batch: int) -> None:
        from mlaserve import LLM

        self.mode = mode
        pages_needed = math.ceil((n_max + 1) / PAGE_SIZE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # attention='dense' on a DSA model warns (intended here)
            self.llm = LLM(
                model=str(folder),
                dtype=dtype,
                attention=mode,
                page_size=PAGE_SIZE,
                max_num_seqs=batch,
                num_pages=batch * pages_needed + 1,
                threads=torch.get_num_threads(),  # the benchmark's --threads
                malloc_tuning=True,  # as the CLI and server run
            )
        assert self.llm.config.attention.sparse == (mode == "sparse"), (mode, self.llm.config.attention.sparse)
        self.pages = [self.llm.engine.pool.allocate(pages_needed) for _ in range(batch)]
        t0 = time.perf_counter()
        for i, pages in enumerate(self.pages):
            fill_mlaserve_cache(self.llm, pages, n_max, seed=1 + i)
        print(
            f"[{mode}] loaded; cache filled with {batch} x {n_max} synthetic rows in {time.perf_counter() - t0:.1f} s; "
            f"RSS {rss_gib():.1f} GiB",
            flush=True,
        )

    def chunks(self, n: int) -> list:
        """One single-token decode chunk per request, each at context n."""
        from mlaserve.executor.forward_batch import SeqChunk

        used = math.ceil((n + 1) / PAGE_SIZE)
        return [SeqChunk(f"long-{self.mode}-{i}", (5,), n, tuple(p[:used])) for i, p in enumerate(self.pages)]


def run(engines: dict, contexts: list[int], reps: int, warmup: int, clock: IndexerClock) -> dict:
    """Per context, dense and sparse steps alternate rep by rep, so load drift hits both alike."""
    out = {m: {} for m in engines}
    for n in contexts:
        chunks = {m: e.chunks(n) for m, e in engines.items()}
        for _ in range(warmup):
            for m, e in engines.items():
                e.llm.runner.execute(chunks[m])
        ts = {m: [] for m in engines}
        idx = {m: [] for m in engines}
        for _ in range(reps):
            for m, e in engines.items():
                clock.reset()
                clock.on = True
                t0 = time.perf_counter()
                e.llm.runner.execute(chunks[m])
                ts[m].append(time.perf_counter() - t0)
                clock.on = False
                idx[m].append(dict(clock.total))
        for m in engines:
            med = statistics.median(ts[m])
            i_med = {k: statistics.median(d[k] for d in idx[m]) for k in ("project", "select")}
            out[m][n] = {
                "step_ms": med * 1e3,
                "min_ms": min(ts[m]) * 1e3,
                "all_ms": [t * 1e3 for t in ts[m]],
                "indexer_project_ms": i_med["project"] * 1e3,
                "indexer_select_ms": i_med["select"] * 1e3,
                "indexer_share": (i_med["project"] + i_med["select"]) / med,
            }
        d, sp = out["dense"][n], out["sparse"][n]
        print(
            f"context {n}: dense {d['step_ms']:.1f} ms, sparse {sp['step_ms']:.1f} ms "
            f"(indexer {sp['indexer_share'] * 100:.0f}%)",
            flush=True,
        )
    return out


def profile_at(engines: dict, n: int, steps: int = 3) -> dict:
    """Top aten ops (self time) of the dense and the sparse step at context n."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for m, e in engines.items():
        chunks = e.chunks(n)
        e.llm.runner.execute(chunks)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                e.llm.runner.execute(chunks)
        ev = prof.key_averages()
        total = sum(x.self_cpu_time_total for x in ev)
        top = sorted(ev, key=lambda x: -x.self_cpu_time_total)[:12]
        out[m] = [
            {
                "op": x.key,
                "self_ms_per_step": x.self_cpu_time_total / 1e3 / steps,
                "pct": 100 * x.self_cpu_time_total / total,
                "calls_per_step": x.count / steps,
            }
            for x in top
        ]
        print(f"\n{m} step at context {n}: top aten ops by self time")
        print_table(
            ["op", "ms/step", "%", "calls/step"],
            [
                [o["op"], f"{o['self_ms_per_step']:.1f}", f"{o['pct']:.1f}", f"{o['calls_per_step']:.0f}"]
                for o in out[m]
            ],
        )
    return out


def plot(res: dict, contexts: list[int], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("dense", "sparse"):
        ax.plot(contexts, [res[mode][n]["step_ms"] for n in contexts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--quick", action="store_true", help="2-layer model, contexts 1K and 4K: a smoke test")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="requests per decode step, each at the same context")
    p.add_argument("--contexts", type=int, nargs="*", default=None, help="override the context lengths")
    p.add_argument(
        "--profile-at",
        type=int,
        default=None,
        help="also torch.profile both steps at this context (one of the measured ones)",
    )
    return p.parse_args()


def report(res: dict, contexts: list[int], args: argparse.Namespace, cfg: dict) -> tuple[str, str | None]:
    """Print the table and the 16K verdict; return both."""
    rows = []
    for n in contexts:
        d, sp = res["dense"][n], res["sparse"][n]
        rows.append(
            [
                f"{n:,}",
                fmt(d["step_ms"]),
                fmt(sp["step_ms"]),
                f"{d['step_ms'] / sp['step_ms']:.2f}x",
                fmt(sp["indexer_project_ms"] + sp["indexer_select_ms"]),
                f"{sp['indexer_share'] * 100:.0f}%",
                fmt(sp["indexer_select_ms"]),
                fmt(sp["indexer_project_ms"]),
            ]
        )
    print()
    print(
        f"decode step, batch {args.batch}, DSA model ({cfg['num_hidden_layers']} layers, index_topk {cfg['index_topk']}), "
        f"dtype {args.dtype}, {args.threads} threads{', QUICK' if args.quick else ''}"
    )
    table = print_table(
        ["context", "dense ms", "sparse ms", "dense/sparse", "indexer ms", "indexer share", "select ms", "project ms"],
        rows,
    )
    verdict = None
    if 16384 in contexts:
        sp = res["dense"][16384]["step_ms"] / res["sparse"][16384]["step_ms"]
        verdict = f"sparse is {sp:.2f}x dense at 16K (target >= 1.5x: {'met' if sp >= 1.5 else 'NOT met'})"
        print(verdict)
    return table, verdict


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    s = dict(QUICK if args.quick else FULL)
    if args.contexts:
        s["contexts"] = sorted(args.contexts)
    wall0 = time.perf_counter()
    folder = ensure_model("dsa", args.quick)
    cfg = json.loads((folder / "config.json").read_text())
    env = environment(args.threads)
    contexts, mem = memory_plan(folder, DTYPES[args.dtype], s["contexts"], cfg, args.batch)
    print(
        f"[env] {env['cpu']}, {env['cpus']} CPUs, torch threads {args.threads}, loadavg {env['loadavg_start']}; "
        f"memory available {mem['available_gib']:.1f} GiB, contexts {contexts}",
        flush=True,
    )
    clock = IndexerClock()
    engines = {m: Engine(folder, m, args.dtype, max(contexts), args.batch) for m in ("dense", "sparse")}
    try:
        res = run(engines, contexts, s["reps"], s["warmup"], clock)
    finally:
        clock.restore()
    prof = profile_at(engines, args.profile_at) if args.profile_at in contexts else None
    wall = time.perf_counter() - wall0
    table, verdict = report(res, contexts, args, cfg)
    env["loadavg_end"] = list(os.getloadavg())
    tag = (
        f"{'-quick' if args.quick else ''}{'' if args.dtype == 'float32' else '-' + args.dtype}"
        f"{'' if args.batch == 1 else f'-b{args.batch}'}"
    )
    title = f"mlaserve decode step, DSA model, {args.dtype}, batch {args.batch}"
    plot_note = (
        plot(res, contexts, REPO / "docs" / f"long_context{tag}.png", title) if not args.quick else "quick: no plot"
    )
    print(
        f"{plot_note}\nwall time {wall:.0f} s; loadavg start {env['loadavg_start']} end {env['loadavg_end']} "
        f"(other processes share the CPUs: absolute numbers are pessimistic)"
    )
    write_json(
        RESULTS_DIR / f"long_context{tag}.json",
        {
            "benchmark": "long_context",
            "dtype": args.dtype,
            "batch": args.batch,
            "quick": args.quick,
            "settings": s,
            "env": env,
            "wall_s": wall,
            "memory": mem,
            "model": {"folder": str(folder), "params": count_params(folder), "config": cfg},
            "results": res,
            "profile": prof,
            "target_16k": verdict,
            "plot": plot_note,
            "table": table,
            "notes": [
                "synthetic cache rows, single-token decode through runner.execute (forward + logits)",
                "dense and sparse engines are both resident; their steps alternate rep by rep",
                "indexer share = (Indexer.project + Indexer.select wall time) / sparse step time",
                "dense skips the indexer entirely (attention='dense')",
            ],
        },
    )


if __name__ == "__main__":
    main()

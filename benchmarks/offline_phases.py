"""The measurements of benchmarks/offline.py's run: the prompts (fixed up front, the same for every engine), the
phases (each fills one engine's results), the run of every phase on every engine, the greedy agreement between
engines, and the batch-1 roofline."""

from __future__ import annotations

import os

from offline_engines import Engine

# the measurements `--phases` can pick (cN: N concurrent requests); warm-up and info always run
PHASES = ("prefill", "decode", "long", "c4", "c16", "kv", "steps")


# =====================================================================================================
# the run: phases, each run for every engine (interleaved) or per engine (--sequential)
# =====================================================================================================
def prompts_for(s: dict, vocab: int) -> dict:
    """Every prompt of the run, fixed up front: each engine gets the same token ids; within an
    engine every prompt is distinct (mlaserve's prefix cache would otherwise serve repeats)."""
    from common import random_prompt

    return {
        "warmup": [random_prompt(16, vocab, 1), random_prompt(16, vocab, 2)],
        "warmup_prefill": random_prompt(s["prefill_len"], vocab, 90),
        "prefill": [random_prompt(s["prefill_len"], vocab, 100 + r) for r in range(s["prefill_reps"])],
        "decode": [random_prompt(s["dec_prompt"], vocab, 500 + r) for r in range(s["dec_reps"])],
        "long": [random_prompt(s["long_prompt"], vocab, 700 + r) for r in range(s["long_reps"])],
        "conc": {
            b: [
                [random_prompt(s["conc_prompt"], vocab, 1000 + 100 * b + 20 * r + i) for i in range(b)]
                for r in range(s["conc_reps"])
            ]
            for b in s["concs"]
        },
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def phases(s: dict, P: dict, res: dict, greedy: dict, only: list[str] | None = None):
    """(name, fn(engine)) in run order; each fn fills res[engine.spec]. `only`: the PHASES keys to run
    (None: all); the warm-up and info phases always run."""

    def warmup(e):  # lazy initialisation, allocator, native kernel builds: not measured
        e.call("generate", P["warmup"], 2)
        # and one prompt of the measured length, as llama-bench warms up before its prompt test: a process's
        # first long prompt also pages in the mapped file's blocks that the short prompts did not touch (most
        # routed experts; from disk where the page cache lost them: 1.2 s more on glm-real's Q8_0 file) and
        # first-touches the step's temporaries, start costs that the prefill figure (a median of 2 is their mean)
        # would take in at half weight; its wall time stays in the JSON (prefill_warmup_s)
        if only is None or "prefill" in only:
            r = e.call("generate", [P["warmup_prefill"]], 1)
            if r:
                res[e.spec]["prefill_warmup_s"] = r["wall_s"]

    def prefill(e):
        walls = [r["wall_s"] for p in P["prefill"] if (r := e.call("generate", [p], 1))]
        if walls:
            res[e.spec]["prefill_tok_s"] = s["prefill_len"] / _median(walls)
            res[e.spec]["prefill_s"] = walls
            print(f"  {e.spec}: {res[e.spec]['prefill_tok_s']:.1f} tok/s", flush=True)

    def decode(e):
        rates = []
        for rep, p in enumerate(P["decode"]):
            r = e.call("generate", [p], s["dec_new"])
            if r:
                rates.append(r["rate_b1"])
                if r["ids"] is not None:  # a tool-driven engine (ik_llama.cpp) returns no tokens
                    greedy.setdefault(rep, {})[e.spec] = r["ids"]
        if rates:
            res[e.spec]["decode_tok_s_b1"] = _median(rates)
            res[e.spec]["decode_tok_s_b1_all"] = rates
            print(f"  {e.spec}: {res[e.spec]['decode_tok_s_b1']:.2f} tok/s", flush=True)

    def long(e):
        rates = [r["rate_b1"] for p in P["long"] if (r := e.call("generate", [p], s["long_new"]))]
        if rates:
            res[e.spec]["decode_tok_s_long"] = _median(rates)
            print(f"  {e.spec}: {res[e.spec]['decode_tok_s_long']:.2f} tok/s", flush=True)

    def conc(b):
        def run(e):
            rs = [r for ps in P["conc"][b] if (r := e.call("generate", ps, s["conc_new"]))]
            if rs:
                wall = _median([r["wall_s"] for r in rs])
                dec = _median([r["wall_s"] - r["first_s"] for r in rs])
                res[e.spec][f"output_tok_s_c{b}"] = b * s["conc_new"] / wall
                res[e.spec][f"decode_tok_s_c{b}"] = b * (s["conc_new"] - 1) / dec if s["conc_new"] > 1 else None
                res[e.spec][f"concurrent_{b}"] = rs and [{k: r[k] for k in ("wall_s", "first_s")} for r in rs]
                print(
                    f"  {e.spec}: {res[e.spec][f'output_tok_s_c{b}']:.1f} tok/s ({wall:.1f} s), "
                    f"decode-only {res[e.spec][f'decode_tok_s_c{b}']:.1f} tok/s",
                    flush=True,
                )

        return run

    def kv(e):
        v = e.call("kv_bytes")
        if v:
            res[e.spec]["kv_bytes_per_token"] = v

    def steps(e):
        v = e.call("step_times", s["contexts"], s["step_reps"], s["step_warmup"])
        if v:
            res[e.spec]["step_ms"] = {int(k): ms for k, ms in v.items()}

    def info(e):
        res[e.spec]["info"] = e.call("info")
        res[e.spec]["load_s"] = e.load.get("load_s")
        res[e.spec]["rss_after_load_gib"] = (e.load.get("rss_gib") or {}).get("vmrss_gib")
        res[e.spec]["peak_rss_gib"] = e.last_rss.get("vmhwm_gib")
        weights = e.path / "model.safetensors" if e.path.is_dir() else e.path
        if res[e.spec]["peak_rss_gib"]:
            res[e.spec]["rss_over_weights"] = res[e.spec]["peak_rss_gib"] * 2**30 / weights.stat().st_size

    out = [
        (None, "warm-up", warmup),
        ("prefill", f"prefill {s['prefill_len']}", prefill),
        ("decode", f"decode batch 1 ({s['dec_prompt']}+{s['dec_new']})", decode),
        ("long", f"decode batch 1 at context {s['long_prompt']} ({s['long_prompt']}+{s['long_new']})", long),
    ]
    out += [(f"c{b}", f"{b} concurrent ({s['conc_prompt']}+{s['conc_new']})", conc(b)) for b in s["concs"]]
    out += [("kv", "KV bytes per token", kv), ("steps", "decode step vs context", steps), (None, "info", info)]
    return [(name, fn) for key, name, fn in out if key is None or only is None or key in only]


def run_engines(
    engines: list[Engine], s: dict, P: dict, sequential: bool, only: list[str] | None = None, on_phase=None
) -> tuple[dict, dict]:
    """Every phase on every engine. res["loadavg"] keeps the 1/5/15-minute load average at the start of
    each phase (per engine and phase with --sequential): on a shared machine a figure means little without
    the load it was measured under. on_phase(res): called after each phase (main writes the partial JSON, so
    a run stopped on a loaded machine keeps the phases it finished)."""
    res: dict = {e.spec: {} for e in engines}
    res["loadavg"] = []
    greedy: dict = {}
    ph = phases(s, P, res, greedy, only)

    def header(name: str, spec: str | None = None) -> None:
        load = [round(x, 2) for x in os.getloadavg()]
        res["loadavg"].append({"phase": name, **({"engine": spec} if spec else {}), "loadavg": load})
        print(f"[{name}] loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    if sequential:
        for e in engines:
            if e.start():
                for name, fn in ph:
                    header(name, e.spec)
                    fn(e)
                    if on_phase is not None:
                        on_phase(res)
            e.stop()
    else:
        live = [e for e in engines if e.start()]
        for name, fn in ph:
            header(name)
            for e in live:
                fn(e)
            if on_phase is not None:
                on_phase(res)
        for e in live:
            e.stop()
    return res, greedy


def _agreement(a: list[int], b: list[int]) -> str:
    """Leading identical tokens of two greedy continuations, as 'n/len'."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(a)}"


def agreement(greedy: dict, engines: list[Engine]) -> dict:
    specs = [e.spec for e in engines]
    out = {}
    for i, a in enumerate(specs):
        for b in specs[i + 1 :]:
            pairs = [_agreement(d[a], d[b]) for d in greedy.values() if a in d and b in d]
            if pairs:
                out[f"{a} vs {b}"] = pairs
    return out


# -- the roofline ---------------------------------------------------------------------------------------
def roofline(engines: list[Engine], files: dict, dtype: str, threads: int, quick: bool) -> dict:
    """Copy bandwidth, and per weight file the bytes (and parameters) a batch-1 decode step reads."""
    from roofline import active_weight_bytes, copy_bandwidth_gbs

    bw = copy_bandwidth_gbs(threads, 256 if quick else 1024)
    formats, of = {}, {}
    for e in engines:
        quant = e.options.get("quantization") if e.weights == "folder" else None
        key = f"folder, {quant} at load" if quant else e.weights
        of[e.spec] = key
        if key not in formats:
            path = files[e.weights]
            formats[key] = (
                active_weight_bytes(path, 2 if dtype == "bfloat16" else 4, quant)
                if path.is_dir()
                else active_weight_bytes(path)
            )
            formats[key]["roofline_tok_s"] = bw * 1e9 / formats[key]["bytes"]
    print(
        f"[roofline] copy bandwidth {bw:.1f} GB/s ({threads} threads); active weights per token: "
        + "; ".join(f"{k} {v['bytes'] / 1e6:.0f} MB ({v['params'] / 1e6:.1f} M params)" for k, v in formats.items()),
        flush=True,
    )
    return {"copy_bandwidth_gbs": bw, "formats": formats, "engine_format": of}

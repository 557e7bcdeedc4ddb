"""`mlaserve serve` under load: a streaming client ramps concurrency and reports output tokens/s,
TTFT and TPOT (p50/p99) and the server's RSS; the same requests through offline `LLM.generate`
give the targets' baselines (throughput at 16 streams, prefill time at 1 stream). Also measures
the route ledger's cost per step (the server keeps it on: a ring for /debug/routes + metrics).

    python benchmarks/serve.py                  # standard model, 1/4/16/64 streams, prompts 128-512, outputs 128
    python benchmarks/serve.py --quick          # 2-layer model, 1/4 streams, short prompts: a smoke test

Requests: prompt lengths spread evenly over [min, max], random token ids (seeded), greedy,
ignore_eos (every request makes exactly --output tokens). Results: benchmarks/results/serve[-quick].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import RESULTS_DIR, ensure_model, environment, print_table, random_prompt, write_json

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2-layer model, 1/4 streams, short prompts")
    p.add_argument("--streams", type=int, nargs="+", default=None, help="concurrency levels (default 1 4 16 64)")
    p.add_argument("--prompt", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="prompt lengths")
    p.add_argument("--output", type=int, default=None, help="output tokens per request (default 128)")
    p.add_argument("--threads", type=int, default=2, help="OMP threads of the server and the offline engine")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.streams = args.streams or ([1, 4] if args.quick else [1, 4, 16, 64])
    args.prompt = args.prompt or ([32, 64] if args.quick else [128, 512])
    args.output = args.output or (16 if args.quick else 128)
    return args


def requests_for(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    return [random_prompt(length, vocab, seed + i) for i, length in enumerate(lengths)]


class Server:
    def __init__(self, folder: Path, args) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "serve", str(folder), "--port", "0"]
        cmd += ["--dtype", args.dtype, "--max-num-seqs", str(max(args.streams)), "--max-queued", "0"]
        cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        for line in self.proc.stdout:
            m = re.search(r"serving (\S+) on (http://\S+)", line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
        else:
            raise RuntimeError("the server did not start")

    def rss_gib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def one_stream(client: httpx.AsyncClient, server: Server, prompt: list[int], output: int) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    t0, stamps, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(tokens - 1, 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "end": stamps[-1] - t0}


async def level(server: Server, prompts: list[list[int]], output: int) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(client, server, p, output) for p in prompts))
        wall = time.perf_counter() - t0
    return {
        "streams": len(prompts),
        "output_tok_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_p50": _pct([r["ttft"] for r in runs], 50),
        "ttft_p99": _pct([r["ttft"] for r in runs], 99),
        "tpot_p50": _pct([r["tpot"] for r in runs], 50),
        "tpot_p99": _pct([r["tpot"] for r in runs], 99),
        "wall_s": wall,
        "server_rss_gib": server.rss_gib(),
    }


def _pct(xs: list[float], q: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def offline(folder: Path, args, sets: dict[int, list[list[int]]]) -> dict:
    """Offline LLM.generate on the same requests, and the route ledger's cost per step."""
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.sampling.params import SamplingParams

    llm = LLM(str(folder), dtype=args.dtype, max_num_seqs=max(args.streams), malloc_tuning=True, threads=args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    out = {}
    for n, prompts in sets.items():
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        out[n] = {"output_tok_s": n * args.output / (time.perf_counter() - t0)}
    one = sets[min(sets)][0]
    t0 = time.perf_counter()
    llm.generate([one], SamplingParams(temperature=0, max_tokens=1))
    out["prefill_s"] = time.perf_counter() - t0
    out["ledger"] = ledger_cost(llm, sets[max(sets)], args.output)
    return out


def ledger_cost(llm, prompts: list[list[int]], output: int) -> dict:
    """Time spent building and keeping the step record (what the server adds per step), measured
    around model_runner.step_record and the server's RouteTap, against the mean step time."""
    import mlaserve.executor.model_runner as mr
    from mlaserve.observability.metrics import RouteTap, ServerMetrics
    from mlaserve.observability.trace import MemoryTracer
    from mlaserve.sampling.params import SamplingParams

    spent, steps = [0.0], [0]
    build = mr.step_record

    def timed_record(*a, **kw):
        t = time.perf_counter()
        rec = build(*a, **kw)
        spent[0] += time.perf_counter() - t
        steps[0] += 1
        return rec

    tap = RouteTap(MemoryTracer(2000), ServerMetrics().on_route)
    keep = tap.record

    def timed_keep(rec):
        t = time.perf_counter()
        keep(rec)
        spent[0] += time.perf_counter() - t

    tap.record, mr.step_record, llm.runner.tracer = timed_keep, timed_record, tap
    t0 = time.perf_counter()
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
    finally:
        mr.step_record = build
    step = (time.perf_counter() - t0) / max(steps[0], 1)
    per = spent[0] / max(steps[0], 1)
    return {"steps": steps[0], "ledger_us_per_step": per * 1e6, "step_ms": step * 1e3, "share": per / step}


def main() -> None:
    args = parse_args()
    folder = ensure_model("standard", args.quick)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    sets = {n: requests_for(n, *args.prompt, vocab, seed=100 * n) for n in args.streams}
    env = environment(args.threads)
    server = Server(folder, args)
    try:
        asyncio.run(level(server, sets[min(sets)][:1], 4))  # warm-up
        online = {n: asyncio.run(level(server, sets[n], args.output)) for n in args.streams}
    finally:
        server.stop()
    base = offline(folder, args, sets)
    report(args, online, base)
    out = Path(args.out) if args.out else RESULTS_DIR / f"serve{'-quick' if args.quick else ''}.json"
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(out, {"settings": settings, "environment": env, "online": online, "offline": base})
    print(f"wrote {out}")


def report(args, online: dict, base: dict) -> None:
    rows = []
    for n, r in online.items():
        off = base[n]["output_tok_s"]
        rows.append(
            [n, f"{r['output_tok_s']:.1f}", f"{off:.1f}", f"{r['output_tok_s'] / off:.0%}"]
            + [f"{r[k] * 1e3:.0f}" for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]
            + [f"{r['server_rss_gib']:.2f}"]
        )
    headers = [
        "streams",
        "server tok/s",
        "offline tok/s",
        "ratio",
        "TTFT p50 ms",
        "p99",
        "TPOT p50 ms",
        "p99",
        "RSS GiB",
    ]
    print_table(headers, rows)
    first = online[min(online)]
    print(
        f"TTFT p50 at {min(online)} stream: {first['ttft_p50'] * 1e3:.0f} ms; offline prefill {base['prefill_s'] * 1e3:.0f} ms "
        f"(ratio {first['ttft_p50'] / base['prefill_s']:.2f})"
    )
    led = base["ledger"]
    print(
        f"route ledger: {led['ledger_us_per_step']:.0f} us per step over {led['steps']} steps "
        f"(mean step {led['step_ms']:.1f} ms: {led['share']:.2%})"
    )


if __name__ == "__main__":
    main()

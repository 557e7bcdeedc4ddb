"""`mlaserve serve` under load: a streaming client ramps concurrency and reports output tokens/s,
TTFT and TPOT (p50/p99) and the server's RSS; the same requests through offline `LLM.generate`
give the targets' baselines (throughput at 16 streams, prefill time at 1 stream). Also measures
the route ledger's cost per step (the server keeps it on: a ring for /debug/routes + metrics).

    python benchmarks/serve.py                  # standard model, 1/4/16/64 streams, prompts 128-512, outputs 128
    python benchmarks/serve.py --quick          # 2-layer model, 1/4 streams, short prompts: a smoke test
    python benchmarks/serve.py --constrained    # embedded model: json_schema vs unconstrained at 16 streams,
                                                # and the grammar compile time of a 20-tool request
    python benchmarks/serve.py --constrained --model standard   # the same on the standard model (vocab 32,768)
    python benchmarks/serve.py --mask-cost      # the mask step per decode step at vocab 4K / 32K / 129K

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
from model_files import with_tokenizer

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
    p.add_argument(
        "--constrained",
        action="store_true",
        help="on the embedded model (it has a tokenizer and a chat template): chat streams under response_format "
        "json_schema vs unconstrained (default 16 streams), and the grammar compile time of a request with 20 tools",
    )
    p.add_argument("--rounds", type=int, default=2, help="--constrained: alternating rounds of each arm")
    p.add_argument(
        "--model",
        choices=("embedded", "standard"),
        default="embedded",
        help="--constrained: the embedded model (vocabulary 4,096, its chat template) or the standard model "
        "(vocabulary 32,768, a synthetic byte-level tokenizer, the plain transcript)",
    )
    p.add_argument(
        "--mask-cost",
        action="store_true",
        help="in process, no model: the grammar mask step's cost per decode step (16 json_schema rows: xgrammar's "
        "fill + the batched bias/mask) at vocabularies 4,096 / 32,768 / 129,280 beside that vocabulary's "
        "lm_head product (hidden 1,024), the step cost that grows with the vocabulary",
    )
    args = p.parse_args()
    if args.constrained:
        args.streams = args.streams or [16]
        args.output = args.output or (32 if args.quick else 128)
        return args
    args.streams = args.streams or ([1, 4] if args.quick else [1, 4, 16, 64])
    args.prompt = args.prompt or ([32, 64] if args.quick else [128, 512])
    args.output = args.output or (16 if args.quick else 128)
    return args


def requests_for(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    return [random_prompt(length, vocab, seed + i) for i, length in enumerate(lengths)]


class Server:
    def __init__(self, folder: Path | None, args) -> None:
        """folder None: the embedded model (`mlaserve serve` without a model)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        model = [str(folder)] if folder is not None else []
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "serve", *model, "--port", "0"]
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


async def one_stream(client: httpx.AsyncClient, server: Server, prompt: list[int] | dict, output: int) -> dict:
    """prompt: token ids (/v1/completions), or a chat request's fields (/v1/chat/completions)."""
    chat = isinstance(prompt, dict)
    body = {"model": server.model, "max_tokens": output, "temperature": 0, "ignore_eos": True}
    body |= prompt if chat else {"prompt": prompt}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    t0, stamps, tokens = time.perf_counter(), [], 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", server.url + path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and (not chat or chunk["choices"][0]["delta"].get("content")):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(tokens - 1, 1)
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "end": stamps[-1] - t0}


async def level(server: Server, prompts: list, output: int) -> dict:
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
        "tokens": [r["tokens"] for r in runs],
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


# --constrained: the same chat streams with and without response_format json_schema. The schema asks for
# more items than --output tokens can hold, so neither arm ends before max_tokens: the grammar allows no EOS
# before the end of the object (the server refuses ignore_eos with a response_format), the other arm ignores it.
NOTES_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}},
    "required": ["notes"],
}


def chat_requests(n: int, arm: str, rnd: int, constrained: bool) -> list[dict]:
    """Distinct prompts per arm and round (no prefix-cache hits across them)."""
    out = []
    for i in range(n):
        req = {"messages": [{"role": "user", "content": f"List notes about item {arm}-{rnd}-{i} of the inventory."}]}
        if constrained:
            req["response_format"] = {"type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES_SCHEMA}}
            req["ignore_eos"] = False
        out.append(req)
    return out


def twenty_tools(tag: str) -> list[dict]:
    kinds = [
        {"type": "string", "maxLength": 32},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["low", "medium", "high"]},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    ]
    tools = []
    for i in range(20):
        props = {f"arg{j}": kinds[(i + j) % len(kinds)] for j in range(3 + i % 3)}
        schema = {"type": "object", "properties": props, "required": sorted(props)[:2]}
        fn = {"name": f"tool_{tag}_{i}", "description": f"tool number {i}", "parameters": schema}
        tools.append({"type": "function", "function": fn})
    return tools


def compile_times(args, sets: int = 3, repeats: int = 5) -> dict:
    """In process, on the embedded model: what the server does for a chat request with 20 tools and
    tool_choice required (the structural tag of the model's tool-call format, then its compile; a
    repeat of the same tools is a cache hit). Each set has other tool names: a first compile each."""
    from mlaserve.entrypoints.llm import LLM
    from mlaserve.tools.formats import FORMATS
    from mlaserve.tools.request import ToolContext
    from mlaserve.tools.select import choose_format

    llm = LLM(threads=args.threads)
    fmt_name, _ = choose_format(llm.config.model.model_type, llm.tokenizer.chat_template)
    t0 = time.perf_counter()
    backend = llm.engine.grammar_backend()
    out = {"format": fmt_name, "backend_build_s": time.perf_counter() - t0, "tag_s": [], "first_s": [], "cached_s": []}
    for k in range(sets):
        t0 = time.perf_counter()
        ctx = ToolContext.build(twenty_tools(f"s{k}"), "required", None, FORMATS[fmt_name])
        out["tag_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        backend.compile(ctx.structured)
        out["first_s"].append(time.perf_counter() - t0)
        for _ in range(repeats):  # a later request with the same tools: its own spec, the compiled grammar reused
            spec = ToolContext.build(twenty_tools(f"s{k}"), "required", None, FORMATS[fmt_name]).structured
            t0 = time.perf_counter()
            backend.compile(spec)
            out["cached_s"].append(time.perf_counter() - t0)
    return out


def constrained_main(args) -> None:
    env = environment(args.threads)
    n = max(args.streams)
    folder = None if args.model == "embedded" else with_tokenizer(ensure_model("standard", args.quick))
    server = Server(folder, args)
    arms: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    try:
        asyncio.run(level(server, chat_requests(1, "warm", 0, True), 4))  # warm-up (and the grammar backend)
        for rnd in range(args.rounds):
            for arm in arms:
                prompts = chat_requests(n, arm, rnd, arm == "json_schema")
                arms[arm].append(asyncio.run(level(server, prompts, args.output)))
    finally:
        server.stop()
    compiled = compile_times(args)
    rows = []
    for rnd in range(args.rounds):
        u, c = arms["unconstrained"][rnd]["output_tok_s"], arms["json_schema"][rnd]["output_tok_s"]
        rows.append([rnd + 1, n, f"{u:.1f}", f"{c:.1f}", f"{c / u:.0%}"])
    mean = {arm: sum(r["output_tok_s"] for r in runs) / len(runs) for arm, runs in arms.items()}
    ratio = mean["json_schema"] / mean["unconstrained"]
    rows.append(["mean", n, f"{mean['unconstrained']:.1f}", f"{mean['json_schema']:.1f}", f"{ratio:.0%}"])
    print_table(["round", "streams", "unconstrained tok/s", "json_schema tok/s", "ratio"], rows)
    med = sorted(compiled["first_s"])[len(compiled["first_s"]) // 2]
    print(
        f"20 tools ({compiled['format']}, tool_choice required): structural tag "
        f"{1e3 * sorted(compiled['tag_s'])[len(compiled['tag_s']) // 2]:.1f} ms, first compile {1e3 * med:.0f} ms "
        f"(median of {len(compiled['first_s'])} tool sets), cached {1e6 * min(compiled['cached_s']):.0f}-"
        f"{1e6 * max(compiled['cached_s']):.0f} us (cache hit); grammar backend built once in "
        f"{compiled['backend_build_s']:.2f} s"
    )
    tag = ("-quick" if args.quick else "") + ("-standard" if args.model == "standard" else "")
    out = Path(args.out) if args.out else RESULTS_DIR / f"serve-constrained{tag}.json"
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    summary = {"mean_output_tok_s": mean, "ratio": ratio}
    write_json(out, {"settings": settings, "environment": env, "arms": arms, "summary": summary, "compile": compiled})


def raw_vocab(size: int) -> list[str]:
    """`size` distinct token strings shaped like a byte-level BPE vocabulary's: the 256 bytes' characters,
    then word pieces of 2-10 letters, half with a leading space (what xgrammar's token trie walks)."""
    import random

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    out = [chr(b) for b in range(32, 127)] + [f"<0x{b:02X}>" for b in range(256) if not 32 <= b < 127]
    seen = set(out)
    while len(out) < size:
        piece = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        piece = (" " if rng.random() < 0.5 else "") + piece
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out


def mask_cost(args, rows: int = 16, steps: int = 64, hidden: int = 1024) -> dict:
    """Per decode step at `rows` constrained rows: xgrammar's bitmask fill, the batched bias + mask on the
    logits, and (for scale) the lm_head product [rows, hidden] x [hidden, V], which any step pays."""
    import torch
    import xgrammar as xgr

    from mlaserve.sampling.token_mask import apply_bias_and_grammar
    from mlaserve.structured.backend import Matcher, fill_bitmask
    from mlaserve.tools.formats import FORMATS
    from mlaserve.tools.request import ToolContext

    torch.set_num_threads(args.threads)
    out = {}
    for vocab in (4096, 32768, 129280):
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(raw_vocab(vocab), vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = compiler.compile_json_schema(json.dumps(NOTES_SCHEMA), any_whitespace=False, strict_mode=True)
        build_s = time.perf_counter() - t0
        tools_s = []
        for k in range(3):  # a 20-tool request (required, DSML): its first compile at this vocabulary
            tag = ToolContext.build(twenty_tools(f"v{vocab}-{k}"), "required", None, FORMATS["deepseek_v32"])
            t0 = time.perf_counter()
            compiler.compile_structural_tag(tag.structured.structural_tag)
            tools_s.append(time.perf_counter() - t0)
        matchers = [Matcher(xgr.GrammarMatcher(compiled)) for _ in range(rows)]
        w = torch.randn(vocab, hidden) * 0.02
        x = torch.randn(rows, hidden)
        gen = torch.Generator().manual_seed(0)
        fill_s, mask_s, head_s, restarts = [], [], [], 0
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = x @ w.T
            t1 = time.perf_counter()
            bitmask = fill_bitmask(matchers, vocab)
            t2 = time.perf_counter()
            masked = apply_bias_and_grammar(logits, None, bitmask)
            t3 = time.perf_counter()
            # a uniform pick among the allowed tokens: a random walk takes the grammar's odd paths too
            allowed = masked.isfinite()
            dead = (~allowed.any(-1)).nonzero().flatten().tolist()  # a walk at a dead end starts over
            allowed[dead] = True
            picks = torch.multinomial(allowed.float(), 1, generator=gen).flatten().tolist()
            for i, (m, tok) in enumerate(zip(matchers, picks)):
                if i in dead:
                    matchers[i] = Matcher(xgr.GrammarMatcher(compiled))
                    restarts += 1
                else:
                    m.accept(tok)
            head_s.append(t1 - t0)
            fill_s.append(t2 - t1)
            mask_s.append(t3 - t2)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out[vocab] = {
            "grammar_build_s": build_s,
            "fill_ms": 1e3 * med(fill_s),
            "mask_ms": 1e3 * med(mask_s),
            "lm_head_ms": 1e3 * med(head_s),
            "fill_ms_p90": 1e3 * sorted(fill_s)[int(0.9 * len(fill_s))],
            "restarts": restarts,
            "twenty_tools_compile_ms": 1e3 * sorted(tools_s)[1],
        }
    rows_out = [
        [
            v,
            f"{r['grammar_build_s']:.2f}",
            f"{r['fill_ms']:.2f} ({r['fill_ms_p90']:.2f})",
            f"{r['mask_ms']:.2f}",
            f"{r['lm_head_ms']:.2f}",
            f"{r['twenty_tools_compile_ms']:.0f}",
        ]
        for v, r in out.items()
    ]
    print_table(
        [
            "vocab",
            "tokenizer+compile s",
            f"fill ms/step ({rows} rows; p90)",
            "mask ms/step",
            "lm_head ms/step",
            "20-tool compile ms",
        ],
        rows_out,
    )
    write_json(
        Path(args.out) if args.out else RESULTS_DIR / "mask-cost.json",
        {"environment": environment(args.threads), "rows": rows, "steps": steps, "by_vocab": out},
    )
    return out


def main() -> None:
    args = parse_args()
    if args.mask_cost:
        mask_cost(args)
        return
    if args.constrained:
        return constrained_main(args)
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

"""Offline benchmark: mlaserve vs llama.cpp vs Hugging Face transformers on the same random weights,
same thread count, in one run.

    python benchmarks/offline.py [--model standard|dsa|ds-real|glm-real|glm-real-dsa]
                                 [--dtype float32|bfloat16] [--quick] [--threads 2]
                                 [--gguf auto|PATH|none] [--engines mlaserve mlaserve-gguf llama.cpp transformers]

Engines (each in its own process, so each one's peak RSS is its own; the metrics are interleaved
engine by engine, so background load hits all alike; `--sequential` runs one engine at a time):
  mlaserve        mlaserve on the safetensors folder, --dtype
  mlaserve-gguf   mlaserve on the GGUF (`--gguf auto`: the folder converted once by `mlaserve convert
                  --outtype q8_0`, with a synthetic tokenizer; cached under benchmarks/models/)
  llama.cpp       llama.cpp (llama-cpp-python's low-level API) on the same GGUF
  ik_llama.cpp    ik_llama.cpp through its own llama-bench / llama-batched-bench (--ik-llama-bin DIR;
                  benchmarks/ik_llama_worker.py says what each measure runs)
  transformers    transformers on the safetensors folder, --dtype
An mlaserve engine takes engine options after a colon: `mlaserve-gguf:kernels=torch`,
`mlaserve:quantization=int4` (any `LLM(...)` keyword; the column is named by the whole spec); llama.cpp
takes `repack=false` (no AMX / repacked weight buffers, as `llama-bench --repack 0`); ik_llama.cpp takes
mla, fa, fmoe, rtr (its -mla / -fa / -fmoe / -rtr; defaults 3, true, true, false).

Measures (see benchmarks/README.md for the exact definitions):
  prefill tokens/s        one 512-token prompt, end to end to its first token
  decode tokens/s (B=1)   128-token prompt, 64 new tokens: (n-1) / (last token time - first token time);
                          and the same after a 2048-token prompt (16 new tokens)
  output tokens/s (B=4, 16)  4 / 16 concurrent requests, prompt 128, 128 new tokens: B*128 / wall time
                          (prefill included); decode-only: B*127 / (wall time - time to the last first token)
  peak RSS                VmHWM of each engine's process at the end of the run
  KV bytes per token      mlaserve: its latent cache's allocated bytes / rows; transformers: what its
                          DynamicCache holds after a generate / (batch * cached tokens)
  decode step vs context  one single-token forward at context 128/512/1024/2048 over a synthetic
                          cache (same rows for every engine that has one), logits for that token only
  batch-1 roofline        copy bandwidth / weight bytes one decode step reads (attention, dense and
                          shared MLP, k of E routed experts, lm_head; one embedding row)
Results: a table on stdout and benchmarks/results/offline-<dtype>[-quick].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from ik_llama_worker import IK_OPTIONS  # noqa: E402
from offline_workers import WORKERS, rss  # noqa: E402

FULL = dict(
    prefill_len=512,
    prefill_reps=3,
    dec_prompt=128,
    dec_new=64,
    dec_reps=2,
    long_prompt=2048,
    long_new=16,
    long_reps=1,
    concs=[4, 16],
    conc_prompt=128,
    conc_new=128,
    conc_reps=1,
    contexts=[128, 512, 1024, 2048],
    step_reps=5,
    step_warmup=2,
)
QUICK = dict(
    prefill_len=128,
    prefill_reps=2,
    dec_prompt=32,
    dec_new=8,
    dec_reps=1,
    long_prompt=256,
    long_new=4,
    long_reps=1,
    concs=[4, 16],
    conc_prompt=32,
    conc_new=8,
    conc_reps=1,
    contexts=[128, 512],
    step_reps=3,
    step_warmup=1,
)
DTYPES = ("bfloat16", "float32")
KINDS = {  # engine kind -> which copy of the weights it reads
    "mlaserve": "folder",
    "mlaserve-gguf": "gguf",
    "llama.cpp": "gguf",
    "ik_llama.cpp": "gguf",
    "transformers": "folder",
}
DEFAULT_ENGINES = ["mlaserve", "mlaserve-gguf", "llama.cpp", "transformers"]
# the measurements `--phases` can pick (cN: N concurrent requests); warm-up and info always run
PHASES = ("prefill", "decode", "long", "c4", "c16", "kv", "steps")
# GGUF types an engine can name (`llama.cpp@q4_0`): q8_0 is written by `mlaserve convert`; the others by
# llama.cpp's own quantizer (llama_model_quantize) from that Q8_0 file, so they need llama-cpp-python.
# iq_mix: llama-quantize's IQ4_XS / IQ3_XXS / IQ2_XXS mix with an importance matrix, made by benchmarks/iq_mix.py
# (an imatrix cannot be passed through llama_model_quantize's Python binding), so it has no ftype here.
GGUF_TYPES = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q6_k": 18, "iq_mix": None}  # llama_ftype values
# llama.cpp's engine options: repack=false loads without its extra buffer types (AMX tiles, CPU repacked
# layouts), as `llama-bench --repack 0`; its default (true) aborts on MLA files on some CPUs (README).
LLAMA_CPP_OPTIONS = {"repack"}
MODEL_NAMES = ("standard", "dsa", "ds-real", "glm-real", "glm-real-dsa")  # common.MODELS' keys (no torch import here)
LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36 (see benchmarks/README.md)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="mlaserve (folder) and transformers dtype")
    p.add_argument("--quick", action="store_true", help="2-layer model, short prompts: a smoke test, not a benchmark")
    p.add_argument(
        "--model",
        default="standard",
        choices=MODEL_NAMES,
        help="benchmark model (benchmarks/common.py MODELS): the standard one, its DSA variant, or a real-shape one",
    )
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (torch / llama.cpp; spec: 2)")
    p.add_argument(
        "--engines",
        nargs="+",
        default=DEFAULT_ENGINES,
        metavar="SPEC",
        help=f"engines to run, each KIND[:option=value,...] with KIND in {', '.join(KINDS)} (default: all four)",
    )
    p.add_argument("--skip-transformers", action="store_true", help="drop transformers from --engines")
    p.add_argument(
        "--gguf",
        default="auto",
        help="GGUF of the same weights for mlaserve-gguf and llama.cpp: auto (convert the folder to Q8_0 "
        "once, cached), a path, or none (drop the GGUF engines)",
    )
    p.add_argument("--sequential", action="store_true", help="one engine process at a time (less memory)")
    p.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=None,
        help="run only these measurements (default: all; the warm-up and the info call always run)",
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=None,
        help="prompt tokens of the prefill measurement (default 512; 128 with --quick)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="prompts per prefill and batch-1 decode measurement (default 3 and 2; the median is reported)",
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        help="prompt tokens of the long-context decode measurement (default 2048; 256 with --quick)",
    )
    p.add_argument(
        "--ik-llama-bin",
        default=None,
        metavar="DIR",
        help="folder of ik_llama.cpp's llama-bench and llama-batched-bench (the ik_llama.cpp engine; not in the JSON)",
    )
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offline-<dtype>[-quick].json)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one engine
    p.add_argument("--worker-args", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quantize", nargs=3, default=None, help=argparse.SUPPRESS)  # internal: SRC DST TYPE
    return p.parse_args(argv)


def parse_spec(spec: str) -> tuple[str, str, dict]:
    """'kind[@gguf type][:k=v,k=v]' -> (kind, weights, options). weights: "folder", or the GGUF's type
    (q8_0 unless named). Option values: ints, floats, true/false/none, else strings."""
    head, _, rest = spec.partition(":")
    kind, at, qtype = head.partition("@")
    if kind not in KINDS:
        raise SystemExit(f"--engines: unknown engine {kind!r} (choose from {', '.join(KINDS)})")
    if KINDS[kind] == "folder":
        if at:
            raise SystemExit(f"--engines {spec}: {kind} reads the safetensors folder, not a GGUF type")
        weights = "folder"
    else:
        weights = qtype.lower() if at else "q8_0"
        if weights not in GGUF_TYPES:
            raise SystemExit(f"--engines {spec}: GGUF type {weights!r} (choose from {', '.join(GGUF_TYPES)})")
    opts: dict = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise SystemExit(f"--engines {spec}: options are key=value")
        low = v.lower()
        if low in ("true", "false", "none"):
            opts[k] = {"true": True, "false": False, "none": None}[low]
        else:
            for conv in (int, float, str):
                try:
                    opts[k] = conv(v)
                    break
                except ValueError:
                    pass
    if kind == "llama.cpp" and set(opts) - LLAMA_CPP_OPTIONS:
        raise SystemExit(f"--engines {spec}: llama.cpp takes only {', '.join(sorted(LLAMA_CPP_OPTIONS))}")
    if kind == "ik_llama.cpp" and set(opts) - set(IK_OPTIONS):
        raise SystemExit(f"--engines {spec}: ik_llama.cpp takes only {', '.join(IK_OPTIONS)}")
    if opts and kind == "transformers":
        raise SystemExit(f"--engines {spec}: only mlaserve, llama.cpp and ik_llama.cpp engines take options")
    return kind, weights, opts


def worker_main(spec: str, init: dict) -> None:
    """Serve calls from the parent: one JSON line in, one JSON line out, on a private copy of stdout
    (fd 1 itself goes to stderr, so nothing a library prints can garble the replies)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    kind, _, options = parse_spec(spec)
    t0 = time.perf_counter()
    settings = {**init["settings"], "ik_llama_bin": init.get("ik_llama_bin")}  # a machine path: not in the JSON
    try:
        engine = WORKERS[kind](init["path"], init["dtype"], init["threads"], settings, options)
        engine_rss = getattr(engine, "rss", rss)  # a tool-driven engine: its child processes' memory
        proto.write(json.dumps({"ok": True, "load_s": time.perf_counter() - t0, "rss_gib": engine_rss()}) + "\n")
    except Exception as ex:  # noqa: BLE001 -- the parent reports it and goes on with the other engines
        traceback.print_exc()
        proto.write(json.dumps({"ok": False, "error": f"{type(ex).__name__}: {ex}"}) + "\n")
        return
    for line in sys.stdin:
        call = json.loads(line)
        if call["op"] == "quit":
            break
        try:
            result = getattr(engine, call["op"])(*call.get("args", []))
            reply = {"ok": True, "result": result}
        except Exception as ex:  # noqa: BLE001
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(ex).__name__}: {ex}"}
        reply.update(engine_rss())
        proto.write(json.dumps(reply, default=str) + "\n")


class Engine:
    """The parent's handle on one worker process."""

    def __init__(self, spec: str, path: Path, args, s: dict) -> None:
        self.spec, (self.kind, self.weights, self.options) = spec, parse_spec(spec)
        self.path, self.args, self.s = path, args, s
        self.proc = None
        self.status: str | None = None  # None: running or done; else why it has no numbers
        self.load: dict = {}
        self.last_rss: dict = {}

    def start(self) -> bool:
        init = {"path": str(self.path), "dtype": self.args.dtype, "threads": self.args.threads, "settings": self.s}
        init["ik_llama_bin"] = getattr(self.args, "ik_llama_bin", None)
        print(f"[load] {self.spec} <- {self.path.name}", flush=True)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", self.spec, "--worker-args", json.dumps(init)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        reply = self._read()
        if not reply.get("ok"):
            self.status = f"failed to load: {reply.get('error')}"
            print(f"  {self.spec}: {self.status}", flush=True)
            self.stop()
            return False
        self.load = reply
        print(
            f"  {self.spec}: loaded in {reply['load_s']:.1f} s, RSS {reply['rss_gib']['vmrss_gib']:.2f} GiB", flush=True
        )
        return True

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            return {"ok": False, "error": f"worker exited (code {rc})"}
        return json.loads(line)

    def call(self, op: str, *args):
        """The result, or None after printing why it failed."""
        if self.proc is None:
            return None
        self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "vmhwm_gib" in reply:
            self.last_rss = {"vmrss_gib": reply["vmrss_gib"], "vmhwm_gib": reply["vmhwm_gib"]}
        if not reply.get("ok"):
            print(f"  {self.spec}: {op} failed: {reply.get('error')}", flush=True)
            if self.proc.poll() is not None:
                self.status, self.proc = f"died: {reply.get('error')}", None
            return None
        return reply["result"]

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            self.proc.wait()
            self.proc = None


# =====================================================================================================
# the run: phases, each run for every engine (interleaved) or per engine (--sequential)
# =====================================================================================================
def prompts_for(s: dict, vocab: int) -> dict:
    """Every prompt of the run, fixed up front: each engine gets the same token ids; within an
    engine every prompt is distinct (mlaserve's prefix cache would otherwise serve repeats)."""
    from common import random_prompt

    return {
        "warmup": [random_prompt(16, vocab, 1), random_prompt(16, vocab, 2)],
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
    from common import active_weight_bytes, copy_bandwidth_gbs

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


# -- the report -----------------------------------------------------------------------------------------
def ratio_pairs(engines: list[Engine]) -> list[tuple[str, str]]:
    """mlaserve on the folder / transformers (same weights, same dtype); every mlaserve engine / the
    llama.cpp engine on the same GGUF (the Q8_0 one for mlaserve on the folder)."""
    tf = next((e.spec for e in engines if e.kind == "transformers"), None)
    pairs = [(e.spec, tf) for e in engines if e.kind == "mlaserve" and tf]
    for kind in ("llama.cpp", "ik_llama.cpp"):
        lc = {}
        for e in engines:
            if e.kind == kind:
                lc.setdefault(e.weights, e.spec)
        for e in engines:
            other = lc.get(e.weights) or lc.get("q8_0") or next(iter(lc.values()), None)
            if e.kind.startswith("mlaserve") and other:
                pairs.append((e.spec, other))
    return pairs


def _value(res: dict, spec: str, key: str, sub=None):
    v = res.get(spec, {}).get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    if isinstance(v, dict):
        v = v.get("measured")
    return v


def table_rows(s: dict) -> list[tuple[str, str, object, str]]:
    """(label, key, sub, better)."""
    rows = [
        (f"prefill tok/s ({s['prefill_len']}-token prompt)", "prefill_tok_s", None, "higher"),
        (f"decode tok/s, batch 1 ({s['dec_prompt']}+{s['dec_new']})", "decode_tok_s_b1", None, "higher"),
        (
            f"decode tok/s, batch 1 at context {s['long_prompt']} (+{s['long_new']})",
            "decode_tok_s_long",
            None,
            "higher",
        ),
    ]
    for b in s["concs"]:
        rows.append(
            (f"output tok/s, {b} concurrent ({s['conc_prompt']}+{s['conc_new']})", f"output_tok_s_c{b}", None, "higher")
        )
        rows.append((f"  decode-only tok/s, {b} concurrent", f"decode_tok_s_c{b}", None, "higher"))
    rows.append(("peak RSS GiB (VmHWM of its process)", "peak_rss_gib", None, "lower"))
    rows.append(("  peak RSS / size of the weight file", "rss_over_weights", None, "lower"))
    rows.append(("KV cache bytes/token (all layers)", "kv_bytes_per_token", None, "lower"))
    rows += [(f"decode step ms @ context {n}", "step_ms", n, "lower") for n in s["contexts"]]
    rows.append(("batch-1 roofline tok/s (copy bw / active bytes)", "roofline_tok_s", None, "-"))
    rows.append(("  decode batch 1 / roofline", "roofline_share", None, "higher"))
    return rows


def _cell(e: Engine, v, key: str, fmt) -> str:
    if v is None:
        return "failed" if e.status else "-"
    if key == "roofline_share":
        return f"{v:.0%}"
    return fmt(v, 2 if key in ("peak_rss_gib", "rss_over_weights") else 1)


def report(args, s: dict, engines: list[Engine], res: dict, roof: dict, env: dict, wall: float, skipped: dict) -> str:
    for e in engines:
        f = roof["formats"].get(roof["engine_format"].get(e.spec))
        if f and e.spec in res:
            res[e.spec]["roofline_tok_s"] = f["roofline_tok_s"]
            d = res[e.spec].get("decode_tok_s_b1")
            res[e.spec]["roofline_share"] = d / f["roofline_tok_s"] if d else None
    pairs = ratio_pairs(engines)
    headers = ["metric"] + [e.spec for e in engines] + [f"{a} / {b}" for a, b in pairs] + ["better"]
    from common import fmt, print_table

    rows = []
    for label, key, sub, better in table_rows(s):
        vals = [_value(res, e.spec, key, sub) for e in engines]
        cells = [_cell(e, v, key, fmt) for e, v in zip(engines, vals)]
        ratios = []
        for a, b in pairs:
            va, vb = _value(res, a, key, sub), _value(res, b, key, sub)
            ok = va and vb and key not in ("roofline_tok_s", "roofline_share")
            ratios.append(f"{va / vb:.2f}x" if ok else "-")
        rows.append([label] + cells + ratios + [better])
    print()
    print(
        f"offline benchmark -- dtype {args.dtype} (folder engines), {args.threads} threads, "
        f"{args.model} model{' QUICK (2 layers)' if args.quick else ''}"
        + "".join(f", {Path(env['weights'][k]).name} ({mib:.0f} MiB)" for k, mib in env["gguf_mib"].items())
    )
    table = print_table(headers, rows)
    for e in engines:
        if e.status:
            print(f"{e.spec}: {e.status}")
    for sp, why in skipped.items():
        print(f"{sp}: not run ({why})")
    agree = res.get("greedy_agreement_b1", {})
    if agree:
        print(
            "greedy agreement (leading identical tokens, batch 1): " + "; ".join(f"{k} {v}" for k, v in agree.items())
        )
    print(
        f"roofline: copy bandwidth {roof['copy_bandwidth_gbs']:.1f} GB/s; active weight bytes per token: "
        + "; ".join(
            f"{k} {v['bytes'] / 1e6:.0f} MB -> {v['roofline_tok_s']:.1f} tok/s" for k, v in roof["formats"].items()
        )
    )
    env["loadavg_end"] = list(os.getloadavg())
    print(
        f"wall time {wall:.0f} s; loadavg start {env['loadavg_start']} end {env['loadavg_end']} "
        f"(other processes share the {env['cpus']} CPUs: absolute numbers are pessimistic)"
    )
    return table


def resolve_engines(args, folder: Path) -> tuple[list[str], dict, dict]:
    """The engine specs to run, their weight files (weights -> path), and why any asked-for engine
    is left out."""
    import importlib.util

    from common import ensure_gguf, gguf_path

    specs = [sp for sp in args.engines if not (args.skip_transformers and parse_spec(sp)[0] == "transformers")]
    has_lc = importlib.util.find_spec("llama_cpp") is not None
    files: dict = {"folder": folder}
    skipped: dict = {}
    for sp in specs:
        kind, weights, _ = parse_spec(sp)
        if kind == "llama.cpp" and not has_lc:
            skipped[sp] = f"not installed: {LLAMA_CPP_INSTALL}"
        elif kind == "ik_llama.cpp" and not args.ik_llama_bin:
            skipped[sp] = "no --ik-llama-bin DIR (its build: benchmarks/README.md, ik_llama.cpp)"
        elif weights == "folder" or weights in files:
            continue
        elif args.gguf == "none":
            skipped[sp] = "--gguf none"
        elif weights == "q8_0":
            files[weights] = ensure_gguf(folder, "q8_0") if args.gguf == "auto" else Path(args.gguf)
            if not files[weights].is_file():
                raise SystemExit(f"--gguf {files[weights]}: not a file")
        elif GGUF_TYPES[weights] is None:  # made by its own script (an importance matrix): found, not made here
            q8 = Path(args.gguf)
            files[weights] = (
                gguf_path(folder, weights) if args.gguf == "auto" else q8.with_name(f"{q8.stem}-{weights}.gguf")
            )
            if not files[weights].is_file():
                raise SystemExit(f"{files[weights].name} missing: make it with benchmarks/{weights}.py --llama-bin DIR")
        elif not has_lc:
            skipped[sp] = f"a {weights} GGUF is made by llama.cpp's quantizer: {LLAMA_CPP_INSTALL}"
        else:
            src = files.get("q8_0") or ensure_gguf(folder, "q8_0")
            dst = gguf_path(folder, weights) if args.gguf == "auto" else src.with_name(f"{src.stem}-{weights}.gguf")
            if not dst.exists() or dst.stat().st_mtime < src.stat().st_mtime:
                print(
                    f"[build] llama.cpp quantize {src.name} -> {dst.name} ({weights}, requantized from Q8_0)",
                    flush=True,
                )
                cmd = [sys.executable, os.path.abspath(__file__), "--quantize", str(src), str(dst), weights]
                if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
                    raise SystemExit(f"llama.cpp could not quantize {src} to {weights}")
            files[weights] = dst
    return [sp for sp in specs if sp not in skipped], files, skipped


def quantize_main(src: str, dst: str, weights: str) -> None:
    """llama.cpp's llama_model_quantize (what its `llama-quantize` tool runs), in a process of its own."""
    import ctypes

    import llama_cpp as lc

    lc.llama_backend_init()
    qp = lc.llama_model_quantize_default_params()
    qp.ftype, qp.allow_requantize, qp.nthread = GGUF_TYPES[weights], True, os.cpu_count() or 1
    tmp = dst + ".partial"
    rc = lc.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(qp))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")
    os.replace(tmp, dst)


def checkout_relative(path: Path) -> str:
    """A path as the results JSON keeps it: relative to the checkout when inside it (no machine paths)."""
    root = Path(BENCH_DIR).parent
    try:
        return str(Path(os.path.abspath(path)).relative_to(root))
    except ValueError:
        return Path(path).name


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args.worker, json.loads(args.worker_args))
        return
    if args.quantize:
        quantize_main(*args.quantize)
        return
    import torch
    from common import RESULTS_DIR, count_params, ensure_model, environment, write_json

    s = dict(QUICK if args.quick else FULL)
    if args.prefill_len is not None:
        s["prefill_len"] = args.prefill_len
    if args.long_prompt is not None:
        s["long_prompt"] = args.long_prompt
    if args.reps is not None:
        s["prefill_reps"] = s["dec_reps"] = args.reps
    wall0 = time.perf_counter()
    folder = ensure_model(args.model, args.quick)
    specs, files, skipped = resolve_engines(args, folder)
    env = environment(args.threads)
    env["weights"] = {k: checkout_relative(v) for k, v in files.items()}
    env["gguf_mib"] = {k: v.stat().st_size / 2**20 for k, v in files.items() if k != "folder"}
    print(
        f"[env] {env['cpu']} ({' '.join(env['cpu_simd'])}), {env['cpus']} CPUs, threads {args.threads}, "
        f"loadavg {env['loadavg_start']}; "
        f"engines {specs}" + (f"; left out: {skipped}" if skipped else ""),
        flush=True,
    )
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    engines = [Engine(sp, files[parse_spec(sp)[1]], args, s) for sp in specs]
    torch.set_num_threads(args.threads)
    roof = roofline(engines, files, args.dtype, args.threads, args.quick)
    out = Path(args.out) if args.out else RESULTS_DIR / f"offline-{args.dtype}{'-quick' if args.quick else ''}.json"
    params = count_params(folder)

    def doc(res: dict, table: str | None, complete: bool) -> dict:
        return {
            "benchmark": "offline",
            "complete": complete,
            "model_name": args.model,
            "dtype": args.dtype,
            "quick": args.quick,
            "threads": args.threads,
            "sequential": args.sequential,
            "phases": args.phases or list(PHASES),
            "settings": s,
            "env": env,
            "wall_s": time.perf_counter() - wall0,
            "model": {
                "folder": checkout_relative(folder),
                "params": params,
                "config": json.loads((folder / "config.json").read_text()),
                "gguf": env["weights"],
            },
            "engines": {**{e.spec: e.status or "measured" for e in engines}, **skipped},
            "roofline": roof,
            "results": res,
            "table": table,
            "notes": [
                "ratio = first engine / second engine; for times, bytes and RSS lower is better",
                "each engine runs in its own process (peak RSS = its VmHWM); every engine gets the same prompts",
                "decode step vs context uses a synthetic cache (same rows for every engine that has one), single "
                "token, logits of that token only; it excludes scheduling and sampling",
                "transformers 5.x caches the compressed latent ([c_kv], [k_pe]) too, but re-expands the whole "
                "cached context through kv_b_proj at every step",
                "llama.cpp quantizes activations to 8 bits for its Q8_0 dot products; mlaserve multiplies in float",
            ]
            + ([] if complete else ["partial: written after a phase; the run had not finished"]),
        }

    def partial(res: dict) -> None:
        write_json(out, doc(res, None, complete=False))

    res, greedy = run_engines(engines, s, prompts_for(s, vocab), args.sequential, args.phases, partial)
    res["greedy_agreement_b1"] = agreement(greedy, engines)
    table = report(args, s, engines, res, roof, env, time.perf_counter() - wall0, skipped)
    write_json(out, doc(res, table, complete=True))


if __name__ == "__main__":
    main()

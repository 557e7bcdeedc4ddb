"""Start time: wall seconds from process start to the first token of a short prompt, mlaserve against llama.cpp
on the same GGUF, each run a fresh process, the engines alternating, with mlaserve's time split into phases.

    python benchmarks/start_time.py --gguf benchmarks/models/mla-std-l12-seed0-q8_0.gguf [--gguf PATH2] [--reps 5]
        # JSON to benchmarks/results/ (the GGUF named relative to the checkout); --threads 2, --prompt TEXT,
        # --engines mlaserve mlaserve-cli llama.cpp; --baseline DIR adds "mlaserve-baseline": the mlaserve worker
        # importing the mlaserve of another checkout (e.g. `git archive` of an earlier commit) for before/after

Engines (one fresh process per run; the parent notes the wall clock right before it starts the process, and the
worker's time stamps are wall-clock seconds since that moment, so each figure includes the interpreter's start):
  mlaserve       the offline API: LLM(gguf) and generate(prompt, max_tokens=1), greedy; phases below
  mlaserve-baseline  the same, importing --baseline DIR's mlaserve (the folder is not recorded in the JSON)
  mlaserve-cli   `python -m mlaserve.entrypoints.cli generate PROMPT --model GGUF --max-tokens 1`: the command a
                 user types, timed from start to exit (exit included: no phases)
  llama.cpp      llama-cpp-python's C API: the model loaded (file mapped, no extra buffer types: this build's AMX /
                 repacked buffers abort on MLA files, see benchmarks/README.md), a context, the prompt tokenized
                 and decoded, the greedy first token

mlaserve's phases (cumulative seconds since the process was started; each phase's own time is the difference):
  python         the worker's first line ran (interpreter start + site)
  torch          `import torch` done
  mlaserve       `from mlaserve import LLM, SamplingParams` done (mlaserve's own imports)
  open           open_checkpoint returned: GGUF header, config, engine config (resolve), tokenizer
  build          build_model returned: the modules built on the meta device, the GGUF holders swapped in, the
                 remaining parameters allocated
  fill           fill_model returned: the weights filled (mapped views or copies), the KernelPlan (the native
                 kernels' library loaded: built at first use, cached on disk)
  ready          LLM() returned: the runner, the cache pool, the engine
  first_token    generate() returned the first token (the prompt's prefill)
  native_build_s the seconds spent in kernels.native's library build-or-load (inside fill)

llama.cpp's: python, import (llama_cpp's C API module), load (llama_model_load_from_file), context
(llama_init_from_model), first_token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

T_START = time.time()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's mlaserve, not an installed copy of another one


def _since(t0: float) -> float:
    return round(time.time() - t0, 4)


def _timed(module, name: str, on_return) -> None:
    """Wrap module.name so that on_return() runs when it returns (a phase's end)."""
    fn = getattr(module, name)

    def wrapper(*a, **k):
        out = fn(*a, **k)
        on_return()
        return out

    setattr(module, name, wrapper)


def mlaserve_worker(spec: dict) -> dict:
    t0, phases = spec["t0"], {}
    phases["python"] = round(T_START - t0, 4)
    if spec.get("checkout"):
        sys.path.insert(0, spec["checkout"])
    import torch

    phases["torch"] = _since(t0)
    from mlaserve import LLM, SamplingParams

    phases["mlaserve"] = _since(t0)
    from mlaserve.kernels import native_build
    from mlaserve.loading import model_loader

    # load_model -> fill_model(open_checkpoint(...)); fill_model -> build_model: the loader's own seams
    for name, phase in (("open_checkpoint", "open"), ("build_model", "build"), ("fill_model", "fill")):
        _timed(model_loader, name, lambda p=phase: phases.__setitem__(p, _since(t0)))
    build = {"s": 0.0}
    library = native_build._build

    def timed_build(*a, **k):
        t = time.perf_counter()
        try:
            return library(*a, **k)
        finally:
            build["s"] += time.perf_counter() - t

    native_build._build = timed_build
    llm = LLM(spec["gguf"], threads=spec["threads"])
    phases["ready"] = _since(t0)
    out = llm.generate([spec["prompt"]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    phases["first_token"] = _since(t0)
    return {
        "phases": phases,
        "native_build_s": round(build["s"], 4),
        "prompt_tokens": len(out.prompt_token_ids),
        "token": out.outputs[0].token_ids[0],
        "torch_threads": torch.get_num_threads(),
    }


def llama_worker(spec: dict) -> dict:
    t0, phases = spec["t0"], {}
    phases["python"] = round(T_START - t0, 4)
    from llamacpp_session import import_llama_cpp

    lc = import_llama_cpp()
    import numpy as np

    phases["import"] = _since(t0)
    keep_log = lc.llama_log_callback(lambda level, text, user: None)  # quiet: the figures are the output
    lc.llama_log_set(keep_log, None)
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = False  # this build's AMX / repacked buffers abort on MLA files (GGML_ASSERT)
    model = lc.llama_model_load_from_file(spec["gguf"].encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    phases["load"] = _since(t0)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.no_perf = 256, 256, 256, 1, True
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    ctx = lc.llama_init_from_model(model, cp)
    phases["context"] = _since(t0)
    vocab = lc.llama_model_get_vocab(model)
    text = spec["prompt"].encode()
    ids = (lc.llama_token * 256)()
    n = lc.llama_tokenize(vocab, text, len(text), ids, 256, True, False)
    if n <= 0:
        raise RuntimeError(f"llama.cpp could not tokenize {spec['prompt']!r} ({n})")
    batch = lc.llama_batch_get_one(ids, n)
    if lc.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(lc.llama_vocab_n_tokens(vocab),))
    token = int(logits.argmax())
    phases["first_token"] = _since(t0)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {"phases": phases, "prompt_tokens": n, "token": token, "use_extra_bufts": bool(mp.use_extra_bufts)}


def run(spec: dict) -> dict:
    """One fresh process; the worker's stamps count from t0, the wall clock right before it is started."""
    if spec["engine"] == "mlaserve-cli":
        cmd = [sys.executable, "-m", "mlaserve.entrypoints.cli", "generate", spec["prompt"], "--model", spec["gguf"]]
        cmd += ["--max-tokens", "1", "--threads", str(spec["threads"])]
        env = {**child_env(), "PYTHONPATH": str(HERE.parent)}
        t0 = time.time()
        res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=HERE.parent)
        wall = round(time.time() - t0, 4)
        if res.returncode:
            sys.exit(f"mlaserve-cli failed:\n{res.stderr[-4000:]}")
        return {"phases": {"exit": wall}}
    spec = {**spec, "t0": time.time()}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if res.returncode:
        sys.exit(f"worker failed for {spec['engine']}:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def child_env() -> dict:
    """The workers' environment: compiled bytecode cached (__pycache__, as an installed package has it; with
    PYTHONDONTWRITEBYTECODE every start would compile mlaserve's ~300 modules again: +0.3-0.6 s)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                want = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
                return " ".join(x for x in line.split(":")[1].split() if x in want)
    return ""


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def summary(runs: list[dict]) -> dict:
    """Per (file, engine): the median of every phase stamp over the reps, and first token over llama.cpp's."""
    out: dict = {}
    for r in runs:
        key = f"{Path(r['gguf']).name} {r['engine']}"
        for phase, s in r["phases"].items():
            out.setdefault(key, {}).setdefault(phase, []).append(s)
    return {k: {p: round(statistics.median(v), 3) for p, v in ph.items()} for k, ph in out.items()}


def spec_of(engine: str, path: str, args) -> dict:
    spec = dict(engine=engine, gguf=path, threads=args.threads, prompt=args.prompt)
    if engine == "mlaserve-baseline":
        spec["checkout"] = str(Path(args.baseline).resolve())
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", action="append", default=[])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="Hello world")
    ap.add_argument("--engines", nargs="+", default=["mlaserve", "llama.cpp", "mlaserve-cli"])
    ap.add_argument("--baseline", default=None, help="another checkout's folder: adds engine mlaserve-baseline")
    ap.add_argument(
        "--warmup", type=int, default=1, help="unrecorded runs of every engine first (bytecode, page cache)"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        work = llama_worker if spec["engine"] == "llama.cpp" else mlaserve_worker
        print(json.dumps(work(spec)))
        return
    out = Path(args.out or HERE / "results" / f"start_time-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    env = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "threads": args.threads}
    engines = args.engines + (["mlaserve-baseline"] if args.baseline else [])
    for _ in range(args.warmup):
        for path in args.gguf:
            for engine in engines:
                run(spec_of(engine, path, args))
    for rep in range(args.reps):
        for path in args.gguf:
            for engine in engines if rep % 2 == 0 else engines[::-1]:  # alternate who goes first
                spec = spec_of(engine, path, args)
                load = os.getloadavg()[0]
                row = {**spec, "rep": rep, "load_before": round(load, 2), **run(spec)}
                row.pop("checkout", None)
                row["gguf"] = os.path.relpath(os.path.abspath(path), HERE.parent)  # no machine paths in results
                runs.append(row)
                stamps = " ".join(f"{p} {s:.2f}" for p, s in row["phases"].items())
                print(f"{Path(path).name} {engine} rep={rep} (load {load:.1f}): {stamps}", flush=True)
                out.write_text(json.dumps({"env": env, "runs": runs, "median": summary(runs)}, indent=1))
    env["load_after"] = os.getloadavg()
    out.write_text(json.dumps({"env": env, "runs": runs, "median": summary(runs)}, indent=1))
    for key, ph in summary(runs).items():
        print(key, ph)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

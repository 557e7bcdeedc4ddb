"""Batch-1 decode of a GGUF with each engine's AVX2 code beside its native (-march=native) code, on one CPU.

    python benchmarks/isa_decode.py --gguf FILE [FILE ...] --llama-bin NATIVE_DIR AVX2_DIR [--reps 2] [--threads 2]
                                    [--new 64] [--context 128]

Without an AVX2-only machine, the AVX2 kernels of both engines run on this one (an emulation: the same cores,
caches and memory; only the instructions differ). llama.cpp: two builds from source, one with GGML_NATIVE (the
first --llama-bin folder) and one with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF (the second), each run as
`llama-bench -p 0 -n NEW -d CONTEXT` (decode of NEW tokens after CONTEXT, its default repacked weights).
mlaserve: a fresh process per run (`--worker`), a CONTEXT-token prompt of random ids and NEW new tokens, greedy:
NEW / (time to NEW + 1 tokens - time to the first), median of three prompts; its AVX2 run builds the native library
with MLASERVE_KERNEL_CFLAGS=-mno-avx512f and holds the CPU choices to an AVX2 machine's (MLASERVE_FAST_BF16=0,
MLASERVE_INT8_ROWS=0, MLASERVE_AMX_INT8=0, torch at ATEN_CPU_CAPABILITY=avx2). The four engines alternate per
file, rep by rep. Results: a line per run and benchmarks/results/isa_decode.json (every rate, each run's load
average, the builds' ISAs, the CPU flags).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_prompt, run_end, run_start  # noqa: E402

AVX2_ENV = {
    "MLASERVE_KERNEL_CFLAGS": "-mno-avx512f",
    "MLASERVE_FAST_BF16": "0",
    "MLASERVE_INT8_ROWS": "0",
    "MLASERVE_AMX_INT8": "0",
    "ATEN_CPU_CAPABILITY": "avx2",
}


def worker(gguf: str, threads: int, context: int, new: int) -> None:
    """One mlaserve run: prints a JSON line (rates, the build's ISA, the activations chosen)."""
    from mlaserve import LLM
    from mlaserve.kernels import native
    from mlaserve.sampling.params import SamplingParams

    llm = LLM(gguf, threads=threads, enable_prefix_caching=False)
    llm.generate([random_prompt(context, 1000, seed=3)], SamplingParams(max_tokens=8))  # warm-up
    rates = []
    for rep in range(3):  # two prompts of the same length: the first token alone, then with NEW more
        t = time.perf_counter()
        llm.generate([random_prompt(context, 1000, seed=10 + rep)], SamplingParams(max_tokens=1))
        first = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([random_prompt(context, 1000, seed=20 + rep)], SamplingParams(max_tokens=new + 1))
        rates.append(new / (time.perf_counter() - t - first))
    out = {"rates": rates, "isa": native.isa(), "int8_isa": native.int8_isa()}
    print(json.dumps(out | {"activations": llm.config.kernels.activations}))


def mlaserve_run(gguf: Path, avx2: bool, args) -> dict:
    env = {**os.environ, **(AVX2_ENV if avx2 else {})}
    cmd = [sys.executable, __file__, "--worker", str(gguf), "--threads", str(args.threads)]
    cmd += ["--context", str(args.context), "--new", str(args.new)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    res = json.loads(run.stdout.strip().splitlines()[-1])
    return res | {"tok_s": statistics.median(res["rates"])}


def llama_run(gguf: Path, bin_dir: Path, args) -> dict:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.new), "-d", str(args.context)]
    cmd += ["-t", str(args.threads), "-r", "1", "-o", "jsonl"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    res = json.loads(run.stdout.strip().splitlines()[-1])
    return {"tok_s": res["avg_ts"], "build_commit": res.get("build_commit")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, nargs="+")
    p.add_argument("--llama-bin", type=Path, nargs=2, metavar=("NATIVE_DIR", "AVX2_DIR"))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.threads, args.context, args.new)
    if not args.gguf or not args.llama_bin:
        p.error("--gguf and --llama-bin are required")
    engines = {
        "llama.cpp native": lambda f: llama_run(f, args.llama_bin[0], args),
        "llama.cpp avx2": lambda f: llama_run(f, args.llama_bin[1], args),
        "mlaserve native": lambda f: mlaserve_run(f, False, args),
        "mlaserve avx2": lambda f: mlaserve_run(f, True, args),
    }
    res: dict = {"context": args.context, "new": args.new, "threads": args.threads, "files": {}}
    res |= run_start()
    for rep in range(args.reps):
        for gguf in args.gguf:
            runs = res["files"].setdefault(gguf.name, {name: [] for name in engines})
            for name, run in engines.items():
                load = os.getloadavg()[0]
                out = run(gguf) | {"load": load, "rep": rep}
                runs[name].append(out)
                print(f"{gguf.name} rep {rep} {name}: {out['tok_s']:.1f} tok/s (load {load:.2f})", flush=True)
    for gguf, runs in res["files"].items():
        med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
        res["files"][gguf] = {"median_tok_s": med, "runs": runs}
        ratio = (med["mlaserve native"] / med["llama.cpp native"], med["mlaserve avx2"] / med["llama.cpp avx2"])
        print(f"{gguf}: mlaserve / llama.cpp native {ratio[0]:.2f}x, avx2 {ratio[1]:.2f}x")
    run_end(res, "isa_decode", args.threads)


if __name__ == "__main__":
    main()

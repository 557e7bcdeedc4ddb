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
  prefill tokens/s        one 512-token prompt, end to end to its first token, after a warm-up prompt of
                          the same length (as llama-bench's); the warm-up's time is kept (prefill_warmup_s)
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
from pathlib import Path

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
# the run's parts, one file each: the engines (their specs, the handle on a worker process and the loop it
# serves), the phases (what is measured), the report (the table); the workers in offline_workers.py
from offline_engines import GGUF_TYPES, KINDS, Engine, parse_spec, worker_main  # noqa: E402
from offline_phases import PHASES, agreement, prompts_for, roofline, run_engines  # noqa: E402
from offline_report import report  # noqa: E402

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
DEFAULT_ENGINES = ["mlaserve", "mlaserve-gguf", "llama.cpp", "transformers"]
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


def resolve_engines(args, folder: Path) -> tuple[list[str], dict, dict]:
    """The engine specs to run, their weight files (weights -> path), and why any asked-for engine
    is left out."""
    import importlib.util

    from model_files import ensure_gguf, gguf_path

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

"""Prefill with fp32 vs bf16 GEMMs on the many-rows path (engine option prefill_matmul), the standard model's GGUF
files, in one process: the engines (one per file and mode) are loaded first, then every repetition runs each of
them in turn (alternating, so a busy machine slows them alike), each on a prompt of its own (no prefix-cache hit).
Prefill tok/s = prompt tokens / the wall time of a 1-token generate; per CPU second: / the process's CPU time of it
(the steadier figure on a loaded machine at 1 thread). llama.cpp's figure on the same files comes from
its own llama-bench (see benchmarks/README.md, "Prefill on the matrix units").

  python benchmarks/prefill_bf16.py --files q8_0 q4_k_m --modes float bf16 --lens 512 --reps 2
  python benchmarks/prefill_bf16.py --files q4_k_m --modes bf16_6bit int8 --threads 1   (int8 prefill on the tiles)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS_DIR, RESULTS_DIR, environment, random_prompt, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", default=["q8_0", "q4_k_m"], help="GGUF types of the standard model")
    p.add_argument("--modes", nargs="+", default=["float", "bf16"], help="prefill_matmul values to compare")
    p.add_argument("--lens", nargs="+", type=int, default=[512], help="prompt lengths")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "prefill_bf16.json"))
    args = p.parse_args()

    import torch

    from mlaserve import LLM, SamplingParams

    env = environment(args.threads)
    torch.set_num_threads(args.threads)
    engines = {}
    for f in args.files:
        path = MODELS_DIR / f"mla-std-l12-seed0-{f}.gguf"
        if not path.exists():
            raise SystemExit(
                f"{path.name} missing: make it as benchmarks/README.md says (offline.py or llama-quantize)"
            )
        for mode in args.modes:
            llm = LLM(str(path), prefill_matmul=mode, threads=args.threads, max_num_batched_tokens=max(args.lens))
            engines[(f, mode)] = llm
            llm.generate([random_prompt(32, 32768, 1)], SamplingParams(max_tokens=1))  # warm-up
    one = SamplingParams(max_tokens=1, temperature=0)
    runs = []
    seed = 100
    for n in args.lens:
        for rep in range(args.reps):
            for (f, mode), llm in engines.items():
                seed += 1
                t0, c0 = time.perf_counter(), time.process_time()
                llm.generate([random_prompt(n, 32768, seed)], one)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                load = list(os.getloadavg())
                run = {"file": f, "mode": mode, "len": n, "rep": rep, "tok_s": n / wall, "cpu_tok_s": n / cpu}
                runs.append(run | {"loadavg": load})
                print(
                    f"{f} {mode:<9} {n:>5} rep {rep}: {n / wall:7.1f} tok/s, {n / cpu:7.1f} per CPU second "
                    f"(loadavg {load[0]:.1f})",
                    flush=True,
                )
    chosen = {f"{f} {m}": e.config.kernels.prefill_matmul for (f, m), e in engines.items()}
    write_json(
        Path(args.out),
        {
            "benchmark": "prefill_bf16",
            "env": {**env, "loadavg_end": list(os.getloadavg())},
            "settings": vars(args) | {"out": Path(args.out).name},
            "resolved": chosen,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()

"""The absorbed path's prefill MQA: the native backend's C kernel against the torch backend's BLAS GEMM.

    python benchmarks/absorbed_prefill.py [--models standard glm-real | --gguf PATH ...] [--tokens 512 2048]
                                          [--reps 2] [--threads 2]
                                          [--c-flags -mno-avx512f]

A prompt's absorbed attention (mla_path="absorbed": a DeepSeek-V3.2 / GLM-5 prompt's first index_topk tokens take
it, no selection yet) runs on the native backend as one C latent MQA per layer (kernels/csrc/attention.c: each
query's dot products over its rows read in the paged cache) and on the torch backend as a BLAS GEMM over a gathered
copy of the rows. Two engines per file (kernels native, mla_path absorbed, attention_backend native / torch, no
prefix caching), a prompt of random ids prefilled by `generate(max_tokens=1)`, the engines taking turns rep by rep;
besides the whole prefill, the seconds spent in the backend's `absorbed` call, timed around it.
--c-flags: build the native library with these flags appended (MLASERVE_KERNEL_CFLAGS; -mno-avx512f: the AVX2
kernels on an AVX-512 CPU); hold torch to the same instructions from the environment (ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2). --models: benchmark models (common.MODELS) whose Q8_0
file (`mlaserve convert`) is written under benchmarks/models when missing; --gguf: given files instead.
Results: a line per engine and benchmarks/results/absorbed_prefill.json (every timing, CPU flags, load average).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ensure_model, random_prompt, run_end, run_start  # noqa: E402
from dsa_prefill import Timed  # noqa: E402
from model_files import ensure_gguf

BACKENDS = ("native", "torch")


def run_file(gguf: Path, tokens: list[int], reps: int, threads: int) -> dict:
    from mlaserve import LLM
    from mlaserve.attention.backends.native_backend import NativeBackend
    from mlaserve.attention.backends.torch_backend import TorchBackend
    from mlaserve.sampling.params import SamplingParams

    classes = {"native": NativeBackend, "torch": TorchBackend}
    longest = max(tokens)
    engines = {}
    for backend in BACKENDS:
        llm = LLM(
            str(gguf), kernels="native", mla_path="absorbed", attention_backend=backend, threads=threads,
            enable_prefix_caching=False, num_pages=longest // 16 + 64,
        )  # fmt: skip
        llm.generate([random_prompt(64, 1000, seed=4)], SamplingParams(max_tokens=1))  # warm-up
        engines[backend] = llm
    out: dict = {}
    for n in tokens:
        ids = random_prompt(n, 1000, seed=5)
        runs: dict = {b: [] for b in BACKENDS}
        for _ in range(reps):
            for backend, llm in engines.items():
                with Timed(classes[backend], "absorbed") as mqa:
                    t = time.perf_counter()
                    llm.generate([ids], SamplingParams(max_tokens=1))
                    total = time.perf_counter() - t
                runs[backend].append({"seconds": total, "absorbed_s": mqa.seconds})
        out[str(n)] = {}
        for backend, rs in runs.items():
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            out[str(n)][backend] = {"median": med, "runs": rs}
            each = ", ".join(f"{r['absorbed_s']:.2f}" for r in rs)
            print(
                f"{gguf.name} {n} tokens, {backend}: prefill {med['seconds']:.2f} s, absorbed MQA "
                f"{med['absorbed_s']:.2f} s (runs {each})",
                flush=True,
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["standard", "glm-real"])
    p.add_argument("--gguf", type=Path, nargs="*", default=[])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--c-flags", nargs="*", default=[], help="appended to the native library's build flags")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from mlaserve.kernels import native, native_build

    if args.c_flags:  # read at the library's first use, below
        os.environ[native_build.EXTRA_FLAGS] = " ".join(args.c_flags)
    res: dict = {"tokens": args.tokens, "threads": args.threads, "c_flags": args.c_flags, "files": {}}
    res["kernels_isa"], res["torch_capability"] = native.isa(), torch.backends.cpu.get_cpu_capability()
    res |= run_start()
    for gguf in args.gguf or [ensure_gguf(ensure_model(m, False)) for m in args.models]:
        res["files"][gguf.name] = run_file(gguf, args.tokens, args.reps, args.threads)
    run_end(res, "absorbed_prefill", args.threads)
    print(f"kernels {res['kernels_isa']}, torch {res['torch_capability']}")


if __name__ == "__main__":
    main()

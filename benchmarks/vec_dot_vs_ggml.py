"""One weight's batch-1 product, mlaserve's native kernel against llama.cpp's own `vec_dot`, on the same bytes.

    python benchmarks/vec_dot_vs_ggml.py --llama-src DIR --llama-lib DIR --gguf FILE [--tensors NAME ...]
                                         [--rounds 5] [--threads 1] [--out FILE]

The whole-step matrix (matrix.py) says which engine decodes faster; this says whose kernel is faster for one
weight type, without the rest of a step. For each named tensor of the GGUF (default: one of each block type in
the file, from its fourth layer), both engines multiply the file's own rows by one activation row:
- mlaserve: `ggml.linear_native` as the engine's decode takes it (`activations="auto"` on this CPU, common.
  default_activations: int8 activations for weights of 6 bits or fewer, int16 for Q8_0 / Q5_0 where the CPU has
  the int16 products, exact fp32 otherwise; the JSON says which), the activation's quantization included (once per call);
- llama.cpp: a small C program (compiled here against DIR's ggml headers and the built libggml) that reads the
  same row bytes, quantizes the activation once with the type's `vec_dot_type` (q8_0 / q8_K: not timed) and times
  `vec_dot` over every row, one thread, as its CPU backend's matrix-vector product does per row.
Rounds alternate the two; each figure is the best call of a round (neighbours on a shared machine only add time),
printed as ns per weight. --threads sets mlaserve's threads (llama.cpp's loop is one thread: compare at 1).
--llama-src is a llama.cpp checkout (its ggml/include), --llama-lib the folder with libggml-base / libggml-cpu.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, default_activations, environment, write_json

from mlaserve.kernels import ggml, native, native_build

ACTIVATIONS, AUTO = default_activations()  # the engine's auto on this CPU, as its decode takes it

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) { /* type n k rows_file reps -> best seconds of one pass over the n rows */
    const int type = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]), reps = atoi(argv[5]);
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *tc = ggml_get_type_traits_cpu(type);
    const size_t rb = ggml_row_size(type, k), xb = ggml_row_size(tc->vec_dot_type, k);
    char *w = malloc(rb * n), *xq = malloc(xb);
    FILE *f = fopen(argv[4], "rb");
    if (!f || fread(w, rb, n, f) != (size_t)n) { fprintf(stderr, "cannot read %s\n", argv[4]); return 1; }
    fclose(f);
    float *x = malloc(sizeof(float) * k);
    for (int i = 0; i < k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    ggml_get_type_traits_cpu(tc->vec_dot_type)->from_float(x, xq, k);
    double best = 1e9; float s, sink = 0;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        for (int i = 0; i < n; i++) { tc->vec_dot(k, &s, 0, w + i * rb, 0, xq, 0, 1); sink += s; }
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("%.9f %g\n", best, sink);
    return 0;
}
"""


def build_harness(src: Path, lib: Path, work: Path) -> Path:
    c, exe = work / "vec_dot.c", work / "vec_dot"
    c.write_text(HARNESS)
    inc = src / "ggml" / "include"
    cc = native_build._compiler()  # the compiler the engine builds its own kernels with
    if cc is None:
        raise SystemExit("no C compiler on PATH (set CC)")
    libs = [f"-L{lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib}"]
    cmd = [cc, "-O2", f"-I{inc}", str(c), *libs, "-o", str(exe)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"could not build the llama.cpp harness against {src} / {lib}:\n{run.stderr[:2000]}")
    return exe


def pick_tensors(reader, names: list[str] | None) -> list:
    if names:
        got = [t for t in reader.tensors if t.name in names]
        missing = set(names) - {t.name for t in got}
        if missing:
            raise SystemExit(f"no tensor {sorted(missing)} in the file")
        return got
    seen, out = set(), []
    for t in reader.tensors:  # one of each block type, from layer 3 (past a dense first layer) or the lm_head
        if t.tensor_type.name in seen or t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        if t.name.startswith("blk.3.") or t.name == "output.weight":
            seen.add(t.tensor_type.name)
            out.append(t)
    return out


def mlaserve_best(t, rows: torch.Tensor, k: int, reps: int) -> float:
    x = torch.randn(1, k)
    ggml.linear_native(x, rows, int(t.tensor_type), k, AUTO)
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        ggml.linear_native(x, rows, int(t.tensor_type), k, AUTO)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", type=Path, required=True)
    ap.add_argument("--llama-lib", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--tensors", nargs="*")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from gguf import GGUFReader

    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    if native.library() is None:
        raise SystemExit(native.status().detail)
    reader = GGUFReader(args.gguf)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = build_harness(args.llama_src, args.llama_lib, work)
        for t in pick_tensors(reader, args.tensors):
            data = np.asarray(t.data).view(np.uint8)
            k, n = int(t.shape[0]), int(np.prod(t.shape[1:]))
            rows = torch.from_numpy(data.copy()).view(n, -1)
            path = work / "rows.bin"
            rows.numpy().tofile(path)
            ours, theirs = [], []
            for _ in range(args.rounds):  # alternating
                ours.append(mlaserve_best(t, rows, k, args.reps) * 1e9 / (n * k))
                run = subprocess.run(
                    [str(exe), str(int(t.tensor_type)), str(n), str(k), str(path), str(args.reps)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                theirs.append(float(run.stdout.split()[0]) * 1e9 / (n * k))
            row = {
                "tensor": t.name,
                "type": t.tensor_type.name,
                "rows": n,
                "k": k,
                "mlaserve_ns_per_weight": ours,
                "llama_cpp_ns_per_weight": theirs,
            }
            results.append(row)
            print(
                f"{t.name:32s} {t.tensor_type.name:8s} [{n} x {k}]  mlaserve {min(ours):.3f}  llama.cpp {min(theirs):.3f}"
                f" ns/weight (best of {args.rounds} rounds; all: {', '.join(f'{v:.3f}' for v in ours)} | "
                f"{', '.join(f'{v:.3f}' for v in theirs)})",
                flush=True,
            )
    out = args.out or RESULTS_DIR / f"vec_dot_vs_ggml-{args.gguf.stem}-t{args.threads}.json"
    write_json(out, {"environment": env, "args": vars(args), "activations": ACTIVATIONS, "results": results})


if __name__ == "__main__":
    main()

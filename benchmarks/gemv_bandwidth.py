"""Batch-1 decode products against the machine's read bandwidth: how many bytes per second the native fused
row kernels (one activation row, the weight read straight from its blocks) pull from memory, beside what a plain
streaming read (torch's sum over a buffer far larger than the caches) reaches on the same threads at the same time.

  PYTHONPATH=$PWD python benchmarks/gemv_bandwidth.py [--threads N] [--rounds R] [--reps N] [--mib M]
      [--types q8_0,q4_0,q5_0,q4_k,q6_k] [--shapes 1536x2048,...] [--rows 1]

Batch-1 decode is memory-bound: a step reads every active weight once, so a kernel's GB/s over the read
ceiling is the share of the step's bound it reaches (docs/PERFORMANCE.md). Each weight (--shapes N x K, the
real-shape models' experts, attention output, dense down_proj and lm_head) is held as enough copies of random
valid blocks (the time does not depend on the values) to fill --mib, beyond the last-level cache, read one
after the other. Activations: float (exact; csrc fused kernels), int8 where the type takes them
(`activations="int8"`: q8 rows, integer dot products) and int16 where this process runs the type's int16 products
(kernels/int16_prefill.py: Q8_0, Q4_0, Q5_0 under `activations="int8_6bit_int16"`); --rows activation rows
(16: a 16-request step, where the products are compute-bound, not read-bound). Each round measures the read ceiling, then every
(type, shape, activations) in turn; the table gives medians over rounds of each round's median call. Prints the
CPU flags and the load average before and after; JSON to benchmarks/results/gemv_bandwidth.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402

# ggml type id, block bytes, values per block, byte offsets of the block's fp16 scales (d, dmin)
TYPES = {
    "q8_0": (8, 34, 32, (0,)),
    "q4_0": (2, 18, 32, (0,)),
    "q5_0": (6, 22, 32, (0,)),
    "q4_k": (12, 144, 256, (0, 2)),
    "q6_k": (14, 210, 256, (208,)),
}


def blocks(name: str, nbytes: int, g: torch.Generator) -> torch.Tensor:
    """[nbytes // block bytes, block bytes] uint8: random codes and sub-block scales, finite small fp16 block
    scales. Every shape of this type is a view of it (rows of whole blocks)."""
    _, size, _, scales = TYPES[name]
    w = torch.randint(0, 256, (nbytes // size, size), generator=g, dtype=torch.uint8)
    for off in scales:
        d = (torch.rand(w.shape[0], generator=g) * 0.01 + 1e-3).half()
        w[:, off : off + 2] = d.view(torch.uint8).view(-1, 2)
    return w


def copies(buf: torch.Tensor, name: str, n: int, k: int) -> list[torch.Tensor]:
    """As many [n, k / values * bytes] weights as fit in buf, one after the other."""
    _, size, per, _ = TYPES[name]
    row_blocks = n * (k // per)
    return [buf[i * row_blocks : (i + 1) * row_blocks].reshape(n, -1) for i in range(buf.shape[0] // row_blocks)]


def read_gbs(buf: torch.Tensor, reps: int) -> float:
    """The streaming read ceiling: torch's sum over buf, median of reps."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / statistics.median(times) / 1e9


def gemv_gbs(type_id: int, ws: list[torch.Tensor], x: torch.Tensor, k: int, acts: str, reps: int) -> float:
    from mlaserve.kernels import int16_prefill, native

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in ws:
            if acts == "int16":
                int16_prefill.linear(x, w, type_id, k)
            else:
                native.gemm(type_id, x, w, k, int8=acts == "int8")
        times.append(time.perf_counter() - t0)
    return sum(w.numel() for w in ws) / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mib", type=int, default=384, help="bytes of weight copies per (type, shape): past the caches")
    p.add_argument("--types", default="q8_0,q5_0,q4_k,q6_k")
    # glm-real's routed experts (gate / up, down), attention output, dense first layer's down_proj, lm_head
    p.add_argument("--shapes", default="1536x2048,2048x1536,2048x5120,2048x10240,32768x2048", help="N x K")
    p.add_argument("--rows", type=int, default=1, help="activation rows (1: batch-1 decode; 16: 16 requests)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gemv_bandwidth.json"))
    args = p.parse_args()

    from mlaserve.kernels import int16_prefill, native

    env = environment(args.threads)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    cases, weights = [], {}  # (type, n, k, activations); (type, n, k) -> the copies
    for name in args.types.split(","):
        type_id, buf = TYPES[name][0], blocks(name, args.mib * 2**20, g)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            weights[(name, n, k)] = copies(buf, name, n, k)
            for acts in ("float", "int8", "int16"):
                if acts == "float" or (acts == "int8" and native.takes_int8(type_id, True)):
                    cases.append((name, n, k, acts))
                elif acts == "int16" and int16_prefill.takes_rows(type_id):
                    cases.append((name, n, k, acts))
    stream = torch.ones(512 * 2**20 // 4)  # the read ceiling's buffer
    x_of = {k: torch.randn(args.rows, k, generator=g) for _, _, k, _ in cases}
    read, got = [], {c: [] for c in cases}
    print(f"load average before: {os.getloadavg()}")
    for r in range(args.rounds):
        read.append(read_gbs(stream, args.reps))
        for c in cases:
            name, n, k, acts = c
            got[c].append(gemv_gbs(TYPES[name][0], weights[(name, n, k)], x_of[k], k, acts, args.reps))
        print(f"round {r + 1}: read {read[-1]:.1f} GB/s", flush=True)
    print(f"load average after: {os.getloadavg()}")
    ceiling = statistics.median(read)
    rows, results = [], []
    for c in cases:
        name, n, k, acts = c
        gbs = statistics.median(got[c])
        rows.append(
            [name, f"{n} x {k}", acts, f"{gbs:.1f}", f"{gbs / ceiling:.2f}", f"{min(got[c]):.1f}-{max(got[c]):.1f}"]
        )
        results.append(
            {"type": name, "n": n, "k": k, "rows": args.rows, "activations": acts, "gbs": gbs, "rounds_gbs": got[c]}
        )
    print(
        f"read ceiling (torch sum, {args.threads} threads): median {ceiling:.1f} GB/s, rounds {min(read):.1f}-{max(read):.1f}"
    )
    print_table(["type", "N x K", "activations", "GB/s", "of read", "rounds"], rows)
    write_json(Path(args.out), {"environment": env, "args": vars(args), "read_gbs": read, "results": results})


if __name__ == "__main__":
    main()

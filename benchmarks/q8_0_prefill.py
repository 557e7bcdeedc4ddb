"""Q8_0 products of many rows: the fp32-grade fast path this process runs under prefill_matmul auto (the bf16 pairs
on the AMX-BF16 tiles, kernels/bf16_pairs.py, or int16 activations on AVX512-VNNI, kernels/q8_0_int16.py) against
the exact fp32 paths (the weight decoded to fp32, then torch's fp32 GEMM; the fp32 decoded panels of
kernels/panels.py where the build has AVX-512) and plain bf16 (the weight decoded to bf16, then oneDNN's bf16 GEMM:
0.57x Q8_0's own error, which the rule refuses), one weight at several row counts.

  PYTHONPATH=$PWD python benchmarks/q8_0_prefill.py [--threads N] [--rounds R] [--reps N] [--rows 48,128,512]
      [--shapes 3072x2048,2048x10944,...]

Random valid Q8_0 blocks (the time does not depend on the values) of each --shapes N x K times --rows activation
rows. Each round times the methods back to back (--reps calls each; wall time and the process's CPU time per call);
the table gives the best call of all rounds, and beside it each method's error against fp64 on the same values
(max |y - y64| / max |y64|). Prints the CPU flags and the load average before and after; JSON to
benchmarks/results/q8_0_prefill.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, write_json  # noqa: E402

Q8_0 = 8


def q8_0(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    q = torch.randint(-128, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    return torch.cat([d.view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)], 2).reshape(n, -1).contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", default="48,128,512", help="activation rows per product")
    # ds-real's routed experts' gate_up (2 x 1408 rows) and the dense first layer's down_proj; glm-real's q_b
    p.add_argument("--shapes", default="2816x2048,2048x10944,5120x768", help="N x K of the weight")
    p.add_argument("--out", default=str(RESULTS_DIR / "q8_0_prefill.json"))
    args = p.parse_args()

    from mlaserve.kernels import bf16_pairs, bf16_prefill, native, panels, q8_0_int16

    if bf16_pairs.granted():
        fast = ("pairs", bf16_pairs.linear)
    elif q8_0_int16.available():
        fast = ("int16", q8_0_int16.linear)
    else:
        raise SystemExit(f"no fast Q8_0 path here: {bf16_pairs.tiles_detail()}; {q8_0_int16.detail()}")
    env = environment(args.threads)
    torch.set_num_threads(args.threads)
    methods = {
        fast[0]: fast[1],
        "fp32": lambda x, w, k: torch.nn.functional.linear(x, native.dequantize(Q8_0, w, k)),
        "bf16": lambda x, w, k: bf16_prefill.linear(x, native.dequantize_bf16(Q8_0, w, k)),
    }
    if panels.available():
        methods["panels"] = lambda x, w, k: panels.linear(x, w, Q8_0, k)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"load average before: {os.getloadavg()}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = q8_0(n, k, g)
        w64 = native.dequantize(Q8_0, w, k).double()
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            y64 = x.double() @ w64.T
            best = {name: (float("inf"), float("inf")) for name in methods}
            err = {}
            for name, fn in methods.items():
                err[name] = ((fn(x, w, k).double() - y64).abs().max() / y64.abs().max()).item()
            for _ in range(args.rounds):
                for name, fn in methods.items():
                    for _ in range(args.reps):
                        t0, c0 = time.perf_counter(), time.process_time()
                        fn(x, w, k)
                        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                        best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
            row = {"n": n, "k": k, "rows": m, "best_wall_ms": {}, "best_cpu_ms": {}, "error_vs_fp64": err}
            for name in methods:
                row["best_wall_ms"][name] = best[name][0] * 1e3
                row["best_cpu_ms"][name] = best[name][1] * 1e3
            rows.append(row)
            w_ms, first = row["best_wall_ms"], fast[0]
            said = ", ".join(
                f"{name} {w_ms[name]:.2f} ms ({w_ms[name] / w_ms[first]:.2f}x) err {err[name]:.1e}" for name in methods
            )
            print(f"{n} x {k}, {m} rows: {said}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    write_json(Path(args.out), {"environment": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()

"""Many-rows products of the 32-value block types (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4): what this process runs for each
under prefill_matmul auto's setting (bf16_prefill.takes_bf16 with the 6-bit cap: on AVX512-VNNI without AMX-BF16
tiles int16 activations, kernels/int16_prefill.py; on AMX-BF16 tiles Q8_0's bf16 pairs, kernels/bf16_pairs.py, and
plain bf16 for the rest) against the exact fp32 paths (the weight decoded to fp32, then torch's fp32 GEMM; the fp32
decoded panels of kernels/panels.py where the build has AVX-512) and plain bf16 (the weight decoded to bf16, then
oneDNN's bf16 GEMM: 0.57x Q8_0's own error, which the rule refuses for Q8_0), one weight at several row counts.

  PYTHONPATH=$PWD python benchmarks/block32_prefill.py [--threads N] [--rounds R] [--reps N] [--rows 48,128,512]
      [--shapes 3072x2048,2048x10944,...] [--types Q8_0,Q5_0]

Random valid blocks (the time does not depend on the values) of each --shapes N x K times --rows activation rows.
Each round times the methods back to back (--reps calls each; wall time and the process's CPU time per call); the
table gives the best call of all rounds, and beside it each method's error against fp64 on the same values (max
|y - y64| / max |y64|). Prints the CPU flags and the load average before and after; JSON to
benchmarks/results/block32_prefill.json.
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

MODE_NAMES = {0: "fp32", 1: "bf16", 3: "pairs", 4: "int16"}  # bf16_prefill's modes


def blocks(name: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """n rows of random valid blocks: random code bytes, a finite scale (fp16; MXFP4's e8m0 byte in 2^-8 .. 2^-3)."""
    from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES

    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    raw = torch.randint(0, 256, (n, k // 32, t.type_size), dtype=torch.uint8, generator=g)
    if name == "MXFP4":
        raw[..., 0] = torch.randint(120, 126, (n, k // 32), dtype=torch.uint8, generator=g)
    else:
        raw[..., :2] = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().view(torch.uint8).view(n, -1, 2)
    return raw.reshape(n, -1).contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rows", default="48,128,512", help="activation rows per product")
    # ds-real's routed experts' gate_up (2 x 1408 rows) and the dense first layer's down_proj; glm-real's q_b
    p.add_argument("--shapes", default="2816x2048,2048x10944,5120x768", help="N x K of the weight")
    p.add_argument("--types", default="Q8_0,Q5_0", help="32-value block types")
    p.add_argument("--out", default=str(RESULTS_DIR / "block32_prefill.json"))
    args = p.parse_args()

    from mlaserve.gguf.quants import GGML_TYPE_IDS
    from mlaserve.kernels import bf16_prefill, ggml, int16_prefill, native, panels

    env = environment(args.threads)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"load average before: {os.getloadavg()}")
    for name in args.types.split(","):
        t = GGML_TYPE_IDS[name]
        mode = bf16_prefill.takes_bf16(t, 6)  # auto's cap (bf16_6bit, int8)
        auto = f"auto ({MODE_NAMES[mode]})"
        methods = {
            auto: lambda x, w, k, t=t, mode=mode: ggml.linear_native(x, w, t, k, bf16=mode),
            "fp32": lambda x, w, k, t=t: torch.nn.functional.linear(x, native.dequantize(t, w, k)),
            "bf16": lambda x, w, k, t=t: bf16_prefill.linear(x, native.dequantize_bf16(t, w, k)),
        }
        if panels.available():
            methods["panels"] = lambda x, w, k, t=t: panels.linear(x, w, t, k)
        if mode != bf16_prefill.INT16 and int16_prefill.takes(t):  # beside the AMX tiles' routes, where auto is not it
            methods["int16"] = lambda x, w, k, t=t: int16_prefill.linear(x, w, t, k)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = blocks(name, n, k, g)
            w64 = native.dequantize(t, w, k).double()
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k, generator=g)
                y64 = x.double() @ w64.T
                best = {method: (float("inf"), float("inf")) for method in methods}
                err = {
                    method: ((fn(x, w, k).double() - y64).abs().max() / y64.abs().max()).item()
                    for method, fn in methods.items()
                }
                for _ in range(args.rounds):
                    for method, fn in methods.items():
                        for _ in range(args.reps):
                            t0, c0 = time.perf_counter(), time.process_time()
                            fn(x, w, k)
                            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                            best[method] = (min(best[method][0], wall), min(best[method][1], cpu))
                row = {"type": name, "auto": MODE_NAMES[mode], "n": n, "k": k, "rows": m, "error_vs_fp64": err}
                row["best_wall_ms"] = {method: best[method][0] * 1e3 for method in methods}
                row["best_cpu_ms"] = {method: best[method][1] * 1e3 for method in methods}
                rows.append(row)
                w_ms = row["best_wall_ms"]
                said = ", ".join(
                    f"{method} {w_ms[method]:.2f} ms ({w_ms[method] / w_ms[auto]:.2f}x) err {err[method]:.1e}"
                    for method in methods
                )
                print(f"{name} {n} x {k}, {m} rows: {said}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    write_json(Path(args.out), {"environment": env, "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()

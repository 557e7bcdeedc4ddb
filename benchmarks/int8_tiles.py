"""AMX-INT8 tiles vs the VNNI row kernels for the K-quants' int8 products (csrc/x86/amx.c against x86/avx2.c's
q8k rows), one weight at several row counts.

  PYTHONPATH=$PWD python benchmarks/int8_tiles.py [--threads N] [--rounds R] [--reps N] [--rows 1,8,16,64,512]

One DeepSeek-V3 expert matrix (2048 x 7168) of random valid Q4_K / Q6_K blocks (int8_activations.py's: the time does
not depend on the values) times --rows activation rows, `native.gemm(..., int8=True)` in two builds of the kernels
loaded side by side: this CPU's (-march=native: the tiles from 16 rows where the CPU has AMX-INT8) and the same
without AMX (-mno-amx-tile -mno-amx-int8: the VNNI rows at every count). Each round times both back to back (median
of --reps calls each), so a neighbour's load hits both; the table gives the best call and the median over rounds.
Below 16 rows both builds run the same VNNI rows (the control: ratio ~1). Prints the CPU flags and the load average
before and after; JSON to benchmarks/results/int8_tiles.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, environment, timed, write_json
from int8_activations import K, N, blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import native

NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")


def builds() -> dict[str, object]:
    tiles = native.library()
    plain, detail = native._build(NO_AMX)
    if tiles is None or plain is None:
        raise SystemExit(f"native kernels unavailable: {detail}")
    return {"tiles": tiles, "vnni": plain}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,8,16,32,64,512")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    env.update(int8_isa=native.int8_isa(), int8_tiles=native.int8_tiles(), loadavg_before=os.getloadavg())
    print(
        f"{env['cpu']}: {' '.join(env['cpu_simd'])}; {env['int8_isa']}; {env['int8_tiles']}; load {env['loadavg_before']}"
    )
    libs = builds()
    rows_out = []
    for name in args.types.split(","):
        tid, w = GGML_TYPE_IDS[name], blocks(name)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            per: dict[str, list[list[float]]] = {"tiles": [], "vnni": []}
            outs = {}
            for _ in range(args.rounds):
                for key, lib in libs.items():
                    native._state["lib"] = lib
                    outs[key] = native.gemm(tid, x, w, K, int8=True)
                    per[key].append(timed(lambda: native.gemm(tid, x, w, K, int8=True), args.reps)["all_s"])
            native._state["lib"] = libs["tiles"]
            row = {"type": name, "rows": rows, "bit_equal": bool(torch.equal(outs["tiles"], outs["vnni"]))}
            for key in per:
                meds = [statistics.median(r) * 1e3 for r in per[key]]
                row[f"{key}_best_ms"] = min(min(r) for r in per[key]) * 1e3
                row[f"{key}_median_ms"], row[f"{key}_spread_ms"] = statistics.median(meds), [min(meds), max(meds)]
            row["speedup_best"] = row["vnni_best_ms"] / row["tiles_best_ms"]
            row["speedup_median"] = row["vnni_median_ms"] / row["tiles_median_ms"]
            rows_out.append(row)
            print(
                f"{name:<5} {rows:>4} rows: best vnni {row['vnni_best_ms']:8.2f} ms, tiles {row['tiles_best_ms']:8.2f} ms"
                f" = {row['speedup_best']:.2f}x | median {row['vnni_median_ms']:8.2f} / {row['tiles_median_ms']:8.2f}"
                f" = {row['speedup_median']:.2f}x  bit-equal {row['bit_equal']}",
                flush=True,
            )
    env["loadavg_after"] = os.getloadavg()
    print(f"load after {env['loadavg_after']}")
    write_json(
        RESULTS_DIR / "int8_tiles.json", {"env": env, "shape": [N, K], "threads": args.threads, "rows": rows_out}
    )


if __name__ == "__main__":
    main()

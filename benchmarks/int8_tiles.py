"""AMX-INT8 tiles (or, on a CPU without them, the AVX512-VNNI weight panels) vs the VNNI row kernels for the K-quants'
int8 products (csrc/x86/amx.c, x86/vnni_panels.c or x86/avx2_panels.c against x86/avx2.c's q8k rows), and vs the bf16
and fp32 prefill GEMMs (decode, then oneDNN), one weight at several row counts.

  PYTHONPATH=$PWD python benchmarks/int8_tiles.py [--threads N] [--rounds R] [--reps N] [--rows 1,16,64,512]
      [--shapes NxK,...]

One DeepSeek-V3 expert matrix (2048 x 7168; --shapes 1024x1024,1024x512: the standard model's) of random valid
Q4_K / Q6_K blocks (int8_activations.py's: the time does not depend on the values) times --rows activation rows:
  tiles  `native.gemm(..., int8=True)` in this CPU's build (-march=native: the tiles from 8 rows on AMX-INT8; without
         them the VNNI panels from native.panel_rows rows, 12 or 16)
  vnni   the same call in the same sources built without AMX (-mno-amx-tile -mno-amx-int8) or, where this process has
         no tiles, without the panels (-DMLS_NO_INT8_PANELS), loaded side by side: the VNNI rows at every count
         (below the threshold both builds run these: the control, ratio ~1)
  bf16   what the many-rows path runs at prefill_matmul auto where bf16 is fast: the weight decoded to bf16, then
         bf16_prefill.linear
  fp32   the exact path (and prefill_matmul int8_float's for the products it keeps float): the native decoder to
         fp32, one mm
Each round times the four back to back (--reps calls each); per call both the wall time and the process's CPU time
(with one thread the CPU time leaves out the time a loaded machine takes the core away: the steadier figure under
load). The table gives the best call of all rounds and the median over rounds. Prints the CPU flags and the load
average before and after; JSON to benchmarks/results/int8_tiles.json.

  PYTHONPATH=$PWD python benchmarks/int8_tiles.py --grouped E,ROWS [--shapes NxK] [--types ...] [--threads N]

A prefill's routed experts alone: E experts of two parts (gate and up, N x K each: glm-real's 1536 x 2048 with
--shapes 1536x2048) with ROWS rows each in one grouped int8 call (native.grouped_gemm: the tiles from 8 rows), ms per
call and weights per second; E x 2 x N x K weights larger than the caches are read from memory each call, as a
prefill step reads its experts. Run it with this checkout and another on PYTHONPATH for before / after. JSON to
benchmarks/results/int8_tiles-grouped.json.

  PYTHONPATH=$PWD python benchmarks/int8_tiles.py --step16 [--file q4_k_m] [--new 16] [--rounds R]

A 16-sequence decode in the engine: the standard model's GGUF (benchmarks/models, --file the type), 1 thread, at
its defaults; per round 16 distinct prompts of 32 tokens generated to 1 token and to --new + 1 tokens, the
process's CPU time of each; decode output tok/s = 16 * new / (the difference). Run it with this checkout and with
another on PYTHONPATH (before / after; the mlaserve in use says whether it has the tiles), alternating runs.
JSON to benchmarks/results/int8_tiles-step16.json.
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
import int8_activations
from common import RESULTS_DIR, environment, write_json
from int8_activations import K, N, blocks

from mlaserve.gguf.quants import GGML_TYPE_IDS
from mlaserve.kernels import bf16_prefill, native, native_build

NO_AMX = ("-mno-amx-tile", "-mno-amx-int8")
NO_PANELS = ("-DMLS_NO_INT8_PANELS",)


def builds() -> dict[str, object]:
    """this build, and the control without its unit for many rows: AMX where the process has the tiles, else the
    VNNI panels"""
    tiles = native.library()
    plain, detail = native_build._build(NO_AMX if native.tiles_granted() else NO_PANELS)
    if tiles is None or plain is None:
        raise SystemExit(f"native kernels unavailable: {detail}")
    return {"tiles": tiles, "vnni": plain}


def step16(args, env: dict) -> None:
    from common import MODELS_DIR, random_prompt

    from mlaserve import LLM
    from mlaserve.sampling.params import SamplingParams

    path = MODELS_DIR / f"mla-std-l12-seed0-{args.file}.gguf"
    llm = LLM(model=str(path), threads=1, page_size=16, max_num_seqs=16, num_pages=16 * 4 + 16)
    tiles = getattr(native, "int8_tiles", lambda: "(this mlaserve has no int8 tiles)")()
    print(f"{path.name}: {tiles}", flush=True)

    def cpu_of(seed: int, new: int) -> float:
        prompts = [random_prompt(32, 32768, seed * 100 + i) for i in range(16)]
        c0 = time.process_time()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        return time.process_time() - c0

    cpu_of(0, 2)  # warm-up
    rounds = []
    for r in range(args.rounds):
        one, full = cpu_of(2 * r + 1, 1), cpu_of(2 * r + 2, args.new + 1)
        rounds.append({"cpu_1_s": one, "cpu_new_s": full, "decode_tok_s_cpu": 16 * args.new / (full - one)})
        print(
            f"round {r}: prefill + 1 token {one:.2f} s CPU, + {args.new} more {full:.2f} s: "
            f"{rounds[-1]['decode_tok_s_cpu']:.1f} output tok/s of CPU time",
            flush=True,
        )
    env["loadavg_after"] = os.getloadavg()
    best = max(x["decode_tok_s_cpu"] for x in rounds)
    print(f"best {best:.1f} tok/s; load after {env['loadavg_after']}")
    out = {"env": env, "file": path.name, "tiles": tiles, "new": args.new, "rounds": rounds, "best_tok_s": best}
    write_json(RESULTS_DIR / "int8_tiles-step16.json", out)


def grouped(args, env: dict) -> None:
    """The routed experts' int8 products of a prefill: E experts of two parts (gate, up) of N x K each, every expert
    with the same rows, one native.grouped_gemm call (the tiles take every expert of 8+ rows); ms per call (best,
    median of --rounds x --reps calls) and the weights per second. The weights (E x 2 x N x K) are larger than
    the caches at the default sizes, so each call reads them from memory, as a prefill step reads its experts."""
    e, rows = (int(v) for v in args.grouped.split(","))
    n, k = (int(v) for v in args.shapes.split(",")[0].split("x"))
    out = []
    for name in args.types.split(","):
        t = GGML_TYPE_IDS[name]
        int8_activations.N, int8_activations.K = e * n, k  # the shape blocks() makes
        gate = blocks(name).view(e, n, -1)
        parts = (gate, gate.clone())  # the same random blocks (the time does not depend on them), apart in memory
        xs = torch.randn(e * rows, k, generator=torch.Generator().manual_seed(3))
        experts, starts = torch.arange(e, dtype=torch.int64), torch.arange(e + 1, dtype=torch.int64) * rows
        native.grouped_gemm(t, xs, parts, k, experts, starts, int8=True)  # warm-up
        times = []
        for _ in range(args.rounds * args.reps):
            t0 = time.perf_counter()
            native.grouped_gemm(t, xs, parts, k, experts, starts, int8=True)
            times.append(time.perf_counter() - t0)
        best, med = min(times), statistics.median(times)
        print(
            f"{name} {e} experts x 2 x {n}x{k}, {rows} rows each: best {best * 1e3:.1f} ms, median "
            f"{med * 1e3:.1f} ms ({2 * e * n * k / med / 1e9:.1f} G weights/s)",
            flush=True,
        )
        out.append({"type": name, "experts": e, "rows": rows, "n": n, "k": k, "best_ms": best * 1e3, "ms": med * 1e3})
    env["loadavg_after"] = os.getloadavg()
    write_json(RESULTS_DIR / "int8_tiles-grouped.json", {"env": env, "threads": args.threads, "results": out})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,16,32,64,128,512")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--shapes", default=f"{N}x{K}", help="weights as NxK, comma-separated (kernels/ggml.TILE_ROWS)")
    ap.add_argument("--step16", action="store_true", help="a 16-sequence decode in the engine (see above)")
    ap.add_argument("--grouped", metavar="E,ROWS", help="E experts (gate, up: the first --shapes) of ROWS rows each")
    ap.add_argument("--file", default="q4_k_m", help="--step16: the standard model's GGUF type")
    ap.add_argument("--new", type=int, default=16, help="--step16: decode steps timed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    env["loadavg_before"] = os.getloadavg()
    if args.step16:
        return step16(args, env)
    if args.grouped:
        return grouped(args, env)
    env.update(int8_isa=native.int8_isa(), int8_tiles=native.int8_tiles(), int8_panels=native.int8_panels())
    print(
        f"{env['cpu']}: {' '.join(env['cpu_simd'])}; {env['int8_isa']}; {env['int8_tiles']}; "
        f"{env['int8_panels'] or 'no int8 panels'}; load {env['loadavg_before']}"
    )
    libs = builds()
    rows_out = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for (n, k), name in ((shape, name) for shape in shapes for name in args.types.split(",")):
        int8_activations.N, int8_activations.K = n, k  # the shape blocks() makes
        tid, w = GGML_TYPE_IDS[name], blocks(name)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            calls = {
                "tiles": (libs["tiles"], lambda: native.gemm(tid, x, w, k, int8=True)),
                "vnni": (libs["vnni"], lambda: native.gemm(tid, x, w, k, int8=True)),
                "bf16": (libs["tiles"], lambda: bf16_prefill.linear(x, native.dequantize_bf16(tid, w, k))),
                "fp32": (libs["tiles"], lambda: x @ native.dequantize(tid, w, k).T),
            }
            wall: dict[str, list[list[float]]] = {key: [] for key in calls}
            cpu: dict[str, list[list[float]]] = {key: [] for key in calls}
            outs = {}
            for _ in range(args.rounds):
                for key, (lib, fn) in calls.items():
                    native_build._state["lib"] = lib
                    outs[key] = fn()
                    ws, cs = [], []
                    for _ in range(args.reps):
                        t0, c0 = time.perf_counter(), time.process_time()
                        fn()
                        ws.append(time.perf_counter() - t0)
                        cs.append(time.process_time() - c0)
                    wall[key].append(ws)
                    cpu[key].append(cs)
            native_build._state["lib"] = libs["tiles"]
            row = {
                "type": name,
                "shape": [n, k],
                "rows": rows,
                "bit_equal": bool(torch.equal(outs["tiles"], outs["vnni"])),
            }
            for key in calls:
                for what, per in (("wall", wall), ("cpu", cpu)):
                    meds = [statistics.median(r) * 1e3 for r in per[key]]
                    row[f"{key}_{what}_best_ms"] = min(min(r) for r in per[key]) * 1e3
                    row[f"{key}_{what}_median_ms"] = statistics.median(meds)
            for other in ("vnni", "bf16", "fp32"):
                row[f"cpu_best_vs_{other}"] = row[f"{other}_cpu_best_ms"] / row["tiles_cpu_best_ms"]
                row[f"wall_median_vs_{other}"] = row[f"{other}_wall_median_ms"] / row["tiles_wall_median_ms"]
            rows_out.append(row)
            print(
                f"{name:<5} {n}x{k} {rows:>4} rows, best CPU ms: tiles {row['tiles_cpu_best_ms']:7.2f}, vnni "
                f"{row['vnni_cpu_best_ms']:7.2f} ({row['cpu_best_vs_vnni']:.2f}x), bf16 {row['bf16_cpu_best_ms']:7.2f}"
                f" ({row['cpu_best_vs_bf16']:.2f}x), fp32 {row['fp32_cpu_best_ms']:7.2f} ({row['cpu_best_vs_fp32']:.2f}x)"
                f" | median wall ms {row['tiles_wall_median_ms']:7.2f} / {row['vnni_wall_median_ms']:7.2f} / "
                f"{row['bf16_wall_median_ms']:7.2f} / {row['fp32_wall_median_ms']:7.2f}  bit-equal {row['bit_equal']}",
                flush=True,
            )
    env["loadavg_after"] = os.getloadavg()
    print(f"load after {env['loadavg_after']}")
    write_json(
        RESULTS_DIR / "int8_tiles.json", {"env": env, "shapes": shapes, "threads": args.threads, "rows": rows_out}
    )


if __name__ == "__main__":
    main()

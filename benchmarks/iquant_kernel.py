"""One DeepSeek-V3 expert matrix (gate_proj: 2048 x 7168) multiplied by 1 and 16 activation rows with the native
kernels, per ggml block type: Q4_K and Q4_0 (the 4-bit reference points) and every i-quant and ternary type. Each
type runs twice: the build's kernel (fused decode-and-dot for every type listed) and the same build compiled with
MLS_DECODE_THEN_DOT (each weight row decoded into a buffer by the type's decoder, then dotted with each activation
row: what the types without a fused kernel ran before). Random valid blocks (fp16 scales of a sane size): the time
does not depend on the values. Columns: median and fastest ms per call (benchmarks/common.py's timer; on a shared machine
the fastest is the least disturbed), decode-then-dot's median, the fused kernel's speed-up over it and its median
relative to Q4_K's, the weight bytes read per call / median time (GB/s).
The JSON (results, CPU model and SIMD flags, load average before and after) goes to benchmarks/results/.

  python benchmarks/iquant_kernel.py [--threads N] [--reps R] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native, native_build
from mlaserve.loading.tensor_check import SCALE_OFFSETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, environment, print_table, timed, write_json  # noqa: E402

N, K = 2048, 7168  # DeepSeek-V3: moe_intermediate_size x hidden_size
TYPES = ("Q4_K", "Q4_0", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
TYPES += ("TQ2_0", "TQ1_0")


def blocks(name: str) -> torch.Tensor:
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (N * K // t.block_size, t.type_size), dtype=torch.uint8, generator=g)
    d = (torch.rand(raw.shape[0], generator=g) * 0.02 + 0.001).half()
    if name == "IQ1_M":  # d's 16 bits are the top nibbles of the 4 scale words (random ones: subnormals, NaNs)
        bits = d.view(torch.int16).to(torch.int32) & 0xFFFF
        words = raw[:, 48:56].clone().view(torch.int16).to(torch.int32) & 0xFFFF
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        raw[:, 48:56] = words.to(torch.int16).view(torch.uint8).view(-1, 8)
    else:
        for off in SCALE_OFFSETS[name]:
            raw[:, off : off + 2] = d.view(torch.uint8).view(-1, 2)
    return raw.reshape(N, -1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = environment(args.threads)
    fused_lib = native.library()
    unfused_lib, detail = native_build._build(("-DMLS_DECODE_THEN_DOT",))
    if fused_lib is None or unfused_lib is None:
        raise SystemExit(f"native kernels unavailable: {native.status().detail} / {detail}")
    print(
        f"{native.isa()} build, {args.threads} thread(s), weight {N} x {K}, {env['cpu']}, {' '.join(env['cpu_simd'])}"
    )
    results = []
    for name in TYPES:
        tid = GGML_TYPE_IDS[name]
        w, t = blocks(name), GGML_TYPES[tid]
        for rows in (1, 16):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            ms = {}
            for how, lib in (("fused", fused_lib), ("decode_then_dot", unfused_lib)):
                native_build._state["lib"] = lib  # the library native.gemm calls
                t_s = timed(lambda: ggml.linear(x, w, tid, K, kernel="native"), args.reps)
                ms[how], ms[f"{how}_min"] = t_s["median_s"] * 1e3, t_s["min_s"] * 1e3
            native_build._state["lib"] = fused_lib
            fused = bool(native.type_kernels(tid) & 2)
            results.append(
                {
                    "type": name,
                    "bits_per_weight": 8 * t.type_size / t.block_size,
                    "mib": w.numel() / 2**20,
                    "rows": rows,
                    "kernel": "fused" if fused else "decode, then dot",
                    "ms": ms["fused"],
                    "ms_min": ms["fused_min"],
                    "ms_decode_then_dot": ms["decode_then_dot"],
                    "ms_decode_then_dot_min": ms["decode_then_dot_min"],
                    "gb_s": w.numel() / ms["fused"] / 1e6,
                }
            )
    q4k = {r["rows"]: r["ms"] for r in results if r["type"] == "Q4_K"}
    table = [
        [
            r["type"],
            f"{r['bits_per_weight']:.2f}",
            f"{r['mib']:.1f}",
            r["rows"],
            f"{r['ms']:.2f}",
            f"{r['ms_min']:.2f}",
            f"{r['ms_decode_then_dot']:.2f}",
            f"{r['ms_decode_then_dot'] / r['ms']:.1f}x",
            f"{r['ms'] / q4k[r['rows']]:.2f}",
            f"{r['gb_s']:.1f}",
        ]
        for r in results
    ]
    heads = ["format", "bits/w", "MiB", "rows", "ms", "min ms", "decode-then-dot ms", "speed-up", "vs Q4_K", "GB/s"]
    print_table(heads, table)
    env["loadavg_end"] = list(os.getloadavg())
    out = args.json or RESULTS_DIR / f"iquant_kernel-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(out, {"isa": native.isa(), "threads": args.threads, "shape": [N, K], "env": env, "results": results})


if __name__ == "__main__":
    main()

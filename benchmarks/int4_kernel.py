"""One Kimi-K2 expert matrix (gate_proj: 2048 x 7168) multiplied by 1 and 16 activation rows, per weight format:
INT4 pack-quantized with the native kernel and with the torch reference (unpack, then the GEMM), the same
weights as Q4_0 and as MXFP4 blocks with the native kernels, and as bf16 / fp32 matrices. Columns: median ms
per call, and the weight bytes read per call / time (GB/s).

  python benchmarks/int4_kernel.py [--threads N] [--reps R]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from mlaserve.kernels import ggml, native
from mlaserve.quant import int4_group

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed  # noqa: E402

N, K = 2048, 7168  # Kimi-K2: moe_intermediate_size x hidden_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import gguf

    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    p, s = int4_group.quantize(w)
    s32 = s.float().contiguous()
    grid = native.ScaleGrid(s32, 1, K // 32, 32, N)
    q4 = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0).copy())
    mx = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4).copy())
    wb, wf = w.bfloat16(), w.contiguous()
    variants = [
        (
            "int4 native",
            p.numel() * 4 + s32.numel() * 4,
            lambda x: native.gemm(native.INT4_PACKED, x, p.view(torch.uint8), K, grid),
        ),
        ("int4 torch ref", p.numel() * 4 + s32.numel() * 4, lambda x: F.linear(x, int4_group.dequantize(p, s32))),
        ("Q4_0 native", q4.numel(), lambda x: ggml.linear(x, q4, 2, K, kernel="native")),
        ("MXFP4 native", mx.numel(), lambda x: ggml.linear(x, mx, 39, K, kernel="native")),
        ("bf16", wb.numel() * 2, lambda x: F.linear(x.bfloat16(), wb)),
        ("fp32", wf.numel() * 4, lambda x: F.linear(x, wf)),
    ]
    print(f"{native.isa()} build, {args.threads} thread(s), weight {N} x {K}")
    print(f"{'format':<16} {'MiB':>6} {'rows':>4} {'ms':>8} {'GB/s':>6}")
    for name, nbytes, fn in variants:
        for rows in (1, 16):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            t = timed(lambda: fn(x), args.reps)["median_s"]  # one warm-up call, then the median of reps
            print(f"{name:<16} {nbytes / 2**20:>6.1f} {rows:>4} {t * 1e3:>8.2f} {nbytes / t / 1e9:>6.1f}")


if __name__ == "__main__":
    main()

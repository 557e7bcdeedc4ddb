"""One DeepSeek-V3 expert matrix (gate_proj: 2048 x 7168) multiplied by 1 and 16 activation rows with the native
kernels, per ggml block type: IQ4_XS and IQ4_NL (fused decode-and-dot) against Q4_K and Q4_0 (fused), and the
lower i-quants IQ3_XXS / IQ2_XXS / IQ1_S (scalar decode of each row, then the dot). Random valid blocks (fp16
scales of a sane size): the time does not depend on the values. Columns: median ms per call, and the weight bytes
read per call / time (GB/s).

  python benchmarks/iquant_kernel.py [--threads N] [--reps R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import ggml, native
from mlaserve.loading.tensor_check import SCALE_OFFSETS

N, K = 2048, 7168  # DeepSeek-V3: moe_intermediate_size x hidden_size
TYPES = ("Q4_K", "IQ4_XS", "Q4_0", "IQ4_NL", "IQ3_XXS", "IQ2_XXS", "IQ1_S")


def blocks(name: str) -> torch.Tensor:
    t = GGML_TYPES[GGML_TYPE_IDS[name]]
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (N * K // t.block_size, t.type_size), dtype=torch.uint8, generator=g)
    for off in SCALE_OFFSETS[name]:
        raw[:, off : off + 2] = (
            (torch.rand(raw.shape[0], generator=g) * 0.02 + 0.001).half().view(torch.uint8).view(-1, 2)
        )
    return raw.reshape(N, -1).contiguous()


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{native.isa()} build, {args.threads} thread(s), weight {N} x {K}")
    print(f"{'format':<8} {'bits/w':>6} {'MiB':>6} {'rows':>4} {'ms':>8} {'GB/s':>6}")
    for name in TYPES:
        tid = GGML_TYPE_IDS[name]
        w = blocks(name)
        t = GGML_TYPES[tid]
        for rows in (1, 16):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            s = timed(lambda: ggml.linear(x, w, tid, K, kernel="native"), args.reps)
            bits = 8 * t.type_size / t.block_size
            print(
                f"{name:<8} {bits:>6.2f} {w.numel() / 2**20:>6.1f} {rows:>4} {s * 1e3:>8.2f} {w.numel() / s / 1e9:>6.1f}"
            )


if __name__ == "__main__":
    main()

"""Prefill products on the matrix units: the decoded weight and the activations rounded to bfloat16, one bf16
GEMM (oneDNN through torch: AMX-BF16 or AVX512-BF16 where the CPU has them), the result widened to fp32.

Notation
  x   [M, K]      fp32 activations (M > GEMV_ROWS: the many-rows path of kernels/ggml.py)
  W   [N, K]      bf16, the weight decoded natively and rounded to the nearest bf16 in the same pass
                  (native.dequantize_bf16: the reference dequantizer's values, rounded as torch rounds them)
  xs  [P, K], Ws [A, N, K], offs [A]: the grouped form (routed experts, attention heads), as kernels/ggml.py
  y   [M, N]      fp32 = bf(bf(x) @ bf(W)^T), bf = round to nearest bfloat16 (8 significant bits, u = 2^-8);
                  the sum accumulates in fp32 inside oneDNN and torch's CPU GEMMs return bf16 (no bf16 x bf16 ->
                  fp32 GEMM on the CPU in torch 2.13), so the output is rounded once more:
                  |y - x W^T| <= u |x W^T| + (2u + u^2 + K 2^-24)(1 + u) sum_k |x_k| |W_k|
                  (tests/kernels/test_prefill_bf16.py holds the products to it against an fp64 computation).

Which weights take it (a setting: the widest weight, in bits per value, whose products run in bf16; 0 none):
the rule of docs/FORMATS.md, as for int8 activations: the error bf16 adds must stay well inside (at most half)
the file's own quantization error. Measured per type on the fixtures' tensors (products with N(0,1)
activations, ||y_bf16 - y_file|| / ||y_file|| against ||y_file - y_f32|| / ||y_f32||, the f32 file the
reference): Q4_0 0.035x, Q4_K 0.041x, Q5_0 0.071x, Q5_1 0.078x, Q5_K 0.080x, Q6_K 0.16x, Q8_0 0.54-0.57x
(over the rule: bf16 keeps 8 significant bits, Q8_0's own step is about as fine). So the automatic choice
(prefill_matmul "bf16_6bit", config/machine.BF16_BITS) takes weights of 6 bits or fewer, and Q8_0 takes the split
products of kernels/bf16_pairs.py where the CPU has AMX-BF16 tiles (fp32 grade: ~2^-16 per product), the int16
activations of kernels/int16_prefill.py where it has AVX512-VNNI instead (the same grade), fp32 elsewhere; there
(no AMX-BF16 tiles, AVX512-VNNI) the other 32-value block types under the cap take int16 too, not plain bf16 (~150x
finer; the blocks read in place instead of the weight decoded per call: on the 2-core AVX-512 EPYC measured, 1.5-13x
faster at 17-48 rows, level at 512, kernels/int16_prefill.py);
prefill_matmul="bf16" takes every type (BF16_ALL), Q8_0 too in plain bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.config.cpu import cpu_flags
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import bf16_pairs, int16_prefill

# bits per stored value of each block type (what a bf16 setting caps); types not listed (F32, F16, BF16) never
# take bf16 prefill under a cap below BF16_ALL
WEIGHT_BITS = {
    "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "IQ4_NL": 4, "MXFP4": 4,
    "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_XS": 4,
    "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "IQ3_XXS": 3, "IQ3_S": 3, "IQ1_S": 1, "IQ1_M": 1,
    "TQ1_0": 2, "TQ2_0": 2,
}  # fmt: skip
BF16_UNITS = ("amx_bf16", "avx512_bf16")  # the flags of the units, fastest first
BF16_ALL = 64  # a setting under which every weight type takes bf16 prefill (prefill_matmul="bf16")
# what takes_bf16 answers (a holder's per-weight bf16 setting; truthy: the many-rows products leave fp32)
FP32, BF16, BF16_PAIRS, INT16 = 0, 1, 3, 4


def takes_bf16(type_id: int, cap: int) -> int:
    """How products with a weight of this ggml type run on the many-rows path under the setting `cap` (asked once
    per weight at load, when the kernel plan binds the holders): BF16 (this module's GEMMs), BF16_PAIRS (Q8_0 under a
    cap below BF16_ALL where the process has the AMX-BF16 tiles: kernels/bf16_pairs.py), INT16 (where it has no
    such tiles but AVX512-VNNI: Q8_0 under such a cap and the other 32-value block types under a cap they fit,
    kernels/int16_prefill.py; fp32 grade, ~2^-16 per product) or FP32."""
    if cap >= BF16_ALL:
        return BF16
    fits = admits_bf16(type_id, cap)
    if not fits and not (cap and type_id == bf16_pairs.Q8_0):
        return FP32
    # an AMX CPU: bf16 and the pairs on the tiles. Measured against the int16 products there (2-core AMX Xeon,
    # 2026-12-06, benchmarks/block32_prefill.py): level at 48 rows, 1.3-1.7x slower than the pairs and 1.6-3.1x
    # slower than bf16 (Q4_0 / Q5_0) at 128-512 rows
    if bf16_pairs.granted():
        return BF16 if fits else BF16_PAIRS
    if int16_prefill.takes(type_id):
        return INT16
    return BF16 if fits else FP32


def admits_bf16(type_id: int, cap: int) -> bool:
    """Whether the setting `cap` admits plain bf16 for products with a weight of this type (its bits <= cap, or every
    type): what takes_bf16 starts from, and what the products of the same weights by other routes ask (a prompt's K / V
    expansion and attention, quant/ggml_heads.py), whichever unit the weight's own products take."""
    bits = WEIGHT_BITS.get(GGML_TYPES[type_id].name)
    return cap >= BF16_ALL or (bits is not None and bits <= cap)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [M, N] fp32 = bf(bf(x) @ bf(w)^T): x [M, K] fp32, w [N, K] bf16 (or fp32, then rounded here). x's rows
    are padded with zero rows to bucket_rows(M) (a step's token count differs from step to step, and oneDNN keeps
    a primitive per row count and weight shape: without the ladder a server's cache grows by one primitive per
    dense weight shape for every distinct prompt length); the padded rows' outputs are dropped."""
    return F.linear(padded_rows(x), w.to(torch.bfloat16))[: x.shape[0]].float()


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to bf16 and padded with zero rows to bucket_rows(M): linear()'s left operand (a caller
    that multiplies x by a weight in parts rounds it once)."""
    xp = x.new_zeros(bucket_rows(x.shape[0]), x.shape[1], dtype=torch.bfloat16)
    xp[: x.shape[0]] = x
    return xp


def grouped(xs: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times ws[a]^T, in bf16 as linear(). Each group's
    rows are padded with zero rows to bucket_rows(count): torch runs a bf16 grouped GEMM on the CPU as one
    oneDNN GEMM per group, and oneDNN keeps a primitive (with its buffers) per distinct row count, so a
    prefill's experts of every size between 1 and hundreds of rows grew the process by ~0.4 GiB
    (docs/PERFORMANCE.md); bucketed, a few row counts serve them all. A padded row is zero and its output is
    dropped; a real row's product is the same bf16 GEMM."""
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    padded = bucket_rows_tensor(counts)
    ends = torch.cumsum(padded, 0)
    group = torch.repeat_interleave(torch.arange(counts.shape[0], device=xs.device), counts)
    dest = (ends - padded)[group] + torch.arange(xs.shape[0], device=xs.device) - (offs.to(torch.int64) - counts)[group]
    xp = xs.new_zeros(int(ends[-1]) if ends.numel() else 0, xs.shape[1], dtype=torch.bfloat16)
    xp[dest] = xs.to(torch.bfloat16)
    yp = torch._grouped_mm(xp, ws.to(torch.bfloat16).transpose(1, 2), offs=ends.to(torch.int32))
    return yp[dest].float()


# The row ladder. Every primitive oneDNN caches (one per row count and weight shape) stays alive, and those small
# long-lived blocks land between a prefill's large temporaries, so glibc cannot hand the freed space back: on the
# standard model's Q4_K_M file one 2,048-token step ran its bf16 GEMMs at 64 distinct shapes (ONEDNN_VERBOSE) and
# kept ~0.4 GiB more anonymous memory than with oneDNN's cache off (docs/PERFORMANCE.md). Up to LADDER_FINE rows
# the counts round up to a multiple of ROW_BUCKET (at most 31 zero rows); above, to LADDER_STEPS steps per
# octave (at most 1/LADDER_STEPS of the rows added), so the row counts a process ever meets grow with the log
# of the largest group, not linearly.
ROW_BUCKET = 32
LADDER_FINE = 128
LADDER_STEPS = 4


def bucket_rows(rows: int) -> int:
    """The padded row count of a GEMM with `rows` rows (0 stays 0): a multiple of ROW_BUCKET up to LADDER_FINE,
    then a multiple of 2^(floor(log2(rows - 1)) - log2(LADDER_STEPS))."""
    if rows <= LADDER_FINE:
        return -(-rows // ROW_BUCKET) * ROW_BUCKET
    step = (1 << (rows - 1).bit_length()) // (2 * LADDER_STEPS)
    return -(-rows // step) * step


def bucket_rows_tensor(rows: torch.Tensor) -> torch.Tensor:
    """bucket_rows for an int64 tensor of counts (the groups of one grouped GEMM), without a host copy."""
    fine = (rows + ROW_BUCKET - 1) // ROW_BUCKET * ROW_BUCKET
    octave = torch.floor(torch.log2((rows - 1).clamp(min=1).double())).to(torch.int64) + 1  # bit_length(rows - 1)
    step = torch.pow(2, octave) // (2 * LADDER_STEPS)
    coarse = (rows + step - 1) // step.clamp(min=1) * step
    return torch.where(rows <= LADDER_FINE, fine, coarse)


def units() -> str:
    """The CPU's bf16 matrix units oneDNN runs these GEMMs on, for the kernel plan's note."""
    found = [f for f in BF16_UNITS if f in cpu_flags()]
    return f"oneDNN on {found[0]}" if found else "no AMX-BF16 / AVX512-BF16 here: torch's bf16 GEMM in fp32 units"

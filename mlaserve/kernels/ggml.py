"""Matrix products with weights kept in llama.cpp's block formats (GGUF Q8_0, Q4_0, Q4_K, ...).

Notation
  x   [M, K]   activations (any float dtype; the product runs in fp32)
  W   [N, K]   the weight as the file stores it: raw ggml bytes [N, R] uint8, R = K / block * type_size
               (a row is a whole number of blocks, so rows are independent byte ranges)
  y   [M, N]   fp32, = x @ dequantize(W)^T up to float summation order
  Experts: W [E, N, R]; xs [P, K] the (token, expert) pairs sorted by expert; experts [A] the active
  expert ids (ascending), offs [A] int32 cumulative pair counts (the end of each group in xs).
  W may also be a tuple of stacks [E, N_i, R] whose rows follow one another (N = sum N_i): a MoE layer's gate
  and up stacks, kept where the file stores them (ffn_gate_exps, ffn_up_exps) and multiplied as the one
  [E, 2I, R] stack they were once copied into (the same values, the same GEMMs).
These functions are the seam (LINEAR / EXPERT_LINEAR: an implementation per name, which a holder binds at
load). kernel="torch" is the reference: "dequantize (gguf.quants, bit-exact
with gguf-py), then one fp32 GEMM". kernel="native" (csrc/): up to GEMV_ROWS rows per weight,
each weight row is decoded once (bit-identical values) and dotted with every x row, reading the
blocks straight from memory (Q8_0, Q4_0, Q5_0, MXFP4, Q4_K, Q6_K, every i-quant, TQ1_0, TQ2_0: fused, the (sub-)block scale applied to each partial
sum, a rounding within the same bound); more rows than that are compute-bound, so the weight is decoded once
by the native decoder and the BLAS GEMM does the rest (a grouped product, routed experts or heads, in fp32 where
the build has AVX-512: on decoded panels, kernels/panels.py, each expert's rows decoded a panel at a time in a
thread's buffer instead of whole in memory). Both agree with the reference up to fp32
summation order (tests/kernels/test_kernels.py holds them to that bound). With int8 (engine option
activations; native.takes_int8 says which weight types under which setting) the small-batch products quantize
their activations as llama.cpp does and take integer dot products: not exact, within the activations'
quantization bound (tests/kernels/test_int8_kquants.py holds the K-quants to llama.cpp's definitions exactly).
With bf16 (engine option prefill_matmul; bf16_prefill.takes_bf16 says which weight types, decided per weight at
load) the many-rows products round the decoded weight and the activations to bfloat16 and run one bf16 GEMM
(kernels/bf16_prefill.py: AMX / AVX512-BF16 through oneDNN); not exact, within the bound derived there. Q8_0's
products under that setting (bf16_prefill.BF16_PAIRS) run on the AMX-BF16 tiles instead, the codes exact and each
activation as a pair of bf16s (kernels/bf16_pairs.py: fp32 grade, the blocks read where they lie), or without those
tiles on AVX512-VNNI (bf16_prefill.INT16) with each activation an int16 code per 32-value block (kernels/int16_prefill.py:
the same grade, the integer sums exact), which the other 32-value block types (Q4_0, Q5_0, IQ4_NL, MXFP4) take there
instead of plain bf16.
With tiles (prefill_matmul "int8"; native.takes_tiles says which weights, decided per weight at load) the products of
up to tile_rows(type) rows keep the int8 call, which runs them on the AMX-INT8 tiles from 8 rows: the decode kernels'
bits for every row (tests/kernels/test_int8_prefill_tiles.py), int8 activations' rounding instead of bf16's. Without
the tiles the same weights keep the int8 call at every row count where the build has int8 panels for their type
(native.takes_panels): 16-row weight panels with AVX512-VNNI, 8-row ones with AVX2 only, from
native.panel_rows rows, the same bits (tests/kernels/test_int8_panels.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES, dequantize
from mlaserve.kernels import bf16_pairs, bf16_prefill, int16_prefill, native, panels

# Rows of x per weight up to which the decode-and-dot kernel beats decode-then-BLAS (measured on
# 2-core AVX2 EPYCs: at 16 rows the two are about even for a 1024 x 1024 Q8_0 weight).
GEMV_ROWS = 16
# Up to this many (token, expert) pairs a MoE layer's routed experts run as one native call, pair by
# pair (decode at batch 1-2): two tokens sharing an expert read it twice, but ~30 tensor ops of
# sorting and scattering are saved; more pairs are sorted by expert and grouped (expert_linear).
MOE_PAIRS = 8
# Rows of x up to which a dense weight's fp32 product runs on decoded panels (kernels/panels.py, AVX-512 builds)
# rather than decode-then-BLAS: the BLAS packs the weight for every call, which few rows do not amortize. Measured on
# the 2-core AVX-512 EPYC of 2026-12-06, ds-real's Q8_0 shapes, BLAS / panels time: 17 rows 2.5-3x, 64 rows
# 1.2-1.4x, 128 rows 1.0-1.1x, 256 rows 0.9-1.1x; at 512-2048 rows the BLAS is 10-15% faster. The grouped products
# (routed experts, heads) take the panels at every row count (a group's rows are few; level at 512 per expert). One
# CPU measured, under prefill_matmul "float" since Q8_0 takes int16 activations on AVX512-VNNI (kernels/int16_prefill.py)
# and the bf16 pairs on AMX tiles under auto; the fp32 crossover on an AMX Xeon is unmeasured.
PANEL_ROWS = 128
# Decoded fp32 expert weights per chunk when many rows per expert take decode-then-GEMM (prefill). 16 MiB: the
# peak of a 512-token prefill of the standard benchmark model's Q8_0 file was 0.09 GiB above 64 MiB's (a chunk
# and its transposed copy), and alternating prefills were no slower (docs/PERFORMANCE.md, Memory).
EXPERT_BYTES = 16 << 20
# Decoded bytes of a dense weight per part (about) when a many-rows product takes decode-then-GEMM (linear_native):
# the weight is decoded a part at a time into one buffer, each part's GEMM writing its columns of y. Whole, a
# DeepSeek-V3 dense layer's gate, up or down matrix is 264 MB in bf16 and 528 MB in fp32, which glibc serves (over
# its 32 MiB mmap threshold) with fresh pages on every prefill step; in parts it is 1.1-1.6x faster at that shape
# (the part stays in L3) and 0.2-0.5 GiB lower at the peak (docs/PERFORMANCE.md, dense weights decoded in parts).
DENSE_BYTES = 16 << 20
# The routed experts' activations per chunk of a prefill's (token, expert) pairs (quant/ggml_linear.py
# GGUFExperts._grouped): each pair's gathered input, gate and up outputs, activation and down output, fp32, for whole
# experts at a time. Without it a 2,048-token step of a 64-expert top-6 model at hidden 2048 held ~0.5 GB of them at
# once (12,288 pairs) while llama.cpp's whole compute buffer is sized for 512 tokens.
MOE_CHUNK_BYTES = 32 << 20
# Rows per product (per active expert: the mean of a grouped call) up to which a prefill product of a weight that
# takes the AMX-INT8 tiles (native.takes_tiles; the holder's choice at load, prefill_matmul "int8") runs there with
# int8 activations instead of decode-then-GEMM. Measured (benchmarks/int8_tiles.py, 2 threads, median wall ms, tiles /
# bf16 decode+oneDNN, the 2-core AMX Xeon of 2026-12-05, since the tiles run one region per grouped call, read their
# blocks as a prefetch stream and Q6_K looks its plane bytes up) at 128 rows: Q4_K 512 x 1024 0.21 / 0.30, 1024 x 512
# 0.21 / 0.31, 2048 x 7168 3.94 / 6.17; Q6_K 0.23 / 0.40, 0.25 / 0.37, 4.31 / 6.61; IQ4_XS 0.24 / 0.35, 0.28 / 0.36,
# 4.20 / 6.69; IQ1_S 1.6-2x, IQ1_M 1.4-1.9x, Q5_K level to 1.3x; at 192 rows 1.0-1.4x (IQ4_XS and Q5_K level). 128
# keeps a margin (64 before: measured at 1 thread under load 6.6, Q4_K even with bf16 at 128 on small shapes then,
# Q6_K 1.2-1.4x slower); the standard model's experts (64 rows each in a 512-token prompt, a layer with an idle
# expert just above) no longer fall to decode-then-GEMM. One CPU (a 2-core Sapphire-Rapids-class Xeon): to be
# measured again on others; the crossover moves speed only, each path within its own error bound.
TILE_ROWS = 128
# The i-quants whose native decoders are grid-table lookups in plain C (csrc/ref/iquants.c): decode-then-GEMM costs
# them more, so their tiles stay faster far above TILE_ROWS. Measured (benchmarks/int8_tiles.py, 2 threads, median
# wall ms, tiles / bf16, the 2-core AMX Xeon of 2026-12-04, 1024 x 1024): at 256 rows IQ2_XXS 1.53 / 2.92, IQ2_XS
# 1.93 / 2.86, IQ2_S 1.81 / 3.10, IQ3_XXS 1.35 / 2.43, IQ3_S 1.59 / 3.11; at 512 about level (IQ2_XXS 2.78 / 2.86,
# IQ2_XS 3.66 / 3.47, IQ3_S 2.83 / 3.61). IQ1_S and IQ1_M (level at 128 that day, 1.4-2x by the
# measurement above) and IQ4_XS keep TILE_ROWS. The standard model's IQ mix (experts IQ2_XXS / IQ3_XXS at 64 rows per
# expert in a 512-token prompt, a layer with an idle expert just above): prefill 512 621-686 -> 742-755 tok/s.
GRID_TILE_ROWS = 256
GRID_TILE_TYPES = frozenset(GGML_TYPE_IDS[n] for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"))
KERNELS = ("native", "torch")


# Where the process has no AMX-INT8 tiles (native.takes_expert_int8), the routed experts' int8 products of up to this
# many rows per active expert stay on the int8 row kernels (4 activation rows per pass over a weight row, VNNI dot
# products; the decode kernels' bits, as the tiles' are) instead of the experts decoded to bf16 for oneDNN's GEMM.
# Measured (prefill of a 512-token prompt, 2 threads, best of 3, the 2-core AVX-512 EPYC without AMX of 2026-12-06,
# threshold 16 / 64 / 128): glm-real Q4_K_M (32 rows per expert) 248 / 365 / 362 tok/s, the standard model's IQ mix
# (64) 287 / - / 416, its Q4_K_M (64) 524 / 521 / 540; ds-real Q4_K_M (48), alternating 16 and 128 three times,
# 306-321 / 324-338 (its Q5_0 / Q8_0 down experts stay fp32); at 128 rows per expert (glm-real, a 2048-token prompt)
# level, 318 / 320, and 296 with 256. The machine's run-to-run spread was up to 15%. Since the VNNI panels (PANEL_INT8_ROWS
# below) this limit holds only where a type has no panels in the process (AVX-VNNI without AVX-512). Dense weights keep
# bf16 above GEMV_ROWS there (a weight's hundreds of prompt rows re-read each block once per 4 rows), and so do the
# 32-value block types
# (native.ROW_KERNEL_TYPES: the standard Q4_0 file 535-568 -> 462-468 tok/s on them; int16 activations since, where there
# is AVX512-VNNI: kernels/int16_prefill.py). Q8_0 / Q5_0 experts take no int8 call (their fp32 row kernels were 3-6%
# slower than decode + fp32 GEMM at 32-64 rows; int16 activations since, as above).
ROW_KERNEL_ROWS = 128


# Where the process runs a type's int8 products on the int8 panels (native.takes_panels: the K-quants and the
# i-quants with q8_K activations on a CPU without AMX-INT8 tiles: AVX512-VNNI's 16-row panels or AVX2's 8-row ones), they
# stay int8 at every row count:
# measured faster than the weight decoded for a bf16 GEMM at every count tried (2 threads, the 2-core AVX-512 EPYC
# without AMX of 2026-12-06): glm-real's dense Q4_K weights at 32 / 128 / 512 / 2048 rows 2.2-3.2x / 1.9-2.2x /
# 1.7-1.85x / 1.1-1.55x, its routed experts at 64-512 rows per expert Q4_K 1.8-2.7x, Q6_K 1.4-1.6x; the IQ mix's
# IQ2_XXS / IQ3_XXS experts 2.2-5.3x, its IQ4_XS dense weights 1.25-3x (benchmarks/int8_tiles.py compares the units
# on random blocks). The AVX2 panels, on the 2-core AVX2-only EPYC of 2026-12-07: 1.8-2.6x the fp32 path at 512 rows
# per weight, 1.9-3.4x the row kernels from 64 rows (benchmarks/README.md, "second night").
PANEL_INT8_ROWS = sys.maxsize


def expert_int8_rows(ggml_type: int) -> int:
    """Rows per active expert (on average) up to which a routed-expert product the holder keeps int8 in prefill
    (native.takes_expert_int8) stays int8: tile_rows on the AMX-INT8 tiles or the VNNI panels, ROW_KERNEL_ROWS on the
    row kernels where the process has neither for the type."""
    return tile_rows(ggml_type) if native.tiles_granted() or native.panel_rows(ggml_type) else ROW_KERNEL_ROWS


def tile_rows(ggml_type: int) -> int:
    """Rows per product (per active expert, on average) up to which a weight of this type that the holder keeps int8
    in prefill stays int8: on the VNNI panels (no AMX tiles here, native.panel_rows) every count (PANEL_INT8_ROWS);
    on the tiles GRID_TILE_ROWS for the grid i-quants, TILE_ROWS for the others."""
    if not native.tiles_granted() and native.panel_rows(ggml_type):
        return PANEL_INT8_ROWS
    return GRID_TILE_ROWS if ggml_type in GRID_TILE_TYPES else TILE_ROWS


def row_bytes(ggml_type: int, k: int) -> int:
    t = GGML_TYPES[ggml_type]
    if k % t.block_size:
        raise ValueError(f"a {t.name} row holds whole {t.block_size}-value blocks; {k} columns do not")
    return k // t.block_size * t.type_size


def dense(w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """Raw [..., N, R] -> fp32 [..., N, K] (the reference dequantizer)."""
    return dequantize(w.contiguous(), ggml_type, (*w.shape[:-1], k))


def dense_native(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A whole tensor's stored bytes [nbytes] uint8 -> fp32 `shape` by the native decoder, bit for bit the
    reference's (tests/kernels/test_kernels.py): the loader's decoder for the tensors it holds dense (kv_b_proj
    rebuilt from attn_k_b / attn_v_b, norms, the router). None for a type the build does not decode and for the
    float types (F32 / F16 / BF16: the reference's view or cast is as fast)."""
    t = GGML_TYPES.get(ggml_type)
    if t is None or t.block_size == 1 or not native.type_kernels(ggml_type) & 1 or not shape:
        return None
    k = shape[-1]
    rows = raw.numel() // (k // t.block_size * t.type_size)
    return native.dequantize(ggml_type, raw.contiguous().view(rows, -1), k).view(shape)


def linear_torch(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, int8: bool = False) -> torch.Tensor:
    """The reference: y [M, N] fp32 = x [M, K] @ dequantize(w [N, R])^T (int8 is the native kernels' only)."""
    return F.linear(x.float(), dense(w, ggml_type, k))


def linear_native(
    x: torch.Tensor,
    w: torch.Tensor,
    ggml_type: int,
    k: int,
    int8: bool = False,
    bf16: int = 0,
    tiles: bool = False,
) -> torch.Tensor:
    """linear_torch by the C kernels: up to GEMV_ROWS rows decode-and-dot (int8: the weight types native.takes_int8
    names take int8 activations, engine option activations: not exact); with tiles (this weight's int8 products run
    on the AMX-INT8 tiles, the holder's choice at load: native.takes_tiles) up to tile_rows(type) rows the same int8
    call (the tiles, the same bits as the decode kernels'); more rows: the weight decoded natively (the reference's
    values bit for bit), then the BLAS GEMM in fp32 (up to PANEL_ROWS rows where the build has AVX-512: on decoded
    panels, kernels/panels.py), or with bf16 (this weight takes bf16 prefill, the holder's choice at load) the bf16
    GEMM of bf16_prefill.linear."""
    x = x.float().contiguous()
    path = linear_path(x.shape[0], ggml_type, int8, bf16, tiles)
    if path == "int16":
        return int16_prefill.linear(x, w, ggml_type, k)
    if path == "gemm":
        return native.gemm(ggml_type, x, w, k, int8=int8)
    if path == "bf16_pairs":
        return bf16_pairs.linear(x, w, k)
    if path == "panels":
        return panels.linear(x, w, ggml_type, k)
    return _decoded_linear(x, w, ggml_type, k, bool(bf16))


# linear_native's products whose work on the weight per call is a pass over its blocks in place (int8 codes, int16
# products, Q8_0's bf16 pairs, the fp32 decoded panels: a panel's or a 32-row block's codes are unpacked, converted
# or decoded into a small per-thread buffer that serves every row of the call), so that cutting a call's rows into
# parts adds little: "decoded" decodes the whole weight per call (to fp32 / bf16 for a GEMM)
IN_PLACE_PATHS = ("int16", "gemm", "bf16_pairs", "panels")


def linear_path(rows: int, ggml_type: int, int8: bool | int = False, bf16: int = 0, tiles: bool = False) -> str:
    """Which product linear_native runs for `rows` activation rows of a weight with these settings: "int16"
    (int16 activations: decode rows where the setting gives them to the type, or bf16_prefill.INT16),
    "gemm" (native.gemm: the decode kernels, or int8 on the tiles / VNNI panels up to tile_rows), "bf16_pairs" (Q8_0
    on the AMX-BF16 tiles), "panels" (fp32 on decoded panels) or "decoded" (decode-then-GEMM)."""
    # decode-sized calls decide without asking the library (tile_rows >= GEMV_ROWS wherever it applies)
    # decode: int16 activations where the setting gives them to this type (as its prefill under prefill_matmul auto)
    if rows <= GEMV_ROWS and int16_prefill.takes_rest(ggml_type, int8):
        return "int16"
    if rows <= GEMV_ROWS or (tiles and rows <= tile_rows(ggml_type)):
        return "gemm"
    if bf16 == bf16_prefill.BF16_PAIRS:  # Q8_0 on the AMX-BF16 tiles, split into bf16 pairs (fp32 grade)
        return "bf16_pairs"
    if bf16 == bf16_prefill.INT16:  # int16 activations on AVX512-VNNI (fp32 grade): the blocks read in place
        return "int16"
    if not bf16 and rows <= PANEL_ROWS and panels.available():  # fp32, few rows: decoded panels
        return "panels"
    return "decoded"


def _decoded_linear(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, bf16: bool) -> torch.Tensor:
    """Decode-then-GEMM of a ggml-block weight (decoded_linear): bf16 decoded straight to bf16 (one pass; the values
    of dequantize, rounded) and bf16 GEMMs, else fp32 and the BLAS GEMM."""
    decode = native.dequantize_bf16 if bf16 else native.dequantize
    return decoded_linear(x, w.shape[0], k, lambda n0, n1, out: decode(ggml_type, w[n0:n1], k, out=out), bf16)


def decoded_linear(
    x: torch.Tensor,
    n: int,
    k: int,
    decode: Callable[[int, int, torch.Tensor | None], torch.Tensor],
    bf16: bool = False,
    bias: torch.Tensor | None = None,
    multiple: int = 16,
) -> torch.Tensor:
    """y [M, N] fp32 = x W^T (+ bias) with W decoded in parts of about DENSE_BYTES of rows into one buffer, each
    part's GEMM writing its columns of y (the same products: each output column is one weight row's, whichever part
    it falls in; a BLAS may sum a column in another order for another N, as MKL's kernels on an AMD EPYC do: then
    within the fp32 summation bound of one call). decode(n0, n1, out) -> W's rows n0..n1 decoded (fp32, or bf16 with bf16: then bf16 GEMMs,
    bf16_prefill.linear), written into out [n1 - n0, K] when given; parts start at multiples of `multiple` rows (a
    scale grid's block rows)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    per = chunk_rows(n, k * dtype.itemsize, DENSE_BYTES, multiple)
    if per >= n:
        dense = decode(0, n, None)
        return bf16_prefill.linear(x, dense) if bf16 else F.linear(x, dense, bias)
    m = x.shape[0]
    y = x.new_empty(m, n)
    buf = torch.empty(per, k, dtype=dtype)
    left = bf16_prefill.padded_rows(x) if bf16 else x
    for n0 in range(0, n, per):
        n1 = min(n, n0 + per)
        part_bias = bias[n0:n1] if bias is not None else None
        y[:, n0:n1] = F.linear(left, decode(n0, n1, buf[: n1 - n0]), part_bias)[:m]
    return y


def chunk_rows(n: int, row_bytes: int, cap: int, multiple: int = 16) -> int:
    """Rows per part when n rows of row_bytes each are cut into parts of about `cap` bytes: equal parts (the last
    one shorter) rounded up to a multiple of `multiple` rows, at least that."""
    parts = max(1, -(-n * row_bytes // cap))
    per = -(-n // parts)
    return max(multiple, -(-per // multiple) * multiple)


Stacks = torch.Tensor | tuple[torch.Tensor, ...]  # an expert weight, or its parts whose rows follow one another


def _parts(w: Stacks) -> tuple[torch.Tensor, ...]:
    return w if isinstance(w, tuple) else (w,)


def expert_linear_torch(
    xs: torch.Tensor,
    w: Stacks,
    ggml_type: int,
    k: int,
    experts: torch.Tensor,
    offs: torch.Tensor,
    int8: bool = False,
    bf16: int = 0,
    tiles: bool = False,
    rows_per_expert: float | None = None,
) -> torch.Tensor:
    """The reference: ys [P, N] fp32, rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s weight
    (exact: int8, bf16, tiles and rows_per_expert are the native kernels' only; the kernel plan sets them only on
    the native path)."""
    dense_w = torch.cat([dense(p[experts], ggml_type, k) for p in _parts(w)], dim=1)
    return torch._grouped_mm(xs.float(), dense_w.transpose(1, 2), offs=offs)


def expert_linear_native(
    xs: torch.Tensor,
    w: Stacks,
    ggml_type: int,
    k: int,
    experts: torch.Tensor,
    offs: torch.Tensor,
    int8: bool = False,
    bf16: int = 0,
    tiles: bool = False,
    rows_per_expert: float | None = None,
) -> torch.Tensor:
    """expert_linear_torch by the C kernels: up to GEMV_ROWS rows per active expert (with tiles: expert_int8_rows, the
    tiles' rows as linear_native or, without tiles, the row kernels'; the mean over the active experts) the grouped decode-and-dot (int8: as linear_native, every part
    in one call, its outputs side by side, the C call taking each group of 8+ rows to the tiles and the rest to the
    row kernels; float: one call per part); more: the active experts decoded natively, then grouped GEMMs
    (_decoded_grouped; bf16: in bf16, as linear_native). rows_per_expert: the mean to decide by
    when these experts are a chunk of a step's (GGUFExperts._grouped: the step's mean, so every chunk takes the
    path the whole step would), else this call's."""
    xs = xs.float().contiguous()
    mean = xs.shape[0] / max(1, experts.shape[0]) if rows_per_expert is None else rows_per_expert
    if (mean <= GEMV_ROWS or (tiles and mean <= ROW_KERNEL_ROWS)) and int16_prefill.takes_rest(ggml_type, int8):
        # decode, as linear_native; a prompt's experts where the holder took the int16 row products
        # (int16_prefill.takes_expert_rows: no int16 panels here)
        return int16_prefill.grouped(xs, _parts(w), ggml_type, k, experts.to(torch.int64).contiguous(), offs)
    if mean <= GEMV_ROWS or (tiles and mean <= expert_int8_rows(ggml_type)):
        starts = F.pad(offs.to(torch.int64), (1, 0))
        experts = experts.to(torch.int64).contiguous()
        return native.grouped_gemm(ggml_type, xs, w, k, experts, starts, int8=int8)
    return _decoded_grouped(xs, _parts(w), ggml_type, k, experts.to(torch.int64).contiguous(), offs, bf16)


ExpertProduct = Callable[..., torch.Tensor]  # expert_linear_native / expert_linear_torch

# implementation name -> function: what a holder binds at load (the KernelPlan's choice), and what the functions
# below look up for callers that name the kernel
LINEAR = {"native": linear_native, "torch": linear_torch}
EXPERT_LINEAR = {"native": expert_linear_native, "torch": expert_linear_torch}


def linear(
    x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, kernel: str = "torch", int8: bool = False
) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequantize(w [N, R])^T by the named implementation (LINEAR)."""
    return LINEAR[kernel](x, w, ggml_type, k, int8)


def expert_linear(
    xs: torch.Tensor,
    w: torch.Tensor,
    ggml_type: int,
    k: int,
    experts: torch.Tensor,
    offs: torch.Tensor,
    kernel: str = "torch",
    int8: bool = False,
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s weight (EXPERT_LINEAR)."""
    return EXPERT_LINEAR[kernel](xs, w, ggml_type, k, experts, offs, int8)


def _decoded_grouped(
    xs: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    ggml_type: int,
    k: int,
    experts: torch.Tensor,
    offs: torch.Tensor,
    bf16: int = 0,
) -> torch.Tensor:
    """Many rows per expert (prefill): the experts decoded natively, then grouped GEMMs, for at most
    EXPERT_BYTES of decoded weights at a time: a DeepSeek-V3 layer's 256 gate_up matrices would be
    15 GB in fp32 at once (the standard benchmark model's 128 MB; chunks were measured no slower there, see
    EXPERT_BYTES).
    Each expert's rows meet that expert alone, so the chunks give the products of one call. Every chunk is decoded
    into the same buffer (allocated once per call: one block of the allocator's instead of one per chunk between
    the GEMMs' temporaries). bf16: the experts decoded straight to bf16 (twice the experts per chunk) and each
    chunk's GEMMs in bf16 (bf16_prefill.grouped). fp32 where the build has AVX-512: none of that, the products on
    decoded panels (kernels/panels.py; a 2-core AVX-512 EPYC, ds-real's Q8_0 gate stack: 25 -> 74 GMAC/s at 48 rows
    per expert, 46 -> 69 at 128, level at 512)."""
    if bf16 == bf16_prefill.BF16_PAIRS:  # Q8_0 on the AMX-BF16 tiles: the blocks read in place, nothing decoded here
        return bf16_pairs.grouped(xs, parts, k, experts, offs)
    if bf16 == bf16_prefill.INT16:  # int16 activations (AVX512-VNNI): 16-row panels, no expert whole in memory
        return int16_prefill.grouped(xs, parts, ggml_type, k, experts, offs)
    if not bf16 and panels.available():  # fp32 on decoded panels (AVX-512 builds): no decoded experts in memory
        return panels.grouped(xs, parts, ggml_type, k, experts, F.pad(offs.to(torch.int64), (1, 0)))
    a, n = experts.shape[0], sum(p.shape[1] for p in parts)
    dtype, gemm = (torch.bfloat16, bf16_prefill.grouped) if bf16 else (torch.float32, _grouped_fp32)
    per = max(1, EXPERT_BYTES // (n * k * dtype.itemsize))
    buf = torch.empty(min(a, per), n, k, dtype=dtype)
    if a <= per:
        return gemm(xs, _decode_parts(parts, ggml_type, experts, k, buf), offs)
    ys = xs.new_empty(xs.shape[0], n)
    ends = [0, *offs.tolist()]  # one host copy of A ends per projection (prefill)
    for c0 in range(0, a, per):
        c1 = min(a, c0 + per)
        lo, hi = ends[c0], ends[c1]
        if hi == lo:
            continue
        dense_w = _decode_parts(parts, ggml_type, experts[c0:c1], k, buf[: c1 - c0])
        ys[lo:hi] = gemm(xs[lo:hi], dense_w, offs[c0:c1] - lo)
    return ys


def _decode_parts(
    parts: tuple[torch.Tensor, ...], ggml_type: int, experts: torch.Tensor, k: int, out: torch.Tensor
) -> torch.Tensor:
    """out [A, N, K] (fp32, or bf16: the same values rounded), filled with the experts' rows of every part, each
    part decoded where it lies into its rows of the buffer (gate rows, then up rows: the fused stack's decoded
    values, without a fused copy of the blocks)."""
    row = 0
    for p in parts:
        native.dequantize_experts(ggml_type, p, experts, k, out.dtype, out=out[:, row : row + p.shape[1]])
        row += p.shape[1]
    return out


def _grouped_fp32(xs: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a times ws[a]^T ([A, N, K] decoded), the exact path's fp32 grouped GEMM."""
    return torch._grouped_mm(xs, ws.transpose(1, 2), offs=offs)


def moe_experts(
    x: torch.Tensor,
    topk_w: torch.Tensor,
    topk_idx: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    type_gate_up: int,
    down: torch.Tensor,
    type_down: int,
    int8: bool | int = False,
    limit: float = math.inf,
) -> torch.Tensor:
    """[T, D] fp32 = sum_j topk_w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_idx[t, j], in one
    native call (the few-pairs case of GGUFExperts; its sorted grouped path is the reference). gate / up
    [E, I, R]: two stacks, wherever they lie. int8: the holder's activation setting: int8 activations when both
    types take them under it (native.takes_int8), int16 when both take those at every row count
    (int16_prefill.takes_rest: the grouped products' arithmetic), else fp32; a mixed pair of types is the caller's
    to send to the grouped path. limit: gate and up clamped first (DeepSeek-V4's swiglu_limit:
    models/deepseek_v4/moe.clamped_swiglu); inf: none."""
    setting = int8
    int8 = native.takes_int8(type_gate_up, setting) and native.takes_int8(type_down, setting)
    int16 = int16_prefill.takes_rest(type_gate_up, setting) and int16_prefill.takes_rest(type_down, setting)
    return native.moe_experts(
        type_gate_up,
        type_down,
        x.float().contiguous(),
        gate,
        up,
        down,
        topk_idx.to(torch.int64).contiguous(),
        topk_w.float().contiguous(),
        int8,
        limit,
        int16,
    )

"""Prefill products with int16 activations on AVX512-VNNI (csrc/x86/int16_prefill.c) for the 32-value block types
whose value is a block scale times an integer code (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4), where the process has no
AMX-BF16 tiles: each activation an int16 code per 32-value block with an fp32 scale, the weight's codes widened to
int16 once per call into 16-row panels, the integer sums exact (vpdpwssd: 32 products an instruction, twice the fp32
FMA units' rate), each block's two scales applied in fp32.

Notation (u = 2^-24)
  x   [M, K]   fp32 activations (M > ggml.GEMV_ROWS: the many-rows path)
  a_b          max |x_k| over a 32-value block b of a row; d_x = fl(a_b / 32767), c_k = rne(fl(x_k fl(32767 / a_b)))
               (a_b < 2^-100: d_x = 0, c = 0; a non-finite value: d_x = NaN, the row NaN)
               |x_k - d_x c_k| <= e_k = d_x / 2 + 3.01 u |x_k|     (about 2^-16 a_b)
  W   [N, R]   uint8 blocks; w = d q (the block's scale times its integer code, |q| <= 128: the reference's values)
  y   [M, N]   fp32 = sum_b fl(d d_x) S_b, S_b = sum_{k in b} q c exact in int32, in block order
               |y - x W^T| <= sum_k |w_k| e_k + (K / 32 + 2) u (1 + 2^-20) sum_k |w_k| (|x_k| + e_k)
               (tests/kernels/test_int16_prefill.py holds it to that against fp64; a row's bits do not depend on the
               batch or the threads)
Why: the rule of docs/FORMATS.md (the error added must stay within half the file's own) leaves Q8_0 out of plain
bf16 and int8 activations (each about as coarse as Q8_0's own step); 16-bit codes add ~2^-16 of a block's largest
activation per value, the bf16 pairs' grade, at twice fp32's multiply rate. The 4-5 bit types took plain bf16
(within their rule) by decode-then-GEMM, which decodes the whole weight per call: these products read the blocks in
place, 1.5-13x faster at 17-48 rows, 1.06-1.9x at 128, level at 512 (0.90-1.17x; a 2-core AVX-512 EPYC,
benchmarks/block32_prefill.py), and ~150x finer (bf16_prefill.takes_bf16 gives them INT16 where available).
"""

from __future__ import annotations

import torch

from mlaserve.kernels import native, stack_parts

NO_UNITS = "the build's CPU has neither AVX512-VNNI nor AVX2"


def takes(type_id: int) -> bool:
    """Whether this process runs products of many rows (a prompt's) of this ggml type so: a 32-value block type, on
    AVX512-VNNI's panels. An AVX2 build runs the type's products a few rows a pass (takes_rows): a prompt's dense
    products stay fp32 there, where BLAS keeps the FMA units busy and a widening per value and row would not (its
    routed experts' few rows each may take them: takes_expert_rows)."""
    lib = native.library()
    return lib is not None and lib.mls_int16_panels(type_id) == 1


def takes_rows(type_id: int) -> bool:
    """Whether this process runs this type's products with int16 activations at decode row counts (the kernels take
    any row count; csrc/x86/int16_rows.c on AVX2, int16_prefill.c on AVX512-VNNI: the same bits)."""
    lib = native.library()
    return lib is not None and lib.mls_int16_takes(type_id) == 1


def takes_rest(type_id: int, setting: bool | int) -> bool:
    """Whether a product of this type takes int16 activations at every decode row count under an activation setting
    (the holders' .int8): the setting has native.INT16_REST, its int8 cap leaves the type in fp32, and this process
    runs the type's products here. The same kernels at 1 row and at 16, so a request's result does not depend on its
    batch; where the prompt's products take them too (takes), its decode rows are rounded as its prompt's."""
    return (
        setting is not True
        and bool(int(setting) & native.INT16_REST)
        and not native.takes_int8(type_id, setting)
        and takes_rows(type_id)
    )


def takes_expert_rows(type_id: int, setting: bool | int) -> bool:
    """Whether a routed expert's prefill products of this type take the int16 products up to ggml.ROW_KERNEL_ROWS rows
    per active expert under the int8 prefill settings (prefill_matmul "int8" / "int8_float"): the type takes them at
    decode (takes_rest) and this process has no int16 panels for a prompt's products (takes: an AVX2 build), where
    they read the experts' blocks in place, QW_FEW rows a pass, instead of each active expert decoded for an fp32
    grouped GEMM. Measured on a 2-core AVX2-only EPYC (64 Q8_0 experts of 1536 x 2048, 2 threads): 16 / 32 / 64 / 128
    rows an expert 184 / 326 / 403 / 624 ms -> 69 / 116 / 221 / 520 ms."""
    return takes_rest(type_id, setting) and not takes(type_id)


def tile_rows(type_id: int) -> int:
    """The activation rows from which this process runs the type's products on the AMX-INT8 tiles, each int16 code as
    its high and low byte (the same bits as the VNNI kernels: csrc/x86/amx_int16.c); 0 where it never does."""
    lib = native.library()
    return int(lib.mls_int16_tile_rows(type_id)) if lib is not None else 0


def detail() -> str:
    """In words, for the kernel plan: the unit, or why not."""
    lib = native.library()
    if lib is None or not lib.mls_int16_takes(8):
        return f"none: {NO_UNITS}"
    if not lib.mls_int16_panels(8):
        return "avx2 int16 pair products (vpmaddwd), a few rows a pass: no panels for a prompt's products"
    rows = tile_rows(8)
    return "avx512-vnni int16 dot products" + (f"; on the amx-int8 tiles from {rows} rows" if rows else "")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native int16-activation {what} failed (rc {rc}: {detail()})")


def linear(x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] W^T for rows w [N, R] (contiguous) of a type this process takes."""
    x = x.float().contiguous()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = native.library().mls_int16_gemm(
        ggml_type, x.data_ptr(), m, k, k, w.data_ptr(), n, w.shape[-1], y.data_ptr(), n, torch.get_num_threads()
    )
    _check(rc, "product")
    return y


def grouped(
    xs: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    ggml_type: int,
    k: int,
    experts: torch.Tensor,
    offs: torch.Tensor,
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s rows of every part (stacks
    [E, N_i, R] whose rows follow one another: gate then up), each part written into its columns of ys."""
    starts = torch.nn.functional.pad(offs.to(torch.int64), (1, 0))
    lib = native.library()
    return stack_parts.grouped(
        xs, parts, k, experts, starts, lambda *a: lib.mls_int16_grouped(ggml_type, *a),
        lambda rc: _check(rc, "grouped product"),
    )  # fmt: skip

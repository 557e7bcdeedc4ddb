"""Prefill products of Q8_0 weights with int16 activations on AVX512-VNNI (csrc/x86/q8_0_int16.c), where the process
has no AMX-BF16 tiles for kernels/bf16_pairs.py: each activation an int16 code per 32-value block with an fp32 scale,
the weight's int8 codes widened to int16 once per call, the integer sums exact (vpdpwssd: 32 products an
instruction, twice the fp32 FMA units' rate), each block's two scales applied in fp32.

Notation (u = 2^-24)
  x   [M, K]   fp32 activations (M > ggml.GEMV_ROWS: the many-rows path)
  a_b          max |x_k| over a 32-value block b of a row; d_x = fl(a_b / 32767), c_k = rne(fl(x_k fl(32767 / a_b)))
               (a_b < 2^-100: d_x = 0, c = 0; a non-finite value: d_x = NaN, the row NaN)
               |x_k - d_x c_k| <= e_k = d_x / 2 + 3.01 u |x_k|     (about 2^-16 a_b)
  W   [N, R]   uint8 Q8_0 blocks; w = d q (fp16 d per 32 values times int8 q: the reference's values)
  y   [M, N]   fp32 = sum_b fl(d d_x) S_b, S_b = sum_{k in b} q c exact in int32, in block order
               |y - x W^T| <= sum_k |w_k| e_k + (K / 32 + 2) u (1 + 2^-20) sum_k |w_k| (|x_k| + e_k)
               (tests/kernels/test_q8_0_int16.py holds it to that against fp64; a row's bits do not depend on the
               batch or the threads)
Why: the rule of docs/FORMATS.md (the error added must stay within half the file's own) leaves Q8_0 out of plain
bf16 and int8 activations (each about as coarse as Q8_0's own step); 16-bit codes add ~2^-16 of a block's largest
activation per value, the bf16 pairs' grade, at twice fp32's multiply rate.
"""

from __future__ import annotations

import torch

from mlaserve.kernels import native

Q8_0 = 8  # ggml's type id: the one weight type these products take
NO_UNITS = "the build's CPU has no AVX512-VNNI"


def available() -> bool:
    """Whether this process runs them: the build has AVX512-VNNI (-march=native)."""
    lib = native.library()
    return lib is not None and lib.mls_q8_0_int16_units() == 1


def detail() -> str:
    """In words, for the kernel plan: the unit, or why not."""
    return "avx512-vnni int16 dot products" if available() else f"no int16 products: {NO_UNITS}"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native Q8_0 int16 {what} failed (rc {rc}: {detail()})")


def linear(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] W^T for Q8_0 rows w [N, R] (contiguous)."""
    x = x.float().contiguous()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = native.library().mls_q8_0_int16(
        x.data_ptr(), m, k, k, w.data_ptr(), n, w.shape[-1], y.data_ptr(), n, torch.get_num_threads()
    )
    _check(rc, "product")
    return y


def grouped(
    xs: torch.Tensor, parts: tuple[torch.Tensor, ...], k: int, experts: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """ys [P, N] fp32: rows of group a (xs[offs[a-1]:offs[a]]) times expert experts[a]'s rows of every part (stacks
    [E, N_i, R] whose rows follow one another: gate then up), each part written into its columns of ys."""
    xs = xs.float().contiguous()
    n = sum(p.shape[1] for p in parts)
    ys = torch.empty(xs.shape[0], n, dtype=torch.float32)
    starts = torch.nn.functional.pad(offs.to(torch.int64), (1, 0)).contiguous()
    experts = experts.to(torch.int64).contiguous()
    lib, col = native.library(), 0
    for p in parts:
        assert p.stride(2) == 1 and p.stride(1) == p.shape[2], "expert stacks: rows of whole blocks, one after another"
        rc = lib.mls_q8_0_int16_grouped(
            xs.data_ptr(), k, p.data_ptr(), p.shape[1], p.shape[2], p.stride(0), experts.data_ptr(),
            starts.data_ptr(), experts.shape[0], ys[:, col:].data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        _check(rc, "grouped product")
        col += p.shape[1]
    return ys

"""The native block kernels' bindings: what each weight type's products take (int8, int16, the AMX tiles, the
VNNI panels), and the products, decoders and MoE calls over the library that native_build.py builds and loads.
Every product here has a pure-torch reference path that the tests hold it to; without the library (no compiler,
kernels="torch") the callers take that path."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from mlaserve.kernels.native_build import isa, library, status  # noqa: F401 (the bindings' callers reach the library here)

FP8_E4M3 = 1000  # mls.h MLS_FP8_E4M3: float8 e4m3 with block scales
FP4_E2M1 = 1001  # mls.h MLS_FP4_E2M1: packed e2m1 codes (two per byte) with per-row group scales
INT4_PACKED = 1002  # mls.h MLS_INT4_PACKED: compressed-tensors pack-quantized int4 words with per-row group scales
# the weight types the int8-activation kernels take -> their bits per value (what an int8 setting caps: takes_int8)
# (csrc/types.c `bits`; tests/kernels/test_int8_more.py holds the two to each other)
Q8_ACTIVATION_BITS = {
    # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: per-32 activation blocks. Q5_0 / Q5_1 in the 8-bit class (exact under
    # activations="auto", int8 only under "int8"): on ds32's Q4_K_M fixture their int8 products move the logits
    # 0.59x the file's own error, over the rule's 1/2 (tests/gguf/test_gguf_int8_default.py); csrc/types.c the same
    **{2: 4, 3: 4, 6: 8, 7: 8, 8: 8, 20: 4},
    **{12: 4, 13: 5, 14: 6, 23: 4},  # Q4_K, Q5_K, Q6_K, IQ4_XS: q8_K's 256-value super-blocks
    **{16: 2, 17: 2, 22: 2, 18: 3, 21: 3, 19: 1, 29: 1},  # IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: q8_K
}
Q8_ACTIVATION_TYPES = frozenset(Q8_ACTIVATION_BITS)
INT8_ALL = 8  # an int8 setting under which every type with an int8 kernel takes int8 activations (Q8_0 too)
# mls.h MLS_ACT_INT16: in an activation setting (the holders' .int8, the C structs' int8 field), beside the int8 cap in
# its low byte: the 32-value block types the cap leaves in fp32 take int16 activations (kernels/int16_prefill.py)
INT16_REST = 0x100


def int8_isa() -> str:
    """The int8 dot products' instructions ("avx512vnni", "avxvnni", "avx2", "scalar"), for the kernel plan."""
    lib = library()
    return ctypes.string_at(lib.mls_int8_isa()).decode() if lib is not None else ""


# csrc/x86/amx.c amx_type: the weights whose int8 products take the tiles (Q4_K, Q6_K: x86/amx_planes.c's digit
# planes; the rest: x86/amx_units.c's scaled 32-value units)
INT8_TILE_TYPES = {
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
}
INT8_TILE_ROWS = 8  # csrc/x86/amx.c AMX_MIN_ROWS: the most activation rows a type needs for them (tile_rows)
NO_TILES_IN_BUILD = "the build's CPU has no AMX-INT8"


def int8_tiles(names: tuple[str, ...] = tuple(INT8_TILE_TYPES.values())) -> str:
    """Whether int8 products of many rows run on AMX-INT8 tiles (csrc/x86/amx.c), in words for the kernel plan:
    "amx-int8 tiles for Q4_K, Q6_K at >= 8 rows" (names: the types to name, of INT8_TILE_TYPES), or why not
    ("no amx-int8 tiles: ..."); "" without the library. Decided once per process: the build's target
    (-march=native) and the kernel's answer to the tile request."""
    lib = library()
    if lib is None:
        return ""
    rc = lib.mls_int8_tiles()
    if rc == 1:
        ids, by_rows = {v: k for k, v in INT8_TILE_TYPES.items()}, {}
        for name in names:
            by_rows.setdefault(tile_rows(ids[name]), []).append(name)
        return "amx-int8 tiles for " + "; ".join(f"{', '.join(n)} at >= {r} rows" for r, n in sorted(by_rows.items()))
    if rc == 0:
        return f"no amx-int8 tiles: {NO_TILES_IN_BUILD}"
    return f"no amx-int8 tiles: the kernel refused the tile state (arch_prctl errno {-rc})"


def tile_rows(type_id: int) -> int:
    """The activation rows from which an int8 product on this type takes the tiles here (csrc/x86/amx.c
    amx_min_rows); 0 when it never does."""
    lib = library()
    return int(lib.mls_int8_tile_rows(type_id)) if lib is not None else 0


def tiles_granted() -> bool:
    """Whether this process's library runs int8 products on AMX-INT8 tiles (the build has them and the kernel
    granted the tile state; asked once per process, csrc/x86/amx.c amx_permission)."""
    lib = library()
    return lib is not None and lib.mls_int8_tiles() == 1


def takes_tiles(type_id: int, int8: bool | int) -> bool:
    """Whether a product with a weight of this type runs on the AMX-INT8 tiles from INT8_TILE_ROWS rows on under the
    int8 setting: the type takes int8 activations there (takes_int8), has a tile kernel (INT8_TILE_TYPES) and the
    process has the tiles (tiles_granted)."""
    return takes_int8(type_id, int8) and type_id in INT8_TILE_TYPES and tiles_granted()


# csrc/x86/vnni_panels.c vnni_type: the weights whose int8 products of many rows can run on unpacked weight panels
# where the process has no AMX-INT8 tiles (the row kernels' bits): the tiles' types, the K-quants and the i-quants
# with q8_K activations (their signed codes plus an offset). With AVX512-VNNI all of them on 16-row panels; with AVX2
# only (csrc/x86/avx2_panels.c) the same types on 8-row panels (panel_rows says which here).
INT8_PANEL_TYPES = dict(INT8_TILE_TYPES)


def panel_rows(type_id: int) -> int:
    """The activation rows from which an int8 product on this type runs on the int8 panels in this process
    (csrc/x86/vnni_panels.c with AVX512-VNNI, x86/avx2_panels.c without; no AMX-INT8 tiles granted); 0 when it
    never does."""
    lib = library()
    return int(lib.mls_int8_panel_rows(type_id)) if lib is not None else 0


def panels_isa() -> str:
    """The int8 panels' instructions in this build: "avx512-vnni", "avx2", or "" without panels."""
    lib = library()
    return ctypes.string_at(lib.mls_int8_panels_isa()).decode() if lib is not None else ""


def takes_panels(type_id: int, int8: bool | int) -> bool:
    """Whether this weight's int8 products of many rows run on the int8 panels here: it takes int8 activations
    (takes_int8) and the process runs its type on them (panel_rows)."""
    return takes_int8(type_id, int8) and panel_rows(type_id) > 0


def int8_panels(names: tuple[str, ...] = tuple(INT8_PANEL_TYPES.values())) -> str:
    """The int8 panels in words for the kernel plan: "avx512-vnni panels for Q4_K, Q5_K at >= 12 rows; Q6_K at >= 16
    rows" ("avx2 panels for ..." without AVX512-VNNI; names: the types to name), or "" where none of them runs there."""
    ids, by_rows = {v: k for k, v in INT8_PANEL_TYPES.items()}, {}
    for name in names:
        if panel_rows(ids[name]):
            by_rows.setdefault(panel_rows(ids[name]), []).append(name)
    if not by_rows:
        return ""
    return f"{panels_isa()} panels for " + "; ".join(
        f"{', '.join(n)} at >= {r} rows" for r, n in sorted(by_rows.items())
    )


# The types whose routed-expert prefill products stay on the int8 row kernels where the process has no tiles: the
# super-block kernels on q8_K activations (x86/avx2.c q8k_*: integer sums over 256 values, one float step per
# super-block). Measured on the 2-core AVX-512 EPYC without AMX of 2026-12-06, faster than the experts decoded for a
# bf16 GEMM up to ~128 rows per expert: Q4_K, Q6_K, the IQ mix's IQ2_XXS / IQ3_XXS / IQ4_XS (kernels/ggml.py
# ROW_KERNEL_ROWS); Q5_K and the other sign-grid types run the same kernels. The 32-value block types (Q4_0, Q5_0,
# IQ4_NL, ...: a float step per 32 values) were slower there (the standard Q4_0 file's 512-token prefill 535-568 ->
# 462-468 tok/s), and IQ1_S / IQ1_M (their own operand path) were not measured: those keep bf16.
ROW_KERNEL_TYPES = frozenset(
    t
    for t, n in INT8_TILE_TYPES.items()
    if n in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
)


def takes_expert_int8(type_id: int, int8: bool | int) -> bool:
    """Whether routed-expert products with a weight of this type stay int8 in prefill under the int8 prefill setting
    (up to ggml.expert_int8_rows rows per expert): on the AMX-INT8 tiles (takes_tiles), or, where the process has no
    tiles, on the int8 row kernels for the ROW_KERNEL_TYPES that take int8 activations."""
    rows = type_id in ROW_KERNEL_TYPES and takes_int8(type_id, int8) and not tiles_granted()
    return takes_tiles(type_id, int8) or rows


def int8_cap(int8: bool | int) -> int:
    """An activation setting's int8 cap: 0 none; else the widest weight (bits per value) whose products take int8
    activations. True (the holders' and tests' plain switch) means every type (INT8_ALL)."""
    return INT8_ALL if int8 is True else int(int8) & 0xFF


def act_setting(int8: bool | int) -> int:
    """An activation setting as the C structs take it (mls_layer_t.int8): the int8 cap and the INT16_REST flag."""
    return INT8_ALL if int8 is True else int(int8) & (0xFF | INT16_REST)


def takes_int8(type_id: int, int8: bool | int) -> bool:
    """Whether a product with a weight of this type takes int8 activations under the setting int8."""
    bits = Q8_ACTIVATION_BITS.get(type_id)
    return bits is not None and bits <= int8_cap(int8)


def quantize_act(type_id: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K] int8, d [M, K / 32] fp32 slots): the activations the type's int8 kernel reads
    (csrc/int8.c; for the K-quants each super-block's 8 slots hold common.h's q8k_meta). For the tests."""
    lib = library()
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    rc = lib.mls_quantize_act(type_id, x.data_ptr(), m, k, k, q.data_ptr(), d.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native quantize_act refused type {type_id} with {k} columns (rc {rc})")
    return q, d


def type_kernels(type_id: int) -> int:
    """The kernels this build has for a weight type (csrc/types.c mls_type_info): bit 0 decode, bit 1 fused
    decode-and-dot, bit 2 int8 activations; 0 without the library or for a type it does not decode."""
    lib = library()
    v = (ctypes.c_int64 * 3)()
    if lib is None or lib.mls_type_info(type_id, ctypes.byref(v, 0), ctypes.byref(v, 8), ctypes.byref(v, 16)):
        return 0
    return int(v[2])


def product_detail(type_id: int, name: str) -> str:
    """What a product on a type runs in this build, for the kernel plan: "avx512 IQ2_XS decode-and-dot" (the
    fused kernel), or "scalar IQ2_XS decode, then dot" (each row decoded into a buffer, then dotted)."""
    how = "decode-and-dot" if type_kernels(type_id) & 2 else "decode, then dot"
    return f"{isa()} {name} {how}"


@dataclass(frozen=True)
class ScaleGrid:
    """Where the fp32 scales of an fp8 / fp4 weight are (see csrc/gemv.c fp8_scales): blocks of bn rows x
    bk columns, kb per row of blocks, rows in parts of part_rows with a grid each; None for ggml types."""

    scale: torch.Tensor  # fp32, contiguous
    bn: int
    kb: int
    bk: int
    part_rows: int


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _grid_args(grid: ScaleGrid | None, n: int) -> tuple:
    if grid is None:
        return None, 1, 1, 1, n
    return _ptr(grid.scale), grid.bn, grid.kb, grid.bk, grid.part_rows


def gemm(
    type_id: int, x: torch.Tensor, w: torch.Tensor, k: int, grid: ScaleGrid | None = None, int8: bool = False
) -> torch.Tensor:
    """x [M, K] fp32 contiguous, w [N, R] uint8 contiguous -> y [M, N] fp32. int8: int8 activations
    (csrc/int8.c, not exact) where the type takes them under that setting (takes_int8)."""
    lib = library()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if takes_int8(type_id, int8):
        rc = lib.mls_gemm_q8(
            type_id, x.data_ptr(), m, k, k, w.data_ptr(), n, w.shape[-1], y.data_ptr(), n, torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"native int8-activation gemm refused type {type_id} (rc {rc})")
        return y
    rc = lib.mls_gemm(
        type_id,
        x.data_ptr(),
        m,
        k,
        k,
        w.data_ptr(),
        n,
        w.shape[-1],
        *_grid_args(grid, n),
        y.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native gemm refused type {type_id} (rc {rc})")
    return y


def _alike(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether stacks share one shape and layout, so that one call may walk them all by the first one's sizes."""
    return all(p.shape == parts[0].shape and p.stride() == parts[0].stride() for p in parts)


def grouped_gemm(
    type_id: int,
    xs: torch.Tensor,
    w: torch.Tensor | tuple[torch.Tensor, ...],
    k: int,
    experts: torch.Tensor,
    starts: torch.Tensor,
    grid: ScaleGrid | None = None,
    int8: bool = False,
) -> torch.Tensor:
    """xs [P, K] fp32 sorted by expert, w [E, N, R] uint8 (or a projection's parts, each [E, N, R] alike: their
    outputs side by side), experts [A] int64, starts [A+1] int64 -> [P, N * parts]. int8: as gemm (the parts in one
    call: one quantization of xs, written in place)."""
    parts = w if isinstance(w, tuple) else (w,)
    if len(parts) > 1 and not (takes_int8(type_id, int8) and _alike(parts)):
        return torch.cat([grouped_gemm(type_id, xs, p, k, experts, starts, grid, int8) for p in parts], dim=1)
    lib = library()
    w = parts[0]
    n = w.shape[1]
    y = torch.empty(xs.shape[0], n * len(parts), dtype=torch.float32)
    stride, groups, threads = w.stride(0) * w.element_size(), experts.shape[0], torch.get_num_threads()
    if takes_int8(type_id, int8):
        ptrs = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
        rc = lib.mls_grouped_gemm_q8_parts(
            type_id,
            xs.data_ptr(),
            k,
            ptrs,
            len(parts),
            n,
            w.shape[-1],
            stride,
            experts.data_ptr(),
            starts.data_ptr(),
            groups,
            y.data_ptr(),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"native int8-activation grouped gemm refused type {type_id} (rc {rc})")
        return y
    scale, bn, kb, bk, part_rows = _grid_args(grid, n)
    scale_stride = grid.scale[0].numel() if grid is not None else 0
    rc = lib.mls_grouped_gemm(
        type_id,
        xs.data_ptr(),
        k,
        w.data_ptr(),
        n,
        w.shape[-1],
        stride,
        scale,
        scale_stride,
        bn,
        kb,
        bk,
        part_rows,
        experts.data_ptr(),
        starts.data_ptr(),
        groups,
        y.data_ptr(),
        threads,
    )
    if rc != 0:
        raise RuntimeError(f"native grouped gemm refused type {type_id} (rc {rc})")
    return y


def _out_buffer(out: torch.Tensor | None, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A decoder's destination: a new [n, k] tensor, or the caller's buffer, checked (the C side writes n * k values
    from its first element)."""
    if out is None:
        return torch.empty(n, k, dtype=dtype)
    if out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"decoder buffer {tuple(out.shape)} {out.dtype}: wants contiguous ({n}, {k}) {dtype}")
    return out


def dequantize(
    type_id: int, w: torch.Tensor, k: int, grid: ScaleGrid | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """w [N, R] uint8 -> [N, K] fp32, bit-identical with the reference dequantizers (out: a contiguous [N, K] fp32
    buffer to write them into)."""
    lib = library()
    n = w.shape[0]
    out = _out_buffer(out, n, k, torch.float32)
    rc = lib.mls_dequantize(
        type_id, w.data_ptr(), n, w.shape[-1], *_grid_args(grid, n), k, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native dequantize refused type {type_id} (rc {rc})")
    return out


def dequantize_bf16(type_id: int, w: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, R] uint8 contiguous (a ggml block type) -> [N, K] bf16: the reference's fp32 values rounded to the nearest
    bf16, the bits of dequantize(...).to(torch.bfloat16), written in one pass (the bf16 prefill GEMMs' operand; out:
    a contiguous [N, K] bf16 buffer to write them into)."""
    n = w.shape[0]
    out = _out_buffer(out, n, k, torch.bfloat16)
    rc = library().mls_dequantize_bf16(
        type_id, w.data_ptr(), n, w.shape[-1], k, out.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"native dequantize_bf16 refused type {type_id} (rc {rc})")
    return out


def dequantize_experts(
    type_id: int,
    w: torch.Tensor,
    experts: torch.Tensor,
    k: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """w [E, N, R] uint8 (rows contiguous), experts [A] int64 contiguous -> [A, N, K] fp32: those experts'
    rows decoded bit-identically with the reference, read in place (ggml block types). dtype bfloat16: those values
    rounded to the nearest bf16 in the same pass (as dequantize_bf16). out: where to write them, an [A, N, K]
    view of that dtype whose experts may lie further apart than N * K (a slice of a larger buffer: a layer's gate
    and up stacks decoded into the halves of one [A, 2N, K] buffer); its rows contiguous."""
    a, n = experts.shape[0], w.shape[1]
    if w.stride(2) != 1 or w.stride(1) != w.shape[2] or experts.dtype != torch.int64 or not experts.is_contiguous():
        raise ValueError("dequantize_experts: w needs contiguous rows per expert, experts contiguous int64")
    if a and not 0 <= int(experts.min()) <= int(experts.max()) < w.shape[0]:
        raise IndexError(f"dequantize_experts: an expert id outside the stack of {w.shape[0]}")
    if out is None:
        out = torch.empty(a, n, k, dtype=dtype)
    elif out.shape != (a, n, k) or out.dtype != dtype or out.stride()[1:] != (k, 1):
        raise ValueError(f"dequantize_experts: out {tuple(out.shape)} {out.dtype} is not [{a}, {n}, {k}] {dtype} rows")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_experts: dtype {dtype}; the kernels write float32 or bfloat16 rows")
    fn = {torch.float32: library().mls_dequantize_experts, torch.bfloat16: library().mls_dequantize_experts_bf16}[dtype]
    rc = fn(
        type_id, w.data_ptr(), w.stride(0), experts.data_ptr(), a, n, w.shape[2], k, out.data_ptr(), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native dequantize_experts refused type {type_id} (rc {rc})")
    return out


SCORING = {"softmax": 0, "sigmoid": 1, "sqrt_softplus": 2}  # 2: DeepSeek-V4's sqrt(softplus)
TOPK_METHOD = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    scoring: str,
    method: str,
    n_group: int,
    topk_group: int,
    k: int,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 contiguous -> (topk_w [T, k] fp32, topk_idx [T, k] int64), as models.moe.Gate."""
    lib = library()
    t, e = logits.shape
    w = torch.empty(t, k, dtype=torch.float32)
    idx = torch.empty(t, k, dtype=torch.int64)
    rc = lib.mls_moe_route(
        logits.data_ptr(),
        t,
        e,
        _ptr(bias),
        SCORING[scoring],
        TOPK_METHOD[method],
        n_group,
        topk_group,
        k,
        int(norm),
        scale,
        w.data_ptr(),
        idx.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"native moe_route refused {e} experts / {n_group} groups / top-{k} (rc {rc})")
    return w, idx


def moe_experts(
    type_gu: int,
    type_dn: int,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    int8: bool = False,
    limit: float = math.inf,
    int16: bool = False,
) -> torch.Tensor:
    """x [T, D] fp32, gate / up [E, I, R_D] (one type, each expert's rows contiguous, the same expert stride) /
    down [E, D, R_I] uint8, topk_idx [T, k] int64, topk_w [T, k] fp32 (all contiguous) -> [T, D] fp32: the
    routed experts' weighted sum, pair by pair. gate and up may lie anywhere (two stacks of the mapped file). limit:
    the SwiGLU's clamp (DeepSeek-V4's swiglu_limit; inf: none). int8 / int16: the activations' codes (int8.c /
    csrc/moe/experts.c mls_moe_experts16; neither: fp32)."""
    if gate.shape != up.shape or gate.stride() != up.stride():
        raise ValueError(f"moe_experts: gate {tuple(gate.shape)} and up {tuple(up.shape)} stacks differ in layout")
    lib = library()
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float32)
    rc = (lib.mls_moe_experts_q8 if int8 else lib.mls_moe_experts16 if int16 else lib.mls_moe_experts)(
        type_gu,
        type_dn,
        x.data_ptr(),
        t,
        d,
        gate.shape[1],
        gate.data_ptr(),
        up.data_ptr(),
        gate.stride(0),
        gate.shape[2],
        down.data_ptr(),
        down.stride(0),
        down.shape[2],
        topk_idx.data_ptr(),
        topk_w.data_ptr(),
        topk_idx.shape[1],
        limit,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native moe_experts refused types {type_gu}/{type_dn} (rc {rc})")
    return out

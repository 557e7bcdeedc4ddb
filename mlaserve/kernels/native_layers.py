"""The native kernels' per-layer operations (csrc/attention.c, csrc/glue.c, csrc/moe/block.c,
csrc/decode_layer.c): the absorbed path's latent MQA over paged rows, RMSNorm, a step's latent rows with the query rope,
and a decode step's whole MoE block. The library's build is in native_build.py, the matmul / MoE wrappers in native.py,
the DSA top-k in native_indexer.py; the tests hold these to the torch code (tests/kernels/test_latent_mqa_kernel.py,
tests/kernels/test_glue_kernels.py, tests/kernels/test_moe_block.py, the attention-backend harness).
"""

from __future__ import annotations

import ctypes

import torch

from mlaserve.kernels.native import library


def latent_mqa(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    q_index: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [T, H, r] / q_pe [T, H, dr] fp32 with unit stride along the last dim (views are read in place),
    q_index [B, Q] int64 (the token of each query), cache [S, r + dr] fp32, slots [B, L] int64, mask [B, Q, L]
    bool (these contiguous) -> [B, Q, H, r] fp32: softmax(scale * [q_lat | q_pe] . row) @ row[:r] over each
    query's allowed rows, read in place."""
    lib = library()
    b, nq = q_index.shape
    h, r = q_lat.shape[1], q_lat.shape[2]
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.shape[1] != r + q_pe.shape[2]:
        raise ValueError("latent_mqa: q_lat / q_pe need unit stride along the row, cache rows r + dr values")
    if q_index.dtype != torch.int64 or not q_index.is_contiguous():
        raise ValueError("latent_mqa: q_index must be contiguous int64")
    out = torch.empty(b, nq, h, r, dtype=torch.float32)
    rc = lib.mls_latent_mqa(
        q_lat.data_ptr(),
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.data_ptr(),
        q_pe.stride(0),
        q_pe.stride(1),
        q_index.data_ptr(),
        cache.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        b,
        nq,
        slots.shape[1],
        h,
        r,
        q_pe.shape[2],
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"native latent_mqa failed (rc {rc})")
    return out


def latent_mqa8(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    q_index: torch.Tensor,
    cache,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """latent_mqa over 8-bit rows (cache: a cache/quantized_rows.QuantizedRows with fp32 kept values): the codes
    are read where they lie and decoded a tile at a time (csrc/attention.c mls_latent_mqa8); the result equals
    latent_mqa over the dequantized rows bit for bit. Same shapes and contracts as latent_mqa."""
    b, nq = q_index.shape
    h, r = q_lat.shape[1], q_lat.shape[2]
    fmt = cache.fmt
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or fmt.quantized != r or fmt.kept != q_pe.shape[2]:
        raise ValueError("latent_mqa8: q_lat / q_pe need unit stride along the row, rows of r codes + dr kept")
    # no kept values when the rows have no rope part (qk_rope_head_dim 0, NoPE MLA): dr = 0, nothing to read
    kept = 0 if cache.kept is None else cache.kept.data_ptr()
    if q_index.dtype != torch.int64 or not q_index.is_contiguous() or (kept and cache.kept.dtype != torch.float32):
        raise ValueError("latent_mqa8: q_index must be contiguous int64, the kept values fp32")
    out = torch.empty(b, nq, h, r, dtype=torch.float32)
    rc = library().mls_latent_mqa8(
        q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        q_index.data_ptr(), cache.codes.data_ptr(), cache.scales.data_ptr(), kept,
        int(fmt.codes == "fp8_e4m3"), fmt.block, slots.data_ptr(), mask.data_ptr(), b, nq, slots.shape[1], h, r,
        q_pe.shape[2], scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native latent_mqa8 failed (rc {rc})")
    return out


def latent_mqa16(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    q_index: torch.Tensor,
    cache,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """latent_mqa over 16-bit rows (cache: a cache/quantized_rows.QuantizedRows of a 16-bit format): the rows are
    read where they lie and widened a tile at a time (csrc/attention.c mls_latent_mqa16); the result equals
    latent_mqa over the widened rows bit for bit. Same shapes and contracts as latent_mqa."""
    b, nq = q_index.shape
    h, r = q_lat.shape[1], q_lat.shape[2]
    fmt = cache.fmt
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or not fmt.half or fmt.quantized != r + q_pe.shape[2]:
        raise ValueError("latent_mqa16: q_lat / q_pe need unit stride along the row, 16-bit rows of r + dr values")
    if q_index.dtype != torch.int64 or not q_index.is_contiguous() or not cache.codes.is_contiguous():
        raise ValueError("latent_mqa16: q_index must be contiguous int64, the rows contiguous")
    out = torch.empty(b, nq, h, r, dtype=torch.float32)
    rc = library().mls_latent_mqa16(
        q_lat.data_ptr(), q_lat.stride(0), q_lat.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        q_index.data_ptr(), cache.codes.data_ptr(), HALF_KINDS[fmt.codes], slots.data_ptr(), mask.data_ptr(), b, nq,
        slots.shape[1], h, r, q_pe.shape[2], scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native latent_mqa16 failed (rc {rc})")
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, d] fp32 with unit stride along d, w [d] fp32 contiguous -> [T, d] fp32: x * rsqrt(mean(x^2) + eps) * w,
    torch's fp32 rms_norm up to the rounding of the sum of squares."""
    t, d = x.shape
    y = torch.empty(t, d, dtype=torch.float32)
    library().mls_rms_norm(x.data_ptr(), t, d, x.stride(0), w.data_ptr(), eps, y.data_ptr(), d, torch.get_num_threads())
    return y


def latent_rope_write(
    kv: torch.Tensor,
    q: torch.Tensor,
    dn: int,
    w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """A step's latent rows and query rope in one call (csrc/glue.c mls_latent_rope_write):
    kv [T, r + dr] fp32 rows [c_kv | k_pe] (unit stride along the row), q [T, H, dn + dr] fp32 contiguous,
    w [r] the kv_a_layernorm weight, cos / sin [T, dr / 2] fp32 contiguous, cache [S, r + dr] fp32
    contiguous, slots [T] int64 contiguous. Writes cache[slots] = [rmsnorm(c_kv) w | rope(k_pe)] and
    rotates q's q_pe columns in place."""
    t, h, ldh = q.shape
    dr = ldh - dn
    r = kv.shape[1] - dr
    rc = library().mls_latent_rope_write(
        kv.data_ptr(),
        t,
        kv.stride(0),
        r,
        dr,
        w.data_ptr(),
        eps,
        q.data_ptr(),
        h,
        ldh,
        dn,
        cos.data_ptr(),
        sin.data_ptr(),
        int(interleaved),
        cache.data_ptr(),
        cache.shape[0],
        slots.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -5:
        raise IndexError(f"latent_rope_write: a slot outside the cache of {cache.shape[0]} rows")
    if rc != 0:
        raise RuntimeError(f"native latent_rope_write refused rope width {dr} (rc {rc})")


class MoEBlockArgs(ctypes.Structure):
    """csrc/mls.h mls_moe_block_t: every field 8 bytes, in the C order."""

    _c_type_ = "mls_moe_block_t"

    _fields_ = [
        *((n, ctypes.c_int64) for n in ("d", "e", "kk", "inter", "shared_inter")),
        ("gate_w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        *((n, ctypes.c_int64) for n in ("scoring", "method", "n_group", "topk_group", "norm")),
        ("scale", ctypes.c_double),
        ("type_gu", ctypes.c_int64),
        ("type_dn", ctypes.c_int64),
        *((n, ctypes.c_void_p) for n in ("gate", "up", "down")),
        *((n, ctypes.c_int64) for n in ("gu_expert_stride", "gu_row_bytes", "dn_expert_stride", "dn_row_bytes")),
        *((n, ctypes.c_int64) for n in ("type_sg", "type_su", "type_sd")),
        *((n, ctypes.c_void_p) for n in ("sg", "su", "sd")),
        *((n, ctypes.c_int64) for n in ("sg_row_bytes", "su_row_bytes", "sd_row_bytes")),
        ("int8", ctypes.c_int64),
        ("gu_scale", ctypes.c_void_p),
        ("dn_scale", ctypes.c_void_p),
        *((n, ctypes.c_int64) for n in ("gu_scale_stride", "dn_scale_stride", "group")),
        ("limit", ctypes.c_double),
        ("tid2eid", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
    ]


MOE_BLOCK_ERRORS = {-1: "a weight type without a decoder",
                    -2: "rows longer than the kernels take, not whole 32-value blocks for int8 (or INT4 groups), or "
                        "mismatched sizes",
                    -3: "router settings out of range", -4: "out of memory",
                    -5: "a hash-routing token id outside the tid2eid table, or a table entry outside the experts"}  # fmt: skip


def _check_rows(x: torch.Tensor, d: int, what: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != d or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"{what}: x must be contiguous fp32 [T, {d}] on the CPU, got {x.dtype} {tuple(x.shape)}")


def moe_block(
    args: MoEBlockArgs,
    x: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] fp32 contiguous -> [T, D] fp32: the MoE block of `args` (whose weight tensors the caller keeps
    alive). routing: (topk_w [T, k] fp32, topk_idx [T, k] int64) contiguous tensors to receive the router's
    choice, or None. ids: the step's token ids [T] int64 contiguous, which a hash-routed block (args.tid2eid) reads."""
    _check_rows(x, args.d, "moe_block")
    if args.tid2eid and (
        ids is None or ids.dtype != torch.int64 or ids.shape != (x.shape[0],) or not ids.is_contiguous()
    ):
        raise ValueError(f"moe_block: a hash-routed block reads the step's {x.shape[0]} token ids (int64, contiguous)")
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float32)
    w, idx = routing if routing is not None else (None, None)
    rc = library().mls_moe_block(
        ctypes.byref(args), x.data_ptr(), t, ids.data_ptr() if args.tid2eid else None, out.data_ptr(),
        w.data_ptr() if w is not None else None, idx.data_ptr() if idx is not None else None, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native moe_block refused: {MOE_BLOCK_ERRORS.get(rc, rc)}")
    return out


class LinArgs(ctypes.Structure):
    """csrc/mls.h mls_lin_t: a weight of ggml blocks, n rows of k values."""

    _c_type_ = "mls_lin_t"

    _fields_ = [
        ("type", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        *((n, ctypes.c_int64) for n in ("n", "k", "row_bytes")),
    ]


class LayerArgs(ctypes.Structure):
    """csrc/mls.h mls_layer_t: every field 8 bytes, in the C order."""

    _c_type_ = "mls_layer_t"

    _fields_ = [
        *((n, ctypes.c_int64) for n in ("d", "h", "dn", "dr", "dv", "r", "q_lora")),
        *((n, ctypes.c_double) for n in ("eps_in", "eps_post", "eps_q", "eps_kv", "scale")),
        ("interleaved", ctypes.c_int64),
        *((n, ctypes.c_void_p) for n in ("norm_in", "norm_post", "norm_q", "norm_kv")),
        *((n, LinArgs) for n in ("q_a", "q_b", "kv_a", "o_proj")),
        ("type_k", ctypes.c_int64),
        ("type_v", ctypes.c_int64),
        ("k_b", ctypes.c_void_p),
        ("v_b", ctypes.c_void_p),
        *((n, ctypes.c_int64) for n in ("k_head_stride", "k_row_bytes", "v_head_stride", "v_row_bytes")),
        ("mlp_inter", ctypes.c_int64),
        *((n, LinArgs) for n in ("mlp_gate", "mlp_up", "mlp_down")),
        ("moe", ctypes.POINTER(MoEBlockArgs)),
        ("int8", ctypes.c_int64),
        *((n, ctypes.c_int64) for n in ("idx_role", "idx_h", "idx_d", "idx_interleaved")),
        *((n, ctypes.c_double) for n in ("idx_eps", "idx_w_scale", "idx_d_scale")),
        ("idx_norm_w", ctypes.c_void_p),
        ("idx_norm_b", ctypes.c_void_p),
        *((n, LinArgs) for n in ("idx_q_b", "idx_k", "idx_w")),
        ("reduce", ctypes.c_void_p),  # a REDUCE_FN (tensor parallel) or None
    ]


# mls_layer_t.reduce: int (*)(float *a, int64_t n), the ranks' sum of a [n] in place (0: done)
REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


INDEXER_ROLES = {None: 0, "full": 1, "shared": 2}  # mls_layer_t idx_role (config/layer_kinds.py indexer_role)


class DecodeStepArgs(ctypes.Structure):
    """csrc/mls.h mls_decode_step_t: one decode step's rope, slots and attention rows, shared by every layer."""

    _c_type_ = "mls_decode_step_t"

    _fields_ = [
        ("t", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("n_slots", ctypes.c_int64),
        ("q_index", ctypes.c_void_p),
        ("kv_slots", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("l", ctypes.c_int64),
        ("sparse", ctypes.c_int64),
        ("topk", ctypes.c_int64),
        ("sel_index", ctypes.c_void_p),
        ("sel_valid", ctypes.c_void_p),
        ("index_bf16", ctypes.c_int64),  # the route's index_scoring: 1 "bf16", 0 "fp32"
    ]


LAYER_ERRORS = {**MOE_BLOCK_ERRORS, -5: "a slot outside the cache",
                -6: "a sparse step the layer's indexer cannot run (no index-key cache, or no selection to reuse), "
                    "or 8-bit rows (or 16-bit rows) of a layout the call does not read",
                -7: "the tensor-parallel all-reduce failed"}  # fmt: skip


class RowsArgs(ctypes.Structure):
    """csrc/mls.h mls_rows_t: a layer's paged state, fp32 rows, 8-bit codes or 16-bit rows (every field 8 bytes)."""

    _c_type_ = "mls_rows_t"

    _fields_ = [*((n, ctypes.c_void_p) for n in ("rows", "codes", "scales", "kept")), ("fp8", ctypes.c_int64),
                ("block", ctypes.c_int64), ("half", ctypes.c_int64)]  # fmt: skip


HALF_KINDS = {"float16": 1, "bfloat16": 2}  # csrc/rows16.c HALF_F16 / HALF_BF16


def rows_of(state) -> RowsArgs:
    """An mls_rows_t of a layer's state: a contiguous fp32 tensor [S, width], or a cache/quantized_rows.QuantizedRows
    with fp32 kept values, or 16-bit rows (fmt.half) (the callers check both: quant/ggml_layer.decode_step)."""
    if isinstance(state, torch.Tensor):
        return RowsArgs(state.data_ptr())
    if state.fmt.half:
        return RowsArgs(None, state.codes.data_ptr(), None, None, 0, 0, HALF_KINDS[state.fmt.codes])
    kept = state.kept.data_ptr() if state.kept is not None else None
    fmt = state.fmt
    return RowsArgs(
        None, state.codes.data_ptr(), state.scales.data_ptr(), kept, int(fmt.codes == "fp8_e4m3"), fmt.block
    )


def decode_layer(args: LayerArgs, step: DecodeStepArgs, x: torch.Tensor, cache, index_keys=None) -> torch.Tensor:
    """x [T, D] fp32 contiguous -> the layer's output [T, D]; writes the step's rows into cache [S, r + dr] and, on
    a sparse step of a full indexer layer, into index_keys [S, Di] (S = step.n_slots): each a contiguous fp32
    tensor, or a QuantizedRows (kv_cache_dtype) whose codes and scales the call writes and reads in place. The
    tensors args and step point into are kept alive by their callers."""
    _check_rows(x, args.d, "decode_layer")
    out = torch.empty(x.shape, dtype=torch.float32)
    keys = ctypes.byref(rows_of(index_keys)) if index_keys is not None else None
    rc = library().mls_decode_layer(
        ctypes.byref(args), ctypes.byref(step), x.data_ptr(), out.data_ptr(), ctypes.byref(rows_of(cache)), keys,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode_layer refused: {LAYER_ERRORS.get(rc, rc)}")
    return out


class LayerStack:
    """The C arrays of mls_decode_layers: the layers' mls_layer_t (constant) and their states' mls_rows_t (built from
    one ModelCache's layer states, kept while the same state objects are passed: `rows`)."""

    def __init__(self, layers: list[LayerArgs]) -> None:
        self.n = len(layers)
        self.d = layers[0].d
        self._layers = layers  # kept alive: the array points into them
        self.args = (ctypes.c_void_p * self.n)(*(ctypes.addressof(a) for a in layers))
        self._states: tuple | None = None  # (the states, rows array, keys array or None, the RowsArgs kept)

    def rows(self, states: list) -> tuple:
        """states: per layer (cache, index_keys or None) -> (rows array, keys array or None)."""
        if (
            self._states is None
            or len(states) != len(self._states[0])
            or any(a is not b or ka is not kb for (a, ka), (b, kb) in zip(states, self._states[0]))
        ):
            rows = [rows_of(c) for c, _ in states]
            keys = [rows_of(k) if k is not None else None for _, k in states]
            rows_arr = (ctypes.c_void_p * self.n)(*(ctypes.addressof(r) for r in rows))
            keys_arr = None
            if any(k is not None for k in keys):
                keys_arr = (ctypes.c_void_p * self.n)(*(ctypes.addressof(k) if k is not None else None for k in keys))
            self._states = (list(states), rows_arr, keys_arr, rows, keys)
        return self._states[1], self._states[2]


def decode_layers(stack: LayerStack, step: DecodeStepArgs, x: torch.Tensor, states: list) -> torch.Tensor:
    """decode_layer over every layer of `stack` in one C call (mls_decode_layers): x [T, D] fp32 contiguous -> the
    last layer's output [T, D], bit for bit the n calls of decode_layer; states: per layer (cache, index_keys or
    None), as decode_layer takes them."""
    _check_rows(x, stack.d, "decode_layers")
    out = torch.empty(x.shape, dtype=torch.float32)
    rows, keys = stack.rows(states)
    failed = ctypes.c_int64(-1)
    rc = library().mls_decode_layers(
        stack.args, stack.n, ctypes.byref(step), x.data_ptr(), out.data_ptr(), rows, keys, ctypes.byref(failed),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode_layers refused at layer {failed.value}: {LAYER_ERRORS.get(rc, rc)}")
    return out


def round16_rows(x: torch.Tensor, codes: str) -> torch.Tensor:
    """The decode layer's 16-bit rounding (csrc/rows16.c) on its own, for its tests: x [T, width] fp32 contiguous
    -> [T, width] float16 / bfloat16 (codes), torch's cast bit for bit."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"round16_rows: contiguous fp32 [T, width], got {tuple(x.shape)} {x.dtype}")
    out = torch.empty(x.shape, dtype=torch.float16 if codes == "float16" else torch.bfloat16)
    rc = library().mls_round16_rows(x.data_ptr(), x.shape[0], x.shape[1], HALF_KINDS[codes], out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native round16_rows refused {codes!r} (rc {rc})")
    return out


def quantize_rows(x: torch.Tensor, block: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode layer's quantizer (csrc/rows8.c) on its own, for its tests: x [T, q] fp32 contiguous ->
    (codes [T, q] uint8, scales [T, q / block] fp32), cache/quantized_rows.quantize's bit for bit."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % block:
        raise ValueError(f"quantize_rows: contiguous fp32 [T, q] with q a multiple of {block}, got {tuple(x.shape)}")
    t, q = x.shape
    codes = torch.empty(t, q, dtype=torch.uint8)
    scales = torch.empty(t, q // block, dtype=torch.float32)
    rc = library().mls_quantize_rows(x.data_ptr(), t, q, q, block, int(fp8), codes.data_ptr(), scales.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native quantize_rows refused block {block} (rc {rc})")
    return codes, scales

"""The C interface as ctypes sees it: each prototype of csrc/mls.h with its argtypes and restype, declared on a loaded
library (kernels/native_build.py). ctypes trusts what it is told, so tests/kernels/test_kernel_bindings.py holds
every prototype in the header to what is declared here (count and type of each parameter); a change to mls.h bumps
MLS_ABI_VERSION and native_build.ABI_VERSION and is mirrored here.
"""

from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> None:
    """Set every exported function's argtypes and restype (int where none is set) on `lib`."""
    i64, ptr, c_int, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.mls_gemm.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, c_int]
    lib.mls_grouped_gemm.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr]
    lib.mls_grouped_gemm.argtypes += [i64, ptr, c_int]
    lib.mls_dequantize.argtypes = [c_int, ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, c_int]
    lib.mls_moe_route.argtypes = [ptr, i64, i64, ptr, c_int, c_int, i64, i64, i64, c_int, f32, ptr, ptr]
    lib.mls_moe_experts.argtypes = [c_int, c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.mls_moe_experts.argtypes += [i64, f32, ptr, c_int]
    lib.mls_moe_experts_q8.argtypes = lib.mls_moe_experts.argtypes
    lib.mls_moe_experts16.argtypes = lib.mls_moe_experts.argtypes
    lib.mls_gemm_q8.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int]
    lib.mls_latent_mqa.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.mls_latent_mqa.argtypes += [f32, ptr, c_int]
    lib.mls_latent_mqa8.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, c_int, i64, ptr, ptr]
    lib.mls_latent_mqa8.argtypes += [i64, i64, i64, i64, i64, i64, f32, ptr, c_int]
    lib.mls_latent_mqa16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, c_int, ptr, ptr]
    lib.mls_latent_mqa16.argtypes += [i64, i64, i64, i64, i64, i64, f32, ptr, c_int]
    lib.mls_hc_pre.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, f32, f32, c_int, ptr, ptr, ptr, c_int]
    lib.mls_hc_post.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, c_int]
    lib.mls_v4_ffn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, f32, f32, c_int,  # h .. iters
                               ptr, f32, ptr, ptr, ptr, c_int]  # fmt: skip
    lib.mls_sink_mqa.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, c_int]
    lib.mls_sink_mqa_parts.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr,  # q .. part_row
                                       ptr, i64, i64, i64, i64, i64, f32, ptr, ptr, c_int]  # fmt: skip
    lib.mls_grouped_gemm_q8.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, c_int]
    lib.mls_grouped_gemm_q8_parts.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, c_int]
    lib.mls_dequantize_experts.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, c_int]
    lib.mls_dequantize_bf16.argtypes = [c_int, ptr, i64, i64, i64, ptr, c_int]
    lib.mls_dequantize_experts_bf16.argtypes = lib.mls_dequantize_experts.argtypes
    lib.mls_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, i64, c_int]
    lib.mls_rope_pairs.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, f32, c_int]
    lib.mls_norm_rope_pairs.argtypes = [ptr, i64, i64, i64, ptr, f32, i64, ptr, ptr, c_int]
    lib.mls_gather_rows.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, c_int]
    lib.mls_argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.mls_latent_rope_write.argtypes = [ptr, i64, i64, i64, i64, ptr, f32, ptr, i64, i64, i64, ptr, ptr, c_int]
    lib.mls_latent_rope_write.argtypes += [ptr, i64, ptr, c_int]
    lib.mls_moe_block.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, c_int]
    lib.mls_decode_layer.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.mls_decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, c_int]
    lib.mls_quantize_rows.argtypes = [ptr, i64, i64, i64, i64, c_int, ptr, ptr]
    lib.mls_index_topk.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, c_int, c_int]
    lib.mls_index_topk8.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, c_int, c_int]
    lib.mls_index_topk16.argtypes = [ptr, ptr, i64, i64, i64, ptr, c_int, ptr, ptr, i64, i64, ptr, ptr, c_int, c_int]
    lib.mls_round16_rows.argtypes = [ptr, i64, i64, c_int, ptr]
    lib.mls_type_info.argtypes = [c_int, ptr, ptr, ptr]
    lib.mls_layout.argtypes = [ptr]
    lib.mls_layout.restype = ptr
    lib.mls_isa.argtypes = []
    lib.mls_isa.restype = ptr
    lib.mls_int8_isa.argtypes = []
    lib.mls_int8_isa.restype = ptr
    lib.mls_int8_tiles.argtypes = []
    lib.mls_int8_tiles.restype = c_int
    lib.mls_int8_tile_rows.argtypes = [c_int]
    lib.mls_int8_tile_rows.restype = i64
    lib.mls_int8_panel_rows.argtypes = [c_int]
    lib.mls_int8_panel_rows.restype = i64
    lib.mls_int8_panels_isa.argtypes = []
    lib.mls_int8_panels_isa.restype = ptr
    lib.mls_q8_0_bf16_pairs.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int]
    lib.mls_q8_0_bf16_pairs_grouped.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, c_int]
    lib.mls_int16_gemm.argtypes = [c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, c_int]
    lib.mls_int16_gemm_multi.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, c_int]
    lib.mls_int16_grouped.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, c_int]
    lib.mls_int16_takes.argtypes = [c_int]
    lib.mls_int16_takes.restype = c_int
    lib.mls_int16_panels.argtypes = [c_int]
    lib.mls_int16_panels.restype = c_int
    lib.mls_int16_tile_rows.argtypes = [c_int]
    lib.mls_int16_tile_rows.restype = i64
    lib.mls_int16_in.argtypes = [c_int, i64]
    lib.mls_int16_in.restype = c_int
    lib.mls_bf16_bmm.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, c_int]
    lib.mls_softmax_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, c_int]
    # attention_pack.c: pointers to each operand, then its sizes and strides
    lib.mls_pack_keys_bf16.argtypes = [ptr] + [i64] * 4 + [ptr] + [i64] * 7 + [ptr, i64, i64, c_int]
    lib.mls_pack_values_bf16.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, c_int, ptr, i64, i64, c_int]
    lib.mls_pack_queries_bf16.argtypes = (
        [ptr] + [i64] * 3 + [ptr] + [i64] * 3 + [ptr] + [i64] * 3 + [f32, ptr, i64, i64, c_int]
    )
    lib.mls_bf16_bmm_unit.argtypes = []
    lib.mls_bf16_bmm_unit.restype = c_int
    lib.mls_grouped_panels.argtypes = [c_int, ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, c_int]
    lib.mls_panels.argtypes = []
    lib.mls_panels.restype = c_int
    lib.mls_bf16_tiles.argtypes = []
    lib.mls_bf16_tiles.restype = c_int
    lib.mls_quantize_act.argtypes = [c_int, ptr, i64, i64, i64, ptr, ptr]

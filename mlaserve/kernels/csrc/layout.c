/* The layout of every struct mls.h shares with Python, as this compiler lays it out: the ctypes mirrors
   (kernels/native_layers.py) are checked against it (tests/kernels/test_kernel_bindings.py), so a field moved or
   retyped on one side only fails a test instead of reading the wrong bytes. */

#include <stddef.h>

#define STRUCT(T) {#T, 0, 0, sizeof(T)}
#define FIELD(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}

static const mls_layout_entry_t LAYOUT[] = {
    STRUCT(mls_moe_block_t),
    FIELD(mls_moe_block_t, d),
    FIELD(mls_moe_block_t, e),
    FIELD(mls_moe_block_t, kk),
    FIELD(mls_moe_block_t, inter),
    FIELD(mls_moe_block_t, shared_inter),
    FIELD(mls_moe_block_t, gate_w),
    FIELD(mls_moe_block_t, bias),
    FIELD(mls_moe_block_t, scoring),
    FIELD(mls_moe_block_t, method),
    FIELD(mls_moe_block_t, n_group),
    FIELD(mls_moe_block_t, topk_group),
    FIELD(mls_moe_block_t, norm),
    FIELD(mls_moe_block_t, scale),
    FIELD(mls_moe_block_t, type_gu),
    FIELD(mls_moe_block_t, type_dn),
    FIELD(mls_moe_block_t, gate_up),
    FIELD(mls_moe_block_t, down),
    FIELD(mls_moe_block_t, gu_expert_stride),
    FIELD(mls_moe_block_t, gu_row_bytes),
    FIELD(mls_moe_block_t, dn_expert_stride),
    FIELD(mls_moe_block_t, dn_row_bytes),
    FIELD(mls_moe_block_t, type_sg),
    FIELD(mls_moe_block_t, type_su),
    FIELD(mls_moe_block_t, type_sd),
    FIELD(mls_moe_block_t, sg),
    FIELD(mls_moe_block_t, su),
    FIELD(mls_moe_block_t, sd),
    FIELD(mls_moe_block_t, sg_row_bytes),
    FIELD(mls_moe_block_t, su_row_bytes),
    FIELD(mls_moe_block_t, sd_row_bytes),
    FIELD(mls_moe_block_t, int8),

    STRUCT(mls_lin_t),
    FIELD(mls_lin_t, type),
    FIELD(mls_lin_t, w),
    FIELD(mls_lin_t, n),
    FIELD(mls_lin_t, k),
    FIELD(mls_lin_t, row_bytes),

    STRUCT(mls_layer_t),
    FIELD(mls_layer_t, d),
    FIELD(mls_layer_t, h),
    FIELD(mls_layer_t, dn),
    FIELD(mls_layer_t, dr),
    FIELD(mls_layer_t, dv),
    FIELD(mls_layer_t, r),
    FIELD(mls_layer_t, q_lora),
    FIELD(mls_layer_t, eps_in),
    FIELD(mls_layer_t, eps_post),
    FIELD(mls_layer_t, eps_q),
    FIELD(mls_layer_t, eps_kv),
    FIELD(mls_layer_t, scale),
    FIELD(mls_layer_t, interleaved),
    FIELD(mls_layer_t, norm_in),
    FIELD(mls_layer_t, norm_post),
    FIELD(mls_layer_t, norm_q),
    FIELD(mls_layer_t, norm_kv),
    FIELD(mls_layer_t, q_a),
    FIELD(mls_layer_t, q_b),
    FIELD(mls_layer_t, kv_a),
    FIELD(mls_layer_t, o_proj),
    FIELD(mls_layer_t, type_k),
    FIELD(mls_layer_t, type_v),
    FIELD(mls_layer_t, k_b),
    FIELD(mls_layer_t, v_b),
    FIELD(mls_layer_t, k_head_stride),
    FIELD(mls_layer_t, k_row_bytes),
    FIELD(mls_layer_t, v_head_stride),
    FIELD(mls_layer_t, v_row_bytes),
    FIELD(mls_layer_t, mlp_inter),
    FIELD(mls_layer_t, mlp_gate),
    FIELD(mls_layer_t, mlp_up),
    FIELD(mls_layer_t, mlp_down),
    FIELD(mls_layer_t, moe),
    FIELD(mls_layer_t, int8),

    STRUCT(mls_decode_step_t),
    FIELD(mls_decode_step_t, t),
    FIELD(mls_decode_step_t, cos),
    FIELD(mls_decode_step_t, sin),
    FIELD(mls_decode_step_t, slots),
    FIELD(mls_decode_step_t, n_slots),
    FIELD(mls_decode_step_t, q_index),
    FIELD(mls_decode_step_t, kv_slots),
    FIELD(mls_decode_step_t, mask),
    FIELD(mls_decode_step_t, l),

    STRUCT(mls_layout_entry_t),
    FIELD(mls_layout_entry_t, type),
    FIELD(mls_layout_entry_t, field),
    FIELD(mls_layout_entry_t, offset),
    FIELD(mls_layout_entry_t, size),
};

#undef STRUCT
#undef FIELD

const mls_layout_entry_t *mls_layout(int64_t *n) {
    *n = (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    return LAYOUT;
}

int mls_abi_version(void) { return MLS_ABI_VERSION; }

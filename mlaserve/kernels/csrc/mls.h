/* mlaserve's native kernels: everything Python sees of them (kernels/native.py, kernels/native_layers.py).

   Matrix products on weights kept in their stored block formats, for small batches (decode):
   y[m, n] = sum_k x[m, k] * W[n, k], W given as raw rows of ggml blocks (Q4_0 ... Q6_K, MXFP4, IQ*, TQ*), as
   float8 e4m3 values with block scales, as packed e2m1 (FP4) codes with group scales, or as compressed-tensors
   INT4 words with group scales; the MoE router and experts, the latent MQA, the decode-step glue, a decode step's DSA top-k and a whole decoder layer's
   decode step (dense, or sparse with the DSA indexer inside).

   Threads: OpenMP over output rows (the process's one OpenMP runtime: torch's, loaded first), as many
   as the caller passes (torch.get_num_threads(): an OpenMP thread's own default would ignore
   torch.set_num_threads called from another thread, e.g. the server's engine thread).
   Return value: 0; -1 for a type a function does not take, -2 for rows longer than MAX_K (or, for the
   int8-activation kernels, not whole activation blocks of the type: 32 or 256 values; for INT4, scale groups not whole 32-value chunks), -3 for router settings out of range, -4 when
   memory cannot be allocated, -5 for a cache slot outside the cache; -2 also for a rope slice longer than MAX_ROPE or odd;
   -6 for a sparse step a decode layer's indexer cannot run (no index-key cache, no selection to reuse), or a
   state it cannot read (8-bit rows with a block that does not divide them, index keys past 1024 values).

   The Python side mirrors this file by hand (ctypes argtypes and Structures); tests/kernels/test_kernel_bindings.py
   holds every prototype and struct below to it (mls_layout gives the compiled sizes and offsets). Change
   MLS_ABI_VERSION with any change here. */
#ifndef MLS_H
#define MLS_H

#include <stdint.h>

#define MLS_ABI_VERSION 46
#define MLS_INT8_CAP 0xFF   /* an activation setting's int8 cap (mls_moe_block_t.int8) */
#define MLS_ACT_INT16 0x100 /* an activation setting's int16 flag (kernels/native.py INT16_REST) */

/* weight types: the ggml type ids, then mlaserve's own (fp32 scales kept apart from the codes) */
enum {
    MLS_F32 = 0, /* rows of fp32 values (small matrices a GGUF keeps unquantized) */
    MLS_Q4_0 = 2,
    MLS_Q4_1 = 3,
    MLS_Q5_0 = 6,
    MLS_Q5_1 = 7,
    MLS_Q8_0 = 8,
    MLS_Q2_K = 10,
    MLS_Q3_K = 11,
    MLS_Q4_K = 12,
    MLS_Q5_K = 13,
    MLS_Q6_K = 14,
    MLS_IQ2_XXS = 16, /* the i-quants: grid indices, sign bits and sub-block scales (ref/iquants.c) */
    MLS_IQ2_XS = 17,
    MLS_IQ3_XXS = 18,
    MLS_IQ1_S = 19,
    MLS_IQ4_NL = 20, /* 32 codes of a 16-value non-linear table with an fp16 d */
    MLS_IQ3_S = 21,
    MLS_IQ2_S = 22,
    MLS_IQ4_XS = 23, /* IQ4_NL's table in 256-value super-blocks with 6-bit sub-block scales */
    MLS_IQ1_M = 29,
    MLS_TQ1_0 = 34, /* ternary: base-3 digits, 5 per byte */
    MLS_TQ2_0 = 35, /* ternary: 2-bit codes */
    MLS_MXFP4 = 39,       /* 32 e2m1 codes with one e8m0 scale byte */
    MLS_GGML_TYPES = 40,  /* the ggml ids above are below this (the table leaves the others empty) */
    MLS_FP8_E4M3 = 1000,  /* float8 e4m3 values with block scales */
    MLS_FP4_E2M1 = 1001,  /* two e2m1 codes per byte (low nibble first), one fp32 scale per row and group */
    MLS_INT4_PACKED = 1002 /* compressed-tensors pack-quantized INT4: int32 words of 8 values read as bytes (two
                              per byte, low nibble first, each q + 8), one fp32 scale per row and group of a
                              multiple of 32 values */
};

/* the router's settings (kernels/native.py SCORING, TOPK_METHOD) */
enum { MLS_SCORE_SOFTMAX = 0, MLS_SCORE_SIGMOID = 1, MLS_SCORE_SQRT_SOFTPLUS = 2 }; /* 2: DeepSeek-V4's */
enum { MLS_TOPK_GREEDY = 0, MLS_TOPK_GROUP_MAX = 1, MLS_TOPK_GROUP_TOP2 = 2 };

/* the MoE block of a decode step (moe/block.c) */
typedef struct { /* every field 8 bytes: the ctypes mirror (kernels/native_layers.py) has no padding to guess */
    int64_t d, e, kk, inter, shared_inter; /* hidden, experts, experts per token, I, shared I (0: none) */
    const float *gate_w, *bias;            /* [E, D] fp32, [E] fp32 or 0 */
    int64_t scoring, method, n_group, topk_group, norm;
    double scale; /* routed_scaling_factor (rounded to float, as the router's argument) */
    int64_t type_gu, type_dn;
    /* rows of ggml blocks: expert e's I gate rows at gate + e * gu_expert_stride, its I up rows at up + e *
       gu_expert_stride (two stacks of the file, kept where they lie: up need not follow gate), its D down rows
       at down + e * dn_expert_stride; gu_row_bytes for gate and up (one type), dn_row_bytes for down */
    const uint8_t *gate, *up, *down;
    int64_t gu_expert_stride, gu_row_bytes, dn_expert_stride, dn_row_bytes;
    int64_t type_sg, type_su, type_sd; /* the shared expert's gate_proj [Is, D], up_proj [Is, D], down_proj [D, Is] */
    const uint8_t *sg, *su, *sd;
    int64_t sg_row_bytes, su_row_bytes, sd_row_bytes;
    int64_t int8; /* the activation setting, as the per-op path's: its low byte (MLS_INT8_CAP) the int8 cap, 0 none,
                     else the widest weight type (bits per value: Q8_0 8, Q6_K 6, Q5_K 5, Q4_K / Q4_0 4) whose
                     products take int8 activations (types.c q8rows_in); MLS_ACT_INT16 set: the 32-value block types
                     the cap leaves in fp32 take int16 activations (x86/int16_prefill.c qw_in) */
    /* routed experts of a type with its scales apart (MLS_INT4_PACKED): fp32 scales per row and group of `group`
       columns, gate_up [E, 2I, D / group] and down [E, D, I / group], scale_stride floats per expert; 0: none */
    const float *gu_scale, *dn_scale;
    int64_t gu_scale_stride, dn_scale_stride, group;
    double limit; /* swiglu_limit: gate and up clamped before the SwiGLU, routed and shared (INFINITY: none) */
    /* hash routing (DeepSeek-V4's first layers): expert ids tid2eid[token id] [vocab, kk], the step's token ids
       passed per call; 0: learned routing (the gate's scores, top-k) */
    const int64_t *tid2eid;
    int64_t vocab;
} mls_moe_block_t;

/* a decoder layer's decode step (decode_layer.c) */
typedef struct { /* a weight of ggml blocks: n rows of k values, row_bytes each */
    int64_t type;
    const uint8_t *w;
    int64_t n, k, row_bytes;
} mls_lin_t;

typedef struct { /* every field 8 bytes (the ctypes mirror in kernels/native_layers.py) */
    int64_t d, h, dn, dr, dv, r, q_lora; /* q_lora 0: q_b is q_proj, applied to the normed input */
    double eps_in, eps_post, eps_q, eps_kv, scale; /* rounded to float as the per-op path's arguments */
    int64_t interleaved;
    const float *norm_in, *norm_post, *norm_q, *norm_kv;
    mls_lin_t q_a, q_b, kv_a, o_proj;
    int64_t type_k, type_v; /* attn_k_b [H, r, dn] and attn_v_b [H, dv, r] in blocks */
    const uint8_t *k_b, *v_b;
    int64_t k_head_stride, k_row_bytes, v_head_stride, v_row_bytes;
    int64_t mlp_inter; /* a dense SwiGLU's intermediate size; 0: the MoE block below */
    mls_lin_t mlp_gate, mlp_up, mlp_down;
    const mls_moe_block_t *moe;
    int64_t int8; /* int8 activations: as mls_moe_block_t.int8 */
    /* the DSA indexer (indexer.c). idx_role 0: none (dense MLA); 1 full: its own indexer and key cache; 2 shared:
       attends the rows the last full layer before it selected in this step (GLM-5's indexer_types) */
    int64_t idx_role, idx_h, idx_d, idx_interleaved; /* Hi index heads, Di index_head_dim, the indexer's rope */
    double idx_eps, idx_w_scale, idx_d_scale; /* k_norm's eps; Hi^-0.5 and Di^-0.5 (each rounded to float) */
    const float *idx_norm_w, *idx_norm_b;     /* k_norm (LayerNorm) [Di] */
    mls_lin_t idx_q_b, idx_k, idx_w;          /* wq_b [Hi Di, q_lora], wk [Di, D], weights_proj [Hi, D] */
    /* tensor parallel: an int (*)(float *a, int64_t n) that sums a [n] over the ranks in place, called on o_proj's
       and on the MLP's output before each is added to the residual (the ranks' partial sums); nonzero: it failed.
       0 (one process): not called. Held as an address, as every pointer the ctypes mirror passes */
    void *reduce;
} mls_layer_t;

typedef struct { /* one decode step, shared by every layer */
    int64_t t;               /* tokens = requests, one query each, token b of request b */
    const float *cos, *sin;  /* [T, dr / 2] */
    const int64_t *slots;    /* [T] the cache rows written */
    int64_t n_slots;         /* rows of a layer's cache */
    const int64_t *q_index;  /* [T, 1] */
    const int64_t *kv_slots; /* [T, L] */
    const uint8_t *mask;     /* [T, 1, L] */
    int64_t l;
    int64_t sparse;          /* a sparse (DSA) route: full indexer layers write their index keys */
    int64_t topk;            /* K = min(index_topk, L) when the step selects (plan.needs_selection); 0: every row */
    int64_t *sel_index;      /* [T, K] the selected positions on the key axis: written by a full layer, read by the */
    uint8_t *sel_valid;      /* [T, K] shared layers after it; valid 0 where a request has fewer than K rows */
    int64_t index_bf16;      /* the route's index_scoring: 1 bf16 (q and keys rounded to bf16), 0 fp32 */
} mls_decode_step_t;

typedef struct { /* a layer's paged state (latent rows or index keys): fp32 rows, 8-bit codes (rows8.c) or 16-bit
                    values (rows16.c) */
    float *rows;     /* [S, width] fp32 rows; 0 when the state is kept in 8 or 16 bits (kv_cache_dtype) */
    uint8_t *codes;  /* [S, q] int8 codes, or e4m3fn bit patterns when fp8; 16-bit: [S, width] values */
    float *scales;   /* [S, q / block] fp32 */
    float *kept;     /* [S, width - q] fp32 (the latent row's k_pe), 0 when width = q */
    int64_t fp8;     /* 1: e4m3 codes, 0: int8 codes */
    int64_t block;   /* codes per scale */
    int64_t half;    /* 1 float16, 2 bfloat16: codes are the whole rows in 16 bits (scales, kept unused); 0 8-bit */
} mls_rows_t;

/* one field of a struct above as this compiler lays it out (layout.c); field 0: the whole struct */
typedef struct {
    const char *type, *field;
    int64_t offset, size;
} mls_layout_entry_t;

/* gemv.c: products and decoding of stored rows */
int mls_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
             int64_t row_bytes, const float *scale, int64_t bn, int64_t kb, int64_t bk, int64_t part_rows,
             float *y, int64_t ldy, int threads);
int mls_grouped_gemm(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                     int64_t expert_stride, const float *scale, int64_t scale_expert_stride, int64_t bn,
                     int64_t kb, int64_t bk, int64_t part_rows, const int64_t *experts, const int64_t *starts,
                     int64_t groups, float *y, int threads);
int mls_dequantize(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const float *scale, int64_t bn,
                   int64_t kb, int64_t bk, int64_t part_rows, int64_t k, float *out, int threads);
int mls_dequantize_experts(int type, const uint8_t *w, int64_t expert_stride, const int64_t *experts, int64_t a,
                           int64_t n, int64_t row_bytes, int64_t k, float *out, int64_t out_expert_stride,
                           int threads);
int mls_dequantize_bf16(int type, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, uint16_t *out,
                        int threads);
int mls_dequantize_experts_bf16(int type, const uint8_t *w, int64_t expert_stride, const int64_t *experts, int64_t a,
                                int64_t n, int64_t row_bytes, int64_t k, uint16_t *out,
                                int64_t out_expert_stride, int threads);

/* int8.c: the same products with int8 activations (Q8_0 / Q4_0: per 32 values; Q4_K / Q5_K / Q6_K: llama.cpp's
   q8_K, per 256); mls_quantize_act: x [m, k] (row stride ldx) -> the codes q [m, k] and k / 32 float slots per row
   (d) that a type's int8 kernel reads (common.h q8k_meta), exposed for its tests */
int mls_quantize_act(int type, const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d);
int mls_gemm_q8(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                int64_t row_bytes, float *y, int64_t ldy, int threads);
int mls_grouped_gemm_q8(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                        int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                        float *y, int threads);
/* the same over nparts stacks (a projection's parts, e.g. gate and up) into y [P, nparts * n], one quantization */
int mls_grouped_gemm_q8_parts(int type, const float *x, int64_t k, const uint8_t *const *ws, int64_t nparts,
                              int64_t n, int64_t row_bytes, int64_t expert_stride, const int64_t *experts,
                              const int64_t *starts, int64_t groups, float *y, int threads);

/* x86/panels.c: fp32 products of many rows per weight on decoded panels (AVX-512 builds; -1 elsewhere) */
int mls_grouped_panels(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                       int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                       int64_t ldy, int threads);
int mls_panels(void);

/* moe/: the router, the routed experts, the whole block */
int mls_moe_route(const float *logits, int64_t t, int64_t e, const float *bias, int scoring, int method,
                  int64_t n_group, int64_t topk_group, int64_t k, int norm, float scale, float *out_w,
                  int64_t *out_idx);
/* limit: the SwiGLU's clamp (DeepSeek-V4's swiglu_limit: silu(min(g, limit)) * clamp(u, +-limit)); INFINITY none */
int mls_moe_experts(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                    const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                    const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt, int64_t kk,
                    float limit, float *out, int threads);
int mls_moe_experts_q8(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                       const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                       const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt,
                       int64_t kk, float limit, float *out, int threads);
int mls_moe_experts16(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                      const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                      const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx,
                      const float *wt, int64_t kk, float limit, float *out, int threads);
int mls_moe_block(const mls_moe_block_t *b, const float *x, int64_t t, const int64_t *ids, float *out, float *topk_w,
                  int64_t *topk_idx, int threads);

/* attention.c, glue.c: the latent MQA (and DeepSeek-V4's with sinks), RMSNorm, a step's latent rows and query rope */
int mls_latent_mqa(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                   int64_t qp_head, const int64_t *q_index, const float *cache, const int64_t *slots,
                   const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                   float scale, float *out, int threads);
int mls_latent_mqa8(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                    int64_t qp_head, const int64_t *q_index, const uint8_t *codes, const float *scales,
                    const float *kept, int fp8, int64_t block, const int64_t *slots, const uint8_t *mask, int64_t b,
                    int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr, float scale, float *out, int threads);
int mls_latent_mqa16(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                     int64_t qp_head, const int64_t *q_index, const uint16_t *rows, int half, const int64_t *slots,
                     const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                     float scale, float *out, int threads);
int mls_sink_mqa(const float *q, int64_t q_tok, int64_t q_head, const int64_t *q_index, const float *rows,
                 const int64_t *slots, const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t d,
                 float scale, const float *sinks, float *out, int threads);
int mls_sink_mqa_parts(const float *q, int64_t q_tok, int64_t q_head, const int64_t *q_index,
                       const float *const *bases, const int64_t *rows, int64_t n_parts, const int64_t *part_row,
                       const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t d, float scale,
                       const float *sinks, float *out, int threads);
int mls_rms_norm(const float *x, int64_t t, int64_t d, int64_t ldx, const float *w, float eps, float *y,
                 int64_t ldy, int threads);
int mls_rope_pairs(float *x, int64_t t, int64_t rows, int64_t w, int64_t d, const float *cos, const float *sin,
                   float sign, int threads);
int mls_norm_rope_pairs(float *x, int64_t t, int64_t rows, int64_t w, const float *g, float eps, int64_t d,
                        const float *cos, const float *sin, int threads);
int mls_gather_rows(const float *const *bases, const int64_t *rows, int64_t n_parts, const int64_t *part_row,
                    int64_t n, int64_t d, float *out, int threads);
int mls_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *idx, uint8_t *finite, int threads);
int mls_latent_rope_write(const float *kv, int64_t t, int64_t ldkv, int64_t r, int64_t dr, const float *w,
                          float eps, float *q, int64_t h, int64_t ldh, int64_t dn, const float *cos,
                          const float *sin, int interleaved, float *cache, int64_t n_slots,
                          const int64_t *slots, int threads);
/* hyper.c: an mHC hyper-connection's mixing weights and sublayer input */
int mls_hc_post(const float *h, int64_t s, int64_t n, int64_t d, const float *post, const float *comb, const float *y,
                float *out, int threads);
int mls_v4_ffn(const float *h, int64_t s, int64_t n, int64_t d, const float *post_a, const float *comb_a,
               const float *y, const float *fn, const float *base, const float *scale, float eps, float norm_eps,
               int iters, const float *g, float eps_g, const mls_moe_block_t *moe, const int64_t *ids, float *out,
               int threads);
int mls_hc_pre(const float *h, int64_t s, int64_t n, int64_t d, const float *fn, const float *base,
               const float *scale, float eps, float norm_eps, int iters, float *post, float *comb, float *x,
               int threads);

/* indexer.c: a decode step's DSA top-k over index keys (the per-op native path's, and its tests'); bf16 1: the
   scores of q and the keys rounded to bf16 (the route's index_scoring "bf16"), 0 fp32. 0, -2 k outside [1, l],
   -3 Di over 1024 (a key's stack buffer), -4 out of memory */
int mls_index_topk(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const float *keys,
                   const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index,
                   uint8_t *sel_valid, int bf16, int threads);
int mls_index_topk8(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const uint8_t *codes,
                    const float *scales, const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k,
                    int64_t *sel_index, uint8_t *sel_valid, int bf16, int threads);
int mls_index_topk16(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const uint16_t *keys16,
                     int half, const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index,
                     uint8_t *sel_valid, int bf16, int threads);

/* decode_layer.c */
int mls_decode_layer(const mls_layer_t *ly, const mls_decode_step_t *st, const float *x, float *out,
                     const mls_rows_t *cache, const mls_rows_t *index_keys, int threads);
int mls_decode_layers(const mls_layer_t *const *layers, int64_t n, const mls_decode_step_t *st, const float *x,
                      float *out, const mls_rows_t *const *caches, const mls_rows_t *const *index_keys,
                      int64_t *failed, int threads);

/* rows8.c: the 8-bit cache's quantizer (cache/quantized_rows.py quantize), exposed for its tests */
int mls_quantize_rows(const float *x, int64_t t, int64_t ldx, int64_t q, int64_t block, int fp8, uint8_t *codes,
                      float *scales);
/* rows16.c: the 16-bit cache's rounding (torch's casts to float16 / bfloat16; half 1 / 2), exposed for its tests */
int mls_round16_rows(const float *x, int64_t t, int64_t width, int half, uint16_t *out);

/* types.c: a type's block (bytes, values) and which kernels take it (bit 0 decode, 1 fused dot, 2 int8 dot);
   -1 for a type without a decoder */
int mls_type_info(int type, int64_t *block_bytes, int64_t *block_values, int64_t *kernels);
/* the instruction set the kernels were built for: "avx512", "avx2" or "scalar" */
const char *mls_isa(void);
/* the int8 dot products' instructions: "avx512vnni", "avxvnni", "avx2" or "scalar" */
const char *mls_int8_isa(void);
/* x86/amx.c: whether the int8 products of many rows (16+ activation rows; Q4_K, Q6_K, and x86/amx_units.c's Q5_K,
   IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) run on AMX-INT8 tiles:
   1 yes, 0 a build without them, -errno the kernel refused the process the tile state */
int mls_int8_tiles(void);
/* x86/amx.c: the activation rows from which an int8 product on this type takes the tiles; 0 never */
int64_t mls_int8_tile_rows(int type);
/* int8.c: the activation rows from which an int8 product on this type runs on unpacked weight panels in this process
   (the row kernels' bits): x86/vnni_panels.c's 16-row panels with AVX512-VNNI (Q4_K, Q5_K, Q6_K, the i-quants),
   x86/avx2_panels.c's 8-row panels without it (the same types); 0 never (another type, or AMX tiles take it) */
int64_t mls_int8_panel_rows(int type);
/* int8.c: the panels' instructions, "avx512-vnni" or "avx2"; "" in a build without panels */
const char *mls_int8_panels_isa(void);
/* x86/amx_bf16.c: Q8_0 products of many rows on AMX-BF16 tiles: the int8 codes exact in bf16, each activation
   split into two bf16s (~2^-16 per product), block scales applied in fp32; y [m, ldy], x [m, ldx]. 0, -1 no bf16
   tiles here, -2 k not a multiple of 32, -4 out of memory */
int mls_q8_0_bf16_pairs(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                        int64_t row_bytes, float *y, int64_t ldy, int threads);
/* the grouped form: rows [starts[a], starts[a + 1]) of x [P, k] times expert experts[a] (w + experts[a] *
   expert_stride), into y [P, ldy] */
int mls_q8_0_bf16_pairs_grouped(const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                                int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                                float *y, int64_t ldy, int threads);
/* x86/int16_prefill.c, int16.c: products of many rows with int16 activations on AVX512-VNNI for the 32-value block types whose
   value is d times an integer code (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4): each activation an int16 code per 32-value
   block with an fp32 scale (~2^-16 of the block's largest per value), the integer sums exact, block scales applied in
   fp32; y [m, ldy], x [m, ldx]. 0, -1 a build without AVX512-VNNI, -2 k not a multiple of 32, -3 not such a type,
   -4 out of memory */
int mls_int16_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                   int64_t row_bytes, float *y, int64_t ldy, int threads);
int mls_int16_gemm_multi(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *const *w,
                         const int64_t *n, int64_t nw, int64_t row_bytes, float *const *y, const int64_t *ldy,
                         int threads);
/* the grouped form, as mls_q8_0_bf16_pairs_grouped */
int mls_int16_grouped(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads);
/* whether this build runs a type's products so (at every row count): 1 yes, 0 no (not such a type, or no AVX2) */
int mls_int16_takes(int type);
/* whether it runs a type's products of many rows on unpacked panels (AVX512-VNNI; prompts take them only there) */
int mls_int16_panels(int type);
/* the activation rows from which this process runs a type's int16 products on the AMX-INT8 tiles (the same bits:
   Q8_0, each code as two bytes); 0 where it never does (another type, no tiles) */
int64_t mls_int16_tile_rows(int type);
/* whether a decode product of this type takes int16 activations under an activation setting (mls_layer_t.int8): 1
   yes (the one-call layer and MoE block then run it so), 0 no; kernels/int16_prefill.py takes_rest is the holders' */
int mls_int16_in(int type, int64_t setting);
/* x86/amx_bf16_bmm.c: C_b [m, n] (fp32, rows ldc apart) = A_b [m, k] (bf16, rows lda apart) times Bm_b [k, n] given
   as pairs B_b (int32: (Bm[2p, j], Bm[2p + 1, j]); pair row p of columns j0 .. j0 + 15 at (j0 / 16) bj + p ldb),
   b < batch (strides sa, sb, sc in elements), fp32 sums on AMX-BF16 tiles, else by AVX512-BF16 dot products
   (x86/avx512_bf16.c). 0, -1 neither here, -2 m, n or k not a multiple of 32 */
int mls_bf16_bmm(const uint16_t *a, int64_t batch, int64_t m, int64_t k, int64_t lda, int64_t sa, const int32_t *bp,
                 int64_t n, int64_t ldb, int64_t bj, int64_t sb, float *c, int64_t ldc, int64_t sc, int threads);
/* P [b, g, m, n] bf16 = softmax of the scaled scores s [b, g, m, n] (fp32, overwritten) per row over the keys its
   request's mask [b, mq, nv] (bytes) allows; keys past nv and rows past mq 0; a NaN or +inf score it may read, or no
   key, makes the row NaN (x86/avx512_bf16.c). 0, -1 a build without AVX512-BF16 */
int mls_softmax_bf16(float *s, int64_t b, int64_t g, int64_t m, int64_t n, const uint8_t *mask, int64_t mq, int64_t nv,
                     uint16_t *p, int threads);
/* which unit runs mls_bf16_bmm here: 2 the AMX-BF16 tiles, 1 AVX512-BF16 dot products, 0 neither */
int mls_bf16_bmm_unit(void);
/* attention_pack.c: out [b g, mp, dp] bf16 = [bf(scale q0[t, gi]) | bf(scale q1[t, gi]) | 0] per request bi and query
   i < nq (t = rows[bi nq + i]; q0's d0 values at t st0 + gi sh0, q1's d1 at t st1 + gi sh1), rows past nq zero.
   0, -2 nq > mp or d0 + d1 > dp */
int mls_pack_queries_bf16(const float *q0, int64_t d0, int64_t st0, int64_t sh0, const float *q1, int64_t d1,
                          int64_t st1, int64_t sh1, const int64_t *rows, int64_t b, int64_t nq, int64_t g, float scale,
                          uint16_t *out, int64_t mp, int64_t dp, int threads);
/* attention_pack.c: K^T of a group of heads as pairs of bf16 [b g, lp / 16, dp / 2, 16] from k_nope (bf16, dn) and
   k_pe (fp32, dr; strides request, head, key), keys >= n zero; V as pairs [b g, lp / 2, dvp] (bf16, dv; keys >= n and
   columns >= dv zero; finite: a non-finite value 0). 0, -2 sizes that do not fit the padding */
int mls_pack_keys_bf16(const uint16_t *kn, int64_t dn, int64_t snb, int64_t sng, int64_t snl, const float *kp,
                       int64_t dr, int64_t spb, int64_t spg, int64_t spl, int64_t b, int64_t g, int64_t n,
                       int32_t *out, int64_t lp, int64_t dp, int threads);
int mls_pack_values_bf16(const uint16_t *v, int64_t dv, int64_t svb, int64_t svg, int64_t svl, int64_t b, int64_t g,
                         int64_t n, int finite, int32_t *out, int64_t lp, int64_t dvp, int threads);
/* whether the bf16 tiles run here: 1 yes, 0 a build without AMX-BF16, -errno the kernel refused the tile state */
int mls_bf16_tiles(void);

/* layout.c */
const mls_layout_entry_t *mls_layout(int64_t *n);
int mls_abi_version(void);

#endif

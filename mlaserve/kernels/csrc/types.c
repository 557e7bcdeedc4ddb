/* The weight types: one row of the table per type, with its block and the kernels that take it in this
   build (the ISA's where it has one: common.h MLS_SIMD). Every entry point looks a type up once per call,
   outside its loops; inside the kernels a type is a compile-time constant (the fused and int8 kernels are
   specialised per type), so the table costs nothing where the time goes. */

typedef struct {
    int64_t block_bytes, block_values; /* a block's stored bytes and the values it decodes to */
    row_fn decode;                     /* one row -> fp32 (ggml types), or 0 */
    scaled_row_fn decode_scaled;       /* one row with its scales apart (fp8, fp4), or 0 */
    fused_fn fused;                    /* decode-and-dot without a row buffer, or 0: decode, then dot */
    q8rows_fn int8;                    /* int8-activation rows (int8.c), or 0 */
    scaled_fused_fn fused_scaled;      /* decode-and-dot of a row with its scales apart (INT4), or 0 */
    int64_t bits;                      /* with int8: the weight's bits per value (what mls_layer_t.int8 caps);
                                          Q5_0 / Q5_1 are entered as 8, the class that stays exact under
                                          activations="auto" as Q8_0 does: on the ds32 Q4_K_M fixture their int8
                                          products move the logits 0.59x the file's own error, over the rule's
                                          1/2 (tests/gguf/test_gguf_int8_default.py); "int8" still takes them */
    int64_t act;                       /* with int8: its activations' block, 32 (Q8_0-style) or 256 (Q8_K-style) */
} mls_type_t;

/* the ISA's kernel where there is one, else the reference's */
#ifdef MLS_SIMD
#define ISA(simd, ref) simd
#else
#define ISA(simd, ref) ref
#endif

static const mls_type_t GGML_TYPES[MLS_GGML_TYPES] = {
    [MLS_F32] = {4, 1, row_f32, 0, fused_f32, 0},
    [MLS_Q4_0] = {18, 32, ISA(simd_q4_0, row_q4_0), 0, ISA(fused_q4_0, 0), q8rows_q4_0, 0, 4, 32},
    [MLS_Q4_1] = {20, 32, ISA(simd_q4_1, row_q4_1), 0, 0, q8rows_q4_1, 0, 4, 32},
    [MLS_Q5_0] = {22, 32, ISA(simd_q5_0, row_q5_0), 0, ISA(fused_q5_0, 0), q8rows_q5_0, 0, 8, 32}, /* 8: below */
    [MLS_Q5_1] = {24, 32, ISA(simd_q5_1, row_q5_1), 0, 0, q8rows_q5_1, 0, 8, 32}, /* 8: below */
    [MLS_Q8_0] = {34, 32, ISA(simd_q8_0, row_q8_0), 0, ISA(fused_q8_0, 0), q8rows_q8_0, 0, 8, 32},
    [MLS_Q2_K] = {84, 256, row_q2_k, 0, 0, 0},
    [MLS_Q3_K] = {110, 256, row_q3_k, 0, 0, 0},
    [MLS_Q4_K] = {144, 256, ISA(simd_q4_k, row_q4_k), 0, ISA(fused_q4_k, 0), q8rows_q4_k, 0, 4, 256},
    [MLS_Q5_K] = {176, 256, ISA(simd_q5_k, row_q5_k), 0, 0, q8rows_q5_k, 0, 5, 256},
    [MLS_Q6_K] = {210, 256, ISA(simd_q6_k, row_q6_k), 0, ISA(fused_q6_k, 0), q8rows_q6_k, 0, 6, 256},
    [MLS_IQ2_XXS] = {66, 256, row_iq2_xxs, 0, ISA(fused_iq2_xxs, 0), q8rows_iq2_xxs, 0, 2, 256},
    [MLS_IQ2_XS] = {74, 256, row_iq2_xs, 0, ISA(fused_iq2_xs, 0), q8rows_iq2_xs, 0, 2, 256},
    [MLS_IQ3_XXS] = {98, 256, row_iq3_xxs, 0, ISA(fused_iq3_xxs, 0), q8rows_iq3_xxs, 0, 3, 256},
    [MLS_IQ1_S] = {50, 256, row_iq1_s, 0, ISA(fused_iq1_s, 0), q8rows_iq1_s, 0, 1, 256},
    [MLS_IQ4_NL] = {18, 32, ISA(simd_iq4_nl, row_iq4_nl), 0, ISA(fused_iq4_nl, 0), q8rows_iq4_nl, 0, 4, 32},
    [MLS_IQ3_S] = {110, 256, row_iq3_s, 0, ISA(fused_iq3_s, 0), q8rows_iq3_s, 0, 3, 256},
    [MLS_IQ2_S] = {82, 256, row_iq2_s, 0, ISA(fused_iq2_s, 0), q8rows_iq2_s, 0, 2, 256},
    [MLS_IQ4_XS] = {136, 256, ISA(simd_iq4_xs, row_iq4_xs), 0, ISA(fused_iq4_xs, 0), q8rows_iq4_xs, 0, 4, 256},
    [MLS_IQ1_M] = {56, 256, row_iq1_m, 0, ISA(fused_iq1_m, 0), q8rows_iq1_m, 0, 1, 256},
    [MLS_TQ1_0] = {54, 256, row_tq1_0, 0, ISA(fused_tq1_0, 0), 0},
    [MLS_TQ2_0] = {66, 256, row_tq2_0, 0, ISA(fused_tq2_0, 0), 0},
    [MLS_MXFP4] = {17, 32, ISA(simd_mxfp4, row_mxfp4), 0, ISA(fused_mxfp4, 0), 0},
};
static const mls_type_t FP8_E4M3 = {1, 1, 0, ISA(simd_fp8, row_fp8), 0, 0};
static const mls_type_t FP4_E2M1 = {1, 2, 0, ISA(simd_e2m1, row_e2m1), 0, 0, 0};
static const mls_type_t INT4_PACKED = {1, 2, 0, ISA(simd_int4, row_int4), 0, 0, ISA(fused_int4, ref_fused_int4)};
static const mls_type_t NO_TYPE = {0, 0, 0, 0, 0, 0, 0};
#undef ISA

static inline const mls_type_t *type_of(int type) {
    if (type >= 0 && type < MLS_GGML_TYPES) return &GGML_TYPES[type];
    switch (type) {
    case MLS_FP8_E4M3: return &FP8_E4M3;
    case MLS_FP4_E2M1: return &FP4_E2M1;
    case MLS_INT4_PACKED: return &INT4_PACKED;
    default: return &NO_TYPE;
    }
}

/* a ggml type's row decoder, or 0 */
static inline row_fn ggml_row(int type) { return type_of(type)->decode; }

/* The fused kernel for a type, or 0 (then: decode the row into a buffer, dot it with each x row). */
static inline fused_fn fused_row(int type) { return type_of(type)->fused; }

/* the int8-activation row kernel for a type, or 0 */
static inline q8rows_fn q8rows(int type) { return type_of(type)->int8; }

/* The same under a layer's or block's int8 setting (mls_layer_t.int8): 0 never; else the widest weight (bits
   per value) whose products take int8 activations: 8 every type with an int8 kernel, 6 those of 6 bits or fewer
   (activations="auto": Q8_0 stays exact) */
static inline q8rows_fn q8rows_in(int type, int64_t int8) {
    const mls_type_t *t = type_of(type);
    const int64_t cap = int8 & MLS_INT8_CAP; /* the setting's int16 flag is x86/int16_prefill.c's */
    return cap && t->bits <= cap ? t->int8 : 0;
}

int mls_type_info(int type, int64_t *block_bytes, int64_t *block_values, int64_t *kernels) {
    const mls_type_t *t = type_of(type);
    if (!t->decode && !t->decode_scaled) return -1;
    *block_bytes = t->block_bytes;
    *block_values = t->block_values;
    *kernels = 1 | (t->fused || t->fused_scaled ? 2 : 0) | (t->int8 ? 4 : 0);
    return 0;
}

/* the int8 dot products' instructions in this build: "avx512vnni" (vpdpbusd on 256-bit vectors), "avxvnni",
   "avx2" (vpmaddubsw + vpmaddwd) or "scalar" (the K-quants' int8 products come out the same in each: x86/avx2.c) */
const char *mls_int8_isa(void) {
#if defined(MLS_SIMD) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512vnni";
#elif defined(MLS_SIMD) && defined(__AVXVNNI__)
    return "avxvnni";
#elif defined(MLS_SIMD)
    return "avx2";
#else
    return "scalar";
#endif
}

/* The instruction set this build's kernels were compiled for (common.h): what the type table above picked */
const char *mls_isa(void) {
#if defined(MLS_AVX512)
    return "avx512";
#elif defined(MLS_SIMD)
    return "avx2";
#else
    return "scalar";
#endif
}

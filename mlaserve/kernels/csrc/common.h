/* What every kernel file shares: the headers, the limits, the build's ISA (which decides the kernels the type
   table picks: types.c), the row prefetch, fp16 scales, and the kernels' function shapes.

   Compiled with -ffp-contract=off so that no a*b-c of a decoder becomes a fused multiply-add;
   the dot products use explicit FMA intrinsics where AVX2 is there. */
#ifndef MLS_COMMON_H
#define MLS_COMMON_H

#include "mls.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The ISA of the build (-march=native, or a narrower target the tests build too): x86/avx2.c's kernels need
   AVX2 and F16C, x86/avx512.c's AVX-512F on top; without them the reference kernels (ref/) run. An arm/neon.c
   would sit beside x86/ under its own macro here. */
#if defined(__AVX2__) && defined(__F16C__)
#define MLS_SIMD 1
#if defined(__AVX512F__)
#define MLS_AVX512 1
#endif
#endif

#define MAX_K 65536
#define MAX_ROPE 1024 /* longest rope slice (qk_rope_head_dim) the glue kernels take */
#define ROW_RUN 8 /* weight rows per parallel work item where items would otherwise be single short rows */
/* Software prefetch. Weights stream from DRAM once per step and the hardware prefetcher alone kept a Q8_0 GEMV at
   ~14 GB/s on 2 threads where the memory reads ~27 GB/s. The fused row kernels (x86/avx2.c, x86/avx512.c) keep a
   stream PREFETCH_AHEAD bytes in front of the block they read: one line asked for per 64 bytes consumed
   (prefetch_stream, called per block; 4 KiB ahead measured best of 0.5-8 KiB; 2-core Xeon, AVX-512). The
   rows a thread takes next lie there, so the stream runs on across rows; F32 rows (dot.c fused_f32) stream too.
   The first scheme asked for a whole row's lines at once when the row began (prefetch_row, still used by the
   decode-then-dot paths: Q4_1, Q5_1, Q2_K, Q3_K, Q5_K with float activations): on rows of 5-11 KB (K = 5120, 10240) those bursts outran the line-fill buffers and the GEMV read 9-11
   GB/s against 13-17 streamed (benchmarks/README.md, "prefetch"). A prefetch never faults, past the end of a
   matrix too. */
#define PREFETCH_AHEAD 4096
static inline void prefetch_row(const uint8_t *row, int64_t row_bytes) {
    const char *p = (const char *)row + PREFETCH_AHEAD;
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}
/* the stream: next is the first line not yet asked for; returns it after asking up to at + PREFETCH_AHEAD */
static inline const char *prefetch_stream(const char *next, const uint8_t *at) {
    for (; next < (const char *)at + PREFETCH_AHEAD; next += 64) __builtin_prefetch(next, 0, 3);
    return next;
}

/* the bytes [p, p + bytes) into L2, a line at a time: the run a kernel reads next (the side-by-side kernels' and
   panels' next 8 weight rows, which lie in one run; their own reads take 8 rows row_bytes apart, a pattern the
   hardware prefetchers do not run ahead of) */
static inline void prefetch_l2(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 1);
}
/* the same spread over a kernel's blocks, for the `rows` rows after the ones at w (8 on AVX2, 16 on AVX-512): pf the
   first line of that run (from w + rows row_bytes) not yet asked for; returns it after asking up to `step` bytes a
   block through block blk */
static inline const char *prefetch_next_rows(const char *pf, const uint8_t *w, int64_t rows, int64_t row_bytes,
                                             int64_t blk, int64_t step) {
    for (const char *end = (const char *)w + rows * row_bytes + (blk + 1) * step; pf < end; pf += 64)
        __builtin_prefetch(pf, 0, 1);
    return pf;
}

static inline float f16(const uint8_t *p) {
#ifdef __F16C__
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v);
#endif
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-08f; /* m * 2^-24, exact */
        return s ? -f : f;
    }
    bits = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* MXFP4's e8m0 scale byte as ggml's ggml_e8m0_to_fp32_half: 2^(e - 128) from its bits (e < 2: fp32 subnormals) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* the kernels' shapes, each type's own in the type table (types.c) */
typedef void (*row_fn)(const uint8_t *, float *, int64_t); /* decode one row of k values */
/* decode one row whose fp32 scales lie apart (fp8 blocks of bk columns, fp4 groups of bk values) */
typedef void (*scaled_row_fn)(const uint8_t *, const float *, int64_t, float *, int64_t);
/* one weight row times m activation rows: (w, x, ldx, m, k, y, ldy) */
typedef void (*fused_fn)(const uint8_t *, const float *, int64_t, int64_t, int64_t, float *, int64_t);
/* the same for a row whose fp32 scales lie apart, one per `group` columns: (w, srow, group, x, ldx, m, k, y, ldy) */
typedef void (*scaled_fused_fn)(const uint8_t *, const float *, int64_t, const float *, int64_t, int64_t, int64_t,
                                float *, int64_t);
/* the same with int8 activations: (w, xq, xd, m, k, y, ldy) */
typedef void (*q8rows_fn)(const uint8_t *, const int8_t *, const float *, int64_t, int64_t, float *, int64_t);

/* int8 activations (int8.c): a row of k values becomes k int8 codes and k / 32 float slots. Q8_0-style (the
   32-value types Q8_0, Q4_0): slot b holds block b's scale. Q8_K-style (the K-quants): the 8 slots of each
   256-value super-block hold a q8k_meta: its scale and the sums of its codes per 32 values (what a K-quant's
   sub-block mins multiply). One buffer shape for both, so every caller sizes and offsets it alike. */
typedef struct {
    float d;          /* the super-block's scale: x ~ d * q (llama.cpp's q8_K: d = -max / 127, signed) */
    int16_t bsum[8];  /* sum of the 32 codes of sub-block j (|sum| <= 32 * 127) */
    int32_t pad[3];
} q8k_meta;
#define Q8K_SLOTS 8 /* floats of xd per super-block: sizeof(q8k_meta) / sizeof(float) */

static inline float silu_mul(float g, float u) { return (g / (1.0f + expf(-g))) * u; }
/* DeepSeek-V4's clamped SwiGLU: silu(min(g, limit)) * clamp(u, -limit, limit); limit INFINITY is silu_mul. A NaN
   stays NaN, as torch's clamp keeps it (each test is false for NaN) */
static inline float silu_mul_clamped(float g, float u, float limit) {
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    return silu_mul(g, u);
}

#endif

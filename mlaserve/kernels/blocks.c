/* Matrix products on weights kept in their stored block formats, for small batches (decode).

   y[m, n] = sum_k x[m, k] * W[n, k], W given as raw rows of ggml blocks (Q4_0 ... Q6_K), as
   float8 e4m3 values with block scales, or as packed e2m1 (FP4) codes with group scales. Each weight
   row is decoded into an fp32 row buffer with exactly the float operations of the reference
   dequantizers (mlaserve/gguf/quants.py, mlaserve/quant/fp8_block.py, fp4_group.py), in the same
   order, so the decoded values are bit-identical;
   only the summation order of the dot products differs from "dequantize, then GEMM". Q8_0, Q4_0, Q5_0,
   Q4_K, Q6_K (the commonest decode types) and F32 rows skip the buffer: see "fused decode-and-dot" below.
   Compiled with -ffp-contract=off so that no a*b-c of a decoder becomes a fused multiply-add;
   the dot products use explicit FMA intrinsics where AVX2 is there.

   Threads: OpenMP over output rows (the process's one OpenMP runtime: torch's, loaded first), as many
   as the caller passes (torch.get_num_threads(): an OpenMP thread's own default would ignore
   torch.set_num_threads called from another thread, e.g. the server's engine thread).
   Return value: 0; -1 for a type a function does not take, -2 for rows longer than MAX_K (or, for the
   int8-activation kernels, not whole 32-value blocks), -3 for router settings out of range, -4 when
   memory cannot be allocated, -5 for a cache slot outside the cache; -2 also for a rope slice longer than MAX_ROPE or odd. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MLS_FP8_E4M3 1000
#define MLS_FP4_E2M1 1001 /* two e2m1 codes per byte (low nibble first), one fp32 scale per row and group */
#define MAX_K 65536
#define MAX_ROPE 1024 /* longest rope slice (qk_rope_head_dim) the glue kernels take */
#define ROW_RUN 8 /* weight rows per parallel work item where items would otherwise be single short rows */
/* Software prefetch: each weight row, when its turn comes, asks for the bytes PREFETCH_AHEAD further on (the
   rows a thread takes next lie there). Weights stream from DRAM once per step and the hardware prefetcher alone
   kept a Q8_0 GEMV at ~14 GB/s on 2 threads where the memory reads ~27 GB/s; with this, ~21 GB/s (4 KiB ahead
   measured best of 0.5-8 KiB; 2-core Xeon, AVX-512). A prefetch never faults, past the end of a matrix too. */
#define PREFETCH_AHEAD 4096
static inline void prefetch_row(const uint8_t *row, int64_t row_bytes) {
    const char *p = (const char *)row + PREFETCH_AHEAD;
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
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

/* ---------------------------------------------------------------- one row of K values */

static void row_q8_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 34, y += 32) {
        const float d = f16(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
    }
}

static void row_q4_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 18, y += 32) {
        const float d = f16(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((q[j] & 0x0F) - 8);
            y[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

static void row_q4_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 20, y += 32) {
        const float d = f16(b), m = f16(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(q[j] & 0x0F) + m;
            y[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}

static inline uint32_t u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void row_q5_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 22, y += 32) {
        const float d = f16(b);
        const uint32_t qh = u32(b + 2);
        const uint8_t *q = b + 6;
        for (int j = 0; j < 16; j++) {
            int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
            int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void row_q5_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 24, y += 32) {
        const float d = f16(b), m = f16(b + 2);
        const uint32_t qh = u32(b + 4);
        const uint8_t *q = b + 8;
        for (int j = 0; j < 16; j++) {
            int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
            int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

static void row_q2_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 84, y += 256) {
        const uint8_t *sc = b, *qs = b + 16;
        const float d = f16(b + 80), dmin = f16(b + 82);
        float dl[16], ml[16];
        for (int j = 0; j < 16; j++) {
            dl[j] = d * (float)(sc[j] & 0x0F);
            ml[j] = dmin * (float)(sc[j] >> 4);
        }
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, s = (t >> 5) & 3, l = t & 31;
            int q = (qs[h * 32 + l] >> (2 * s)) & 3;
            y[t] = dl[t >> 4] * (float)q - ml[t >> 4];
        }
    }
}

static void row_q3_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 110, y += 256) {
        const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
        const float d = f16(b + 108);
        float dl[16];
        for (int j = 0; j < 16; j++) {
            int lo = (sc[j & 7] >> (4 * (j >> 3))) & 0x0F;
            int hi = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
            dl[j] = d * (float)((lo | (hi << 4)) - 32);
        }
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, s = (t >> 5) & 3, l = t & 31;
            int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
            int qh = (hm[l] >> (t >> 5)) & 1;
            y[t] = dl[t >> 4] * (float)(ql - ((qh ^ 1) << 2));
        }
    }
}

/* Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes (ggml get_scale_min_k4) */
static void k_scale_min(const uint8_t *s, float d, float dmin, float *dd, float *dm) {
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
            mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        }
        dd[j] = d * (float)sc;
        dm[j] = dmin * (float)mn;
    }
}

static void row_q4_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 144, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                for (int l = 0; l < 32; l++)
                    y[j * 32 + l] = dd[j] * (float)((qs[c * 32 + l] >> (4 * h)) & 0x0F) - dm[j];
            }
    }
}

static void row_q5_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 176, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        const uint8_t *qh = b + 16, *ql = b + 48;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                for (int l = 0; l < 32; l++) {
                    int q = ((ql[c * 32 + l] >> (4 * h)) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                    y[j * 32 + l] = dd[j] * (float)q - dm[j];
                }
            }
    }
}

static void row_q6_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        float dd[16];
        for (int j = 0; j < 16; j++) dd[j] = d * (float)sc[j];
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, r = t & 127;
            int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0F;
            int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
            y[t] = dd[t >> 4] * (float)((lo | (hi << 4)) - 32);
        }
    }
}

/* float8 e4m3fn -> fp32, every code (exact) */
static float E4M3[256];
static int e4m3_ready = 0;

static void e4m3_init(void) {
    for (int c = 0; c < 256; c++) {
        int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
        float v;
        if (e == 15 && m == 7) {
            uint32_t nan = 0x7fc00000u;
            memcpy(&v, &nan, 4);
        } else if (e == 0) {
            v = (float)m / 512.0f; /* m * 2^-9 */
        } else {
            v = (1.0f + (float)m / 8.0f);
            for (int x = e; x > 7; x--) v *= 2.0f;
            for (int x = e; x < 7; x++) v *= 0.5f;
        }
        E4M3[c] = s ? -v : v;
    }
    e4m3_ready = 1;
}

/* one fp8 row: scale row srow [kb] with blocks of bk columns */
__attribute__((unused)) static void row_fp8(const uint8_t *q, const float *srow, int64_t bk, float *y, int64_t k) {
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += bk, blk++) {
        const float s = srow[blk];
        const int64_t c1 = c0 + bk < k ? c0 + bk : k;
        for (int64_t c = c0; c < c1; c++) y[c] = E4M3[q[c]] * s;
    }
}


/* e2m1 codes -> values (mlaserve/quant/fp4_group.py E2M1_VALUES) times the row's group scales:
   value * scale, one rounding, as the reference's table lookup times the expanded scale */
static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__attribute__((unused)) static void row_e2m1(const uint8_t *q, const float *srow, int64_t group, float *y, int64_t k) {
    for (int64_t c = 0; c < k / 2; c++) {
        const uint8_t b = q[c];
        y[2 * c] = E2M1[b & 15] * srow[(2 * c) / group];
        y[2 * c + 1] = E2M1[b >> 4] * srow[(2 * c + 1) / group];
    }
}

/* ---------------------------------------------------------------- AVX2 decoders
   The same values as the scalar ones above (same products, same order), 8 lanes at a time. */
#if defined(__AVX2__) && defined(__F16C__)
#define MLS_SIMD 1

/* 8 signed bytes -> 8 floats */
static inline __m256 i8x8(const __m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* 32 int8 lanes of v -> y[0..31] = float(v) * d */
static inline void store32_mul(__m256i v, __m256 d, float *y) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_ps(y, _mm256_mul_ps(i8x8(lo), d));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(i8x8(_mm_srli_si128(lo, 8)), d));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(i8x8(hi), d));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(i8x8(_mm_srli_si128(hi, 8)), d));
}

/* y = d * float(v) + m (Q4_1, Q5_1: "(d * q) + m") */
static inline void store32_mul_add(__m256i v, __m256 d, __m256 m, float *y) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(d, i8x8(lo)), m));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_mul_ps(d, i8x8(_mm_srli_si128(lo, 8))), m));
    _mm256_storeu_ps(y + 16, _mm256_add_ps(_mm256_mul_ps(d, i8x8(hi)), m));
    _mm256_storeu_ps(y + 24, _mm256_add_ps(_mm256_mul_ps(d, i8x8(_mm_srli_si128(hi, 8))), m));
}

/* y = dd * float(v) - dm for 32 lanes (K-quants: "(d * sc) * q - dmin * m") */
static inline void store32_mul_sub(__m256i v, __m256 dd, __m256 dm, float *y) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    _mm256_storeu_ps(y, _mm256_sub_ps(_mm256_mul_ps(dd, i8x8(lo)), dm));
    _mm256_storeu_ps(y + 8, _mm256_sub_ps(_mm256_mul_ps(dd, i8x8(_mm_srli_si128(lo, 8))), dm));
    _mm256_storeu_ps(y + 16, _mm256_sub_ps(_mm256_mul_ps(dd, i8x8(hi)), dm));
    _mm256_storeu_ps(y + 24, _mm256_sub_ps(_mm256_mul_ps(dd, i8x8(_mm_srli_si128(hi, 8))), dm));
}

/* 16 packed bytes -> 32 lanes: low nibbles, then high nibbles (the Q4_0/Q4_1/Q5 order) */
static inline __m256i nibbles32(const uint8_t *q) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

/* bit j of a 32-bit word -> 0xFF in byte lane j */
static inline __m256i bits32(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static void simd_q8_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 34, y += 32) {
        const __m256 d = _mm256_set1_ps(f16(b));
        for (int j = 0; j < 4; j++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
            _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(i8x8(q), d));
        }
    }
}

static void simd_q4_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 18, y += 32)
        store32_mul(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), _mm256_set1_ps(f16(b)), y);
}

static void simd_q4_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 20, y += 32)
        store32_mul_add(nibbles32(b + 4), _mm256_set1_ps(f16(b)), _mm256_set1_ps(f16(b + 2)), y);
}

static void simd_q5_0(const uint8_t *b, float *y, int64_t k) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < k / 32; i++, b += 22, y += 32) {
        __m256i q = _mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bits32(u32(b + 2)), sixteen));
        store32_mul(_mm256_sub_epi8(q, sixteen), _mm256_set1_ps(f16(b)), y);
    }
}

static void simd_q5_1(const uint8_t *b, float *y, int64_t k) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < k / 32; i++, b += 24, y += 32) {
        __m256i q = _mm256_or_si256(nibbles32(b + 8), _mm256_and_si256(bits32(u32(b + 4)), sixteen));
        store32_mul_add(q, _mm256_set1_ps(f16(b)), _mm256_set1_ps(f16(b + 2)), y);
    }
}

static void simd_q4_k(const uint8_t *b, float *y, int64_t k) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < k / 256; i++, b += 144, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            store32_mul_sub(_mm256_and_si256(raw, m4), _mm256_set1_ps(dd[2 * c]), _mm256_set1_ps(dm[2 * c]),
                            y + 64 * c);
            store32_mul_sub(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), _mm256_set1_ps(dd[2 * c + 1]),
                            _mm256_set1_ps(dm[2 * c + 1]), y + 64 * c + 32);
        }
    }
}

static void simd_q5_k(const uint8_t *b, float *y, int64_t k) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < k / 256; i++, b += 176, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c));
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                __m256i lo = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                __m256i hb = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
                __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
                store32_mul_sub(q, _mm256_set1_ps(dd[j]), _mm256_set1_ps(dm[j]), y + 32 * j);
            }
        }
    }
}

/* 8 lanes of 16 int8 values (lane offset 0 or 8 of a 128-bit half) times one scale */
static inline void store16_mul(__m128i v, float s, float *y) {
    const __m256 d = _mm256_set1_ps(s);
    _mm256_storeu_ps(y, _mm256_mul_ps(d, i8x8(v)));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(d, i8x8(_mm_srli_si128(v, 8))));
}

/* Q6_K: the 32 codes (q - 32, as int8) of group g (0..3) of a 128-value half from its 64 low-nibble
   bytes (ql0, ql1) and 32 high-bit bytes (qh) */
static inline __m256i q6k_codes(__m256i ql0, __m256i ql1, __m256i qh, int g) {
    const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(g & 1 ? ql1 : ql0, 4) : (g & 1 ? ql1 : ql0),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

static void simd_q6_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 210, y += 256) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i q = q6k_codes(ql0, ql1, qh, g);
                const int t = 128 * h + 32 * g;
                store16_mul(_mm256_castsi256_si128(q), d * (float)sc[t >> 4], y + t);
                store16_mul(_mm256_extracti128_si256(q, 1), d * (float)sc[(t >> 4) + 1], y + t + 16);
            }
        }
    }
}

/* e2m1 codes, 32 (16 bytes) at a time within one scale group: the magnitude from a byte table of
   2 * |value| (exact small integers), halved (exact), the code's sign bit set on the float (so -0.0
   stays -0.0), times the group's scale: the reference's value * scale, one rounding. */
static void simd_e2m1(const uint8_t *q, const float *srow, int64_t group, float *y, int64_t k) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12);
    const __m128i m4 = _mm_set1_epi8(0x0F), m8 = _mm_set1_epi8(0x08);
    const __m256 half = _mm256_set1_ps(0.5f);
    int64_t c = 0;
    for (; c + 32 <= k && (c % group) + 32 <= group; c += 32) {
        const __m256 s = _mm256_set1_ps(srow[c / group]);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + c / 2));
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m128i codes[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)}; /* value order */
        for (int h = 0; h < 2; h++) {
            const __m128i mag = _mm_shuffle_epi8(table, codes[h]);
            const __m128i sgn = _mm_and_si128(codes[h], m8);
            for (int p = 0; p < 2; p++) {
                const __m128i m8b = p ? _mm_srli_si128(mag, 8) : mag, s8b = p ? _mm_srli_si128(sgn, 8) : sgn;
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8b)), half);
                v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(s8b), 28)));
                _mm256_storeu_ps(y + c + 16 * h + 8 * p, _mm256_mul_ps(v, s));
            }
        }
    }
    for (; c < k; c += 2) { /* a group narrower than 32 or a tail: the scalar decoder's arithmetic */
        const uint8_t b = q[c / 2];
        y[c] = E2M1[b & 15] * srow[c / group];
        y[c + 1] = E2M1[b >> 4] * srow[(c + 1) / group];
    }
}

/* e4m3 -> fp16 bits of Q * 2^-8 (quant/fp8_block.py explains the trick), 8 at a time */
static void simd_fp8(const uint8_t *q, const float *srow, int64_t bk, float *y, int64_t k) {
    const __m128i mask = _mm_set1_epi16((short)0xBF80);
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += bk, blk++) {
        const float s = srow[blk] * 256.0f;
        const __m256 vs = _mm256_set1_ps(s);
        const int64_t c1 = c0 + bk < k ? c0 + bk : k;
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) {
            __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(q + c)));
            h = _mm_and_si128(_mm_slli_epi16(h, 7), mask);
            _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_cvtph_ps(h), vs));
        }
        for (; c < c1; c++) y[c] = E4M3[q[c]] * srow[blk];
    }
}
#endif

typedef void (*row_fn)(const uint8_t *, float *, int64_t);

/* F32 rows (ggml type 0: small matrices a GGUF keeps unquantized), for the one-call layers: the row as it is */
static void row_f32(const uint8_t *b, float *y, int64_t k) { memcpy(y, b, sizeof(float) * (size_t)k); }

static row_fn ggml_row(int type) {
    if (type == 0) return row_f32;
#ifdef MLS_SIMD
    switch (type) {
    case 2: return simd_q4_0;
    case 3: return simd_q4_1;
    case 6: return simd_q5_0;
    case 7: return simd_q5_1;
    case 8: return simd_q8_0;
    case 12: return simd_q4_k;
    case 13: return simd_q5_k;
    case 14: return simd_q6_k;
    default: break;
    }
#endif
    switch (type) {
    case 2: return row_q4_0;
    case 3: return row_q4_1;
    case 6: return row_q5_0;
    case 7: return row_q5_1;
    case 8: return row_q8_0;
    case 10: return row_q2_k;
    case 11: return row_q3_k;
    case 12: return row_q4_k;
    case 13: return row_q5_k;
    case 14: return row_q6_k;
    default: return 0;
    }
}

/* ---------------------------------------------------------------- dot products */

static inline float dot(const float *w, const float *x, int64_t k) {
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; i < k; i++) s += w[i] * x[i];
    return s;
#else
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) {
        s0 += w[i] * x[i];
        s1 += w[i + 1] * x[i + 1];
        s2 += w[i + 2] * x[i + 2];
        s3 += w[i + 3] * x[i + 3];
    }
    for (; i < k; i++) s0 += w[i] * x[i];
    return (s0 + s1) + (s2 + s3);
#endif
}

/* ---------------------------------------------------------------- fused decode-and-dot (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
   For the commonest decode types the row is not decoded into a buffer: each block's codes are
   converted to float once, multiplied into up to FUSED_ROWS activation rows, and the block scale
   is applied to the block's partial sum: y += d * sum_j(q_j * x_j) instead of sum_j((d * q_j) * x_j).
   That is a different rounding of the same exact sum, inside the same fp32 bound as any summation
   order (|y - y_exact| <= (K + 2) u sum_j |d q_j x_j|); about half the instructions per weight. */
#ifdef MLS_SIMD
#define FUSED_ROWS 4

static inline float hsum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* acc[i] += d * (w0 x[i, 0:8] + w1 x[i, 8:16] + w2 x[i, 16:24] + w3 x[i, 24:32]) for i < mr */
#define FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, xb, ldx)                                    \
    for (int i = 0; i < (mr); i++) {                                                         \
        const float *xi = (xb) + i * (ldx);                                                  \
        __m256 s = _mm256_mul_ps((w0), _mm256_loadu_ps(xi));                                 \
        s = _mm256_fmadd_ps((w1), _mm256_loadu_ps(xi + 8), s);                               \
        s = _mm256_fmadd_ps((w2), _mm256_loadu_ps(xi + 16), s);                              \
        s = _mm256_fmadd_ps((w3), _mm256_loadu_ps(xi + 24), s);                              \
        (acc)[i] = _mm256_fmadd_ps((d), s, (acc)[i]);                                        \
    }

/* The blocks whose value is d * code with 32 exact integer codes: Q8_0 (the bytes), Q4_0 (nibble - 8), Q5_0
   (nibble with the fifth bit from qh, - 16). d comes out of the block's sum exactly. */
static inline __m256i q5_0_codes(const uint8_t *b) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bits32(u32(b + 2)), sixteen)), sixteen);
}

/* A block's 32 codes as 16-value halves (g[0]: values 0..15, g[1]: 16..31), with the loads and shuffles each type
   needs and no more (a 256-bit load split again costs a shuffle per half: measured 8-13% at one row) */
static inline void block_codes16(const uint8_t *b, const int type, __m128i g[2]) {
    if (type == 8) {
        g[0] = _mm_loadu_si128((const __m128i *)(b + 2));
        g[1] = _mm_loadu_si128((const __m128i *)(b + 18));
    } else if (type == 2) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2)), m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
        g[0] = _mm_sub_epi8(_mm_and_si128(raw, m4), eight);
        g[1] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), eight);
    } else {
        const __m256i q = q5_0_codes(b);
        g[0] = _mm256_castsi256_si128(q);
        g[1] = _mm256_extracti128_si256(q, 1);
    }
}

/* the same as four 8-value groups, each in the low 8 bytes of g[j] (Q8_0 loads them straight from the block) */
static inline void block_codes8(const uint8_t *b, const int type, __m128i g[4]) {
    if (type == 8) {
        for (int j = 0; j < 4; j++) g[j] = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
        return;
    }
    __m128i h[2];
    block_codes16(b, type, h);
    g[0] = h[0], g[1] = _mm_srli_si128(h[0], 8), g[2] = h[1], g[3] = _mm_srli_si128(h[1], 8);
}

static inline int64_t block_bytes(const int type) { return type == 8 ? 34 : type == 2 ? 18 : 22; }

/* one kernel for the three types (type is a constant where it is inlined, so each is specialised) */
static inline __attribute__((always_inline)) void fused_codes_mr(const uint8_t *b, const int type, const float *x,
                                                                 int64_t ldx, const int mr, int64_t k, float *y,
                                                                 int64_t ldy) {
    __m256 acc[8]; /* the row-chunk switch below names chunks up to 7 rows */
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 32; blk++, b += block_bytes(type)) {
        const __m256 d = _mm256_set1_ps(f16(b));
        __m128i g[4];
        block_codes8(b, type, g);
        const __m256 w0 = i8x8(g[0]), w1 = i8x8(g[1]), w2 = i8x8(g[2]), w3 = i8x8(g[3]);
        FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, x + blk * 32, ldx)
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* name(b, x, ldx, mr, k, y, ldy): the codes kernel of one type, in the shape FUSED_ROW_FN takes */
#define CODES_MR(name, kernel, type)                                                                          \
    static inline __attribute__((always_inline)) void name(const uint8_t *b, const float *x, int64_t ldx,     \
                                                           const int mr, int64_t k, float *y, int64_t ldy) { \
        kernel(b, (type), x, ldx, mr, k, y, ldy);                                                             \
    }
CODES_MR(fused_q8_0_mr, fused_codes_mr, 8)
CODES_MR(fused_q4_0_mr, fused_codes_mr, 2)
CODES_MR(fused_q5_0_mr, fused_codes_mr, 6)

/* One weight row (raw blocks b) times m activation rows (x, stride ldx) -> y[i * ldy], in chunks of `chunk`
   rows (FUSED_ROWS = 4 for AVX2, 8 for AVX-512); the chunk size is a constant in each call so the accumulators
   stay in registers. */
#define FUSED_ROW_FN(name, kernel, bytes, chunk)                                                      \
    static void name(const uint8_t *b, const float *x, int64_t ldx, int64_t m, int64_t k, float *y,      \
                     int64_t ldy) {                                                                   \
        int64_t i = 0;                                                                                \
        prefetch_row(b, (bytes));                                                                     \
        for (; i + (chunk) <= m; i += (chunk)) kernel(b, x + i * ldx, ldx, (chunk), k, y + i * ldy, ldy); \
        switch (m - i) {                                                                              \
        case 7: kernel(b, x + i * ldx, ldx, 7, k, y + i * ldy, ldy); break;                           \
        case 6: kernel(b, x + i * ldx, ldx, 6, k, y + i * ldy, ldy); break;                           \
        case 5: kernel(b, x + i * ldx, ldx, 5, k, y + i * ldy, ldy); break;                           \
        case 4: kernel(b, x + i * ldx, ldx, 4, k, y + i * ldy, ldy); break;                           \
        case 3: kernel(b, x + i * ldx, ldx, 3, k, y + i * ldy, ldy); break;                           \
        case 2: kernel(b, x + i * ldx, ldx, 2, k, y + i * ldy, ldy); break;                           \
        case 1: kernel(b, x + i * ldx, ldx, 1, k, y + i * ldy, ldy); break;                           \
        default: break;                                                                               \
        }                                                                                             \
    }
/* Q6_K: super-blocks of 256 values, 16-value groups with their own int8 scale: d * sc is applied to
   each 16-value partial sum (the reference decodes (d * sc) * q). */
static inline __attribute__((always_inline)) void fused_q6_k_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                const int mr, int64_t k, float *y, int64_t ldy) {
    __m256 acc[8]; /* the row-chunk switch below names chunks up to 7 rows */
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++, b += 210) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i q = q6k_codes(ql0, ql1, qh, g);
                const int t = 128 * h + 32 * g;
                const __m128i qa = _mm256_castsi256_si128(q), qb = _mm256_extracti128_si256(q, 1);
                const __m256 w0 = i8x8(qa), w1 = i8x8(_mm_srli_si128(qa, 8));
                const __m256 w2 = i8x8(qb), w3 = i8x8(_mm_srli_si128(qb, 8));
                const __m256 s0 = _mm256_set1_ps(d * (float)sc[t >> 4]), s1 = _mm256_set1_ps(d * (float)sc[(t >> 4) + 1]);
                for (int i = 0; i < mr; i++) {
                    const float *xi = x + i * ldx + blk * 256 + t;
                    __m256 p0 = _mm256_mul_ps(w0, _mm256_loadu_ps(xi));
                    p0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), p0);
                    __m256 p1 = _mm256_mul_ps(w2, _mm256_loadu_ps(xi + 16));
                    p1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), p1);
                    acc[i] = _mm256_fmadd_ps(s1, p1, _mm256_fmadd_ps(s0, p0, acc[i]));
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* Q4_K: super-blocks of 256 values in 8 groups of 32, each with a 6-bit scale and min (k_scale_min). The min
   does not factor out of a group's sum without cancellation, so each value is decoded in registers exactly as
   simd_q4_k decodes it (dd * q - dm, the reference's operations) and multiplied into the rows: no row buffer
   written and read back, the same values, only the summation order differs. */
static inline __attribute__((always_inline)) void fused_q4_k_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                const int mr, int64_t k, float *y, int64_t ldy) {
    __m256 acc[8];
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++, b += 144) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            for (int h = 0; h < 2; h++) {
                const __m256i v = h ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
                const __m256 dv = _mm256_set1_ps(dd[2 * c + h]), mv = _mm256_set1_ps(dm[2 * c + h]);
                const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
                const __m256 w0 = _mm256_sub_ps(_mm256_mul_ps(dv, i8x8(lo)), mv);
                const __m256 w1 = _mm256_sub_ps(_mm256_mul_ps(dv, i8x8(_mm_srli_si128(lo, 8))), mv);
                const __m256 w2 = _mm256_sub_ps(_mm256_mul_ps(dv, i8x8(hi)), mv);
                const __m256 w3 = _mm256_sub_ps(_mm256_mul_ps(dv, i8x8(_mm_srli_si128(hi, 8))), mv);
                const float *xb = x + blk * 256 + 64 * c + 32 * h;
                for (int i = 0; i < mr; i++) { /* a group's partial sum, then one add: a short chain per row */
                    const float *xi = xb + i * ldx;
                    __m256 a = _mm256_mul_ps(w0, _mm256_loadu_ps(xi));
                    a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a);
                    a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xi + 16), a);
                    acc[i] = _mm256_add_ps(acc[i], _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), a));
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* AVX-512 (16 lanes, 32 registers): a block's 32 codes in two registers, 8 activation rows per pass; the same
   scheme (d applied to each block's partial sum, s = w0 x0 + w1 x1 in that order), so the same bound, and each
   row's operations still do not depend on how many rows share the pass. Where the CPU has it, about half the
   instructions per weight of the AVX2 kernels: the many-row (batched decode) products are compute-bound. */
#if defined(__AVX512F__)
#define MLS_AVX512 1
static inline __m512 i8x16(const __m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

#define WIDE_BLOCK(mr, acc, d, w0, w1, xb, ldx)                                                   \
    for (int i = 0; i < (mr); i++) {                                                             \
        const float *xi = (xb) + i * (ldx);                                                      \
        __m512 s = _mm512_mul_ps((w0), _mm512_loadu_ps(xi));                                     \
        s = _mm512_fmadd_ps((w1), _mm512_loadu_ps(xi + 16), s);                                  \
        (acc)[i] = _mm512_fmadd_ps((d), s, (acc)[i]);                                            \
    }

static inline __attribute__((always_inline)) void wide_codes_mr(const uint8_t *b, const int type, const float *x,
                                                                int64_t ldx, const int mr, int64_t k, float *y,
                                                                int64_t ldy) {
    __m512 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / 32; blk++, b += block_bytes(type)) {
        const __m512 d = _mm512_set1_ps(f16(b));
        __m128i g[2];
        block_codes16(b, type, g);
        const __m512 w0 = i8x16(g[0]), w1 = i8x16(g[1]);
        WIDE_BLOCK(mr, acc, d, w0, w1, x + blk * 32, ldx)
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}
CODES_MR(wide_q8_0_mr, wide_codes_mr, 8)
CODES_MR(wide_q4_0_mr, wide_codes_mr, 2)
CODES_MR(wide_q5_0_mr, wide_codes_mr, 6)

static inline __attribute__((always_inline)) void wide_q4_k_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                               const int mr, int64_t k, float *y, int64_t ldy) {
    __m512 acc[8];
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++, b += 144) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            for (int h = 0; h < 2; h++) {
                const __m256i v = h ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4) : _mm256_and_si256(raw, m4);
                const __m512 dv = _mm512_set1_ps(dd[2 * c + h]), mv = _mm512_set1_ps(dm[2 * c + h]);
                const __m512 w0 = _mm512_sub_ps(_mm512_mul_ps(dv, i8x16(_mm256_castsi256_si128(v))), mv);
                const __m512 w1 = _mm512_sub_ps(_mm512_mul_ps(dv, i8x16(_mm256_extracti128_si256(v, 1))), mv);
                const float *xb = x + blk * 256 + 64 * c + 32 * h;
                for (int i = 0; i < mr; i++) {
                    const float *xi = xb + i * ldx;
                    const __m512 a = _mm512_mul_ps(w0, _mm512_loadu_ps(xi));
                    acc[i] = _mm512_add_ps(acc[i], _mm512_fmadd_ps(w1, _mm512_loadu_ps(xi + 16), a));
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

/* Q6_K: a 32-code group's two 16-value halves (each with its int8 scale) in one register each; d * sc applied
   to each half's partial sum, as the AVX2 kernel does */
static inline __attribute__((always_inline)) void wide_q6_k_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                               const int mr, int64_t k, float *y, int64_t ldy) {
    __m512 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++, b += 210) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i q = q6k_codes(ql0, ql1, qh, g);
                const int t = 128 * h + 32 * g;
                const __m512 w0 = i8x16(_mm256_castsi256_si128(q)), w1 = i8x16(_mm256_extracti128_si256(q, 1));
                const __m512 s0 = _mm512_set1_ps(d * (float)sc[t >> 4]), s1 = _mm512_set1_ps(d * (float)sc[(t >> 4) + 1]);
                for (int i = 0; i < mr; i++) {
                    const float *xi = x + i * ldx + blk * 256 + t;
                    const __m512 p0 = _mm512_mul_ps(w0, _mm512_loadu_ps(xi)), p1 = _mm512_mul_ps(w1, _mm512_loadu_ps(xi + 16));
                    acc[i] = _mm512_fmadd_ps(s1, p1, _mm512_fmadd_ps(s0, p0, acc[i]));
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

FUSED_ROW_FN(fused_q8_0, wide_q8_0_mr, k / 32 * 34, 8)
FUSED_ROW_FN(fused_q4_0, wide_q4_0_mr, k / 32 * 18, 8)
FUSED_ROW_FN(fused_q5_0, wide_q5_0_mr, k / 32 * 22, 8)
FUSED_ROW_FN(fused_q4_k, wide_q4_k_mr, k / 256 * 144, 8)
FUSED_ROW_FN(fused_q6_k, wide_q6_k_mr, k / 256 * 210, 8)
#else
FUSED_ROW_FN(fused_q8_0, fused_q8_0_mr, k / 32 * 34, FUSED_ROWS)
FUSED_ROW_FN(fused_q4_0, fused_q4_0_mr, k / 32 * 18, FUSED_ROWS)
FUSED_ROW_FN(fused_q5_0, fused_q5_0_mr, k / 32 * 22, FUSED_ROWS)
FUSED_ROW_FN(fused_q4_k, fused_q4_k_mr, k / 256 * 144, FUSED_ROWS)
FUSED_ROW_FN(fused_q6_k, fused_q6_k_mr, k / 256 * 210, FUSED_ROWS)
#endif
#endif

typedef void (*fused_fn)(const uint8_t *, const float *, int64_t, int64_t, int64_t, float *, int64_t);

/* F32 rows: dotted where they lie */
static void fused_f32(const uint8_t *b, const float *x, int64_t ldx, int64_t m, int64_t k, float *y, int64_t ldy) {
    prefetch_row(b, 4 * k);
    for (int64_t i = 0; i < m; i++) y[i * ldy] = dot((const float *)b, x + i * ldx, k);
}

/* The fused kernel for a type, or 0 (then: decode the row into a buffer, dot it with each x row). */
static fused_fn fused_row(int type) {
    if (type == 0) return fused_f32;
#ifdef MLS_SIMD
    if (type == 8) return fused_q8_0;
    if (type == 2) return fused_q4_0;
    if (type == 14) return fused_q6_k;
    if (type == 12) return fused_q4_k;
    if (type == 6) return fused_q5_0;
#endif
    (void)type;
    return 0;
}

/* Where a row's fp8 scales are: rows come in `parts` of part_rows rows (gate and up of an expert
   keep separate scale grids), each part's grid [ceil(part_rows / bn), kb] part_stride apart. */
typedef struct {
    const float *scale;
    int64_t bn, kb, bk, part_rows, part_stride;
} fp8_scales;

static inline const float *fp8_row_scales(const fp8_scales *f, const float *base, int64_t n) {
    int64_t part = n / f->part_rows, r = n % f->part_rows;
    return base + part * f->part_stride + (r / f->bn) * f->kb;
}

static int decode_row(int type, row_fn fn, const uint8_t *w, const fp8_scales *f, const float *sbase, int64_t n,
                      float *buf, int64_t k) {
    if (type == MLS_FP4_E2M1)
#ifdef MLS_SIMD
        simd_e2m1(w, fp8_row_scales(f, sbase, n), f->bk, buf, k);
#else
        row_e2m1(w, fp8_row_scales(f, sbase, n), f->bk, buf, k);
#endif
    else if (type == MLS_FP8_E4M3)
#ifdef MLS_SIMD
        simd_fp8(w, fp8_row_scales(f, sbase, n), f->bk, buf, k);
#else
        row_fp8(w, fp8_row_scales(f, sbase, n), f->bk, buf, k);
#endif
    else
        fn(w, buf, k);
    return 0;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W [N] rows of row_bytes */
int mls_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
             int64_t row_bytes, const float *scale, int64_t bn, int64_t kb, int64_t bk, int64_t part_rows,
             float *y, int64_t ldy, int threads) {
    row_fn fn = ggml_row(type);
    if (!fn && type != MLS_FP8_E4M3 && type != MLS_FP4_E2M1) return -1;
    if (k > MAX_K) return -2;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
    fused_fn fused = fused_row(type);
    if (fused) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r++) fused(w + r * row_bytes, x, ldx, m, k, y + r, ldy);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            prefetch_row(w + r * row_bytes, row_bytes);
            decode_row(type, fn, w + r * row_bytes, &f, scale, r, buf, k);
            for (int64_t i = 0; i < m; i++) y[i * ldy + r] = dot(buf, x + i * ldx, k);
        }
        free(buf);
    }
    return 0;
}

/* Routed experts. x [P, K] holds the (token, expert) pairs sorted by expert; group a is rows
   [starts[a], starts[a+1]) and uses expert experts[a]: W + experts[a] * expert_stride (bytes),
   fp8 scales + experts[a] * scale_expert_stride (floats). y [P, N]. */
int mls_grouped_gemm(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                     int64_t expert_stride, const float *scale, int64_t scale_expert_stride, int64_t bn,
                     int64_t kb, int64_t bk, int64_t part_rows, const int64_t *experts, const int64_t *starts,
                     int64_t groups, float *y, int threads) {
    row_fn fn = ggml_row(type);
    if (!fn && type != MLS_FP8_E4M3 && type != MLS_FP4_E2M1) return -1;
    if (k > MAX_K) return -2;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
    const int64_t items = groups * n;
    fused_fn fused = fused_row(type);
    if (fused) { /* items of ROW_RUN rows: one index division per run, not per row (rows may be short) */
        const int64_t runs = (n + ROW_RUN - 1) / ROW_RUN;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < groups * runs; it++) {
            const int64_t a = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
            const int64_t p0 = starts[a], m = starts[a + 1] - p0;
            const uint8_t *we = w + experts[a] * expert_stride;
            for (int64_t r = r0; r < r1; r++) fused(we + r * row_bytes, x + p0 * k, k, m, k, y + p0 * n + r, n);
        }
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t a = it / n, r = it % n, e = experts[a];
            const float *sbase = scale ? scale + e * scale_expert_stride : 0;
            prefetch_row(w + e * expert_stride + r * row_bytes, row_bytes);
            decode_row(type, fn, w + e * expert_stride + r * row_bytes, &f, sbase, r, buf, k);
            for (int64_t p = starts[a]; p < starts[a + 1]; p++) y[p * n + r] = dot(buf, x + p * k, k);
        }
        free(buf);
    }
    return 0;
}

/* out [N, K] fp32 = the decoded rows (prefill: decode once, then the BLAS GEMM) */
int mls_dequantize(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const float *scale, int64_t bn,
                   int64_t kb, int64_t bk, int64_t part_rows, int64_t k, float *out, int threads) {
    row_fn fn = ggml_row(type);
    if (!fn && type != MLS_FP8_E4M3 && type != MLS_FP4_E2M1) return -1;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        prefetch_row(w + r * row_bytes, row_bytes);
        decode_row(type, fn, w + r * row_bytes, &f, scale, r, out + r * k, k);
    }
    return 0;
}


/* out [A, N, K] fp32 = the decoded rows of experts experts[0..A) of a stack (expert e's N rows of row_bytes
   start at w + e * expert_stride): a prefill's active experts, decoded where they lie (no gathered copy). */
int mls_dequantize_experts(int type, const uint8_t *w, int64_t expert_stride, const int64_t *experts, int64_t a,
                           int64_t n, int64_t row_bytes, int64_t k, float *out, int threads) {
    row_fn fn = ggml_row(type);
    if (!fn) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t it = 0; it < a * n; it++) {
        const uint8_t *row = w + experts[it / n] * expert_stride + (it % n) * row_bytes;
        prefetch_row(row, row_bytes);
        fn(row, out + it * k, k);
    }
    return 0;
}

/* ---------------------------------------------------------------- MoE at decode (few tokens)
   The router and the routed experts of a step with few (token, expert) pairs, each one call, so that
   a decode step does not pay ~50 small tensor ops per MoE layer. Same arithmetic as models/moe.py
   (Gate) and GGUFExperts: float rounding may differ in the last bits (expf vs torch's vectorized exp,
   summation order), which the tests bound. */


enum { MLS_SCORE_SOFTMAX = 0, MLS_SCORE_SIGMOID = 1 };
enum { MLS_TOPK_GREEDY = 0, MLS_TOPK_GROUP_MAX = 1, MLS_TOPK_GROUP_TOP2 = 2 };

/* indices of the k largest of v[0..n) into idx (ties: the lower index first); n <= 1024 */
static void topk_desc(const float *v, int64_t n, int64_t k, int64_t *idx) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= idx[q] == i;
            if (!taken && (best < 0 || v[i] > v[best])) best = i;
        }
        idx[j] = best;
    }
}

/* logits [T, E] (x @ W_gate^T, fp32) -> topk_w [T, k] fp32, topk_idx [T, k]. scoring: softmax | sigmoid
   (+ correction bias for the choice only); method: greedy | group max (V2, dropped groups score 0) |
   group sum of top-2 (V3 noaux_tc, dropped groups -inf). Weights: the unbiased scores of the chosen
   experts, normalised if norm, times scale. Returns -3 for more than 1024 experts. */
int mls_moe_route(const float *logits, int64_t t, int64_t e, const float *bias, int scoring, int method,
                  int64_t n_group, int64_t topk_group, int64_t k, int norm, float scale, float *out_w,
                  int64_t *out_idx) {
    if (e < 1 || e > 1024 || k < 1 || k > e) return -3;
    if (method != MLS_TOPK_GREEDY &&
        (n_group < 1 || n_group > 64 || e % n_group || topk_group < 1 || topk_group > n_group))
        return -3;
    float scores[1024], choice[1024], gscore[64];
    int64_t gidx[64];
    for (int64_t r = 0; r < t; r++) {
        const float *l = logits + r * e;
        if (scoring == MLS_SCORE_SOFTMAX) {
            float mx = l[0], sum = 0.0f;
            for (int64_t i = 1; i < e; i++) mx = l[i] > mx ? l[i] : mx;
            for (int64_t i = 0; i < e; i++) sum += (scores[i] = expf(l[i] - mx));
            for (int64_t i = 0; i < e; i++) choice[i] = scores[i] = scores[i] / sum;
        } else {
            for (int64_t i = 0; i < e; i++) {
                scores[i] = 1.0f / (1.0f + expf(-l[i]));
                choice[i] = bias ? scores[i] + bias[i] : scores[i];
            }
        }
        if (method != MLS_TOPK_GREEDY) {
            const int64_t per = e / n_group;
            for (int64_t g = 0; g < n_group; g++) {
                const float *c = choice + g * per;
                if (method == MLS_TOPK_GROUP_TOP2) {
                    int64_t two[2];
                    topk_desc(c, per, per < 2 ? per : 2, two);
                    gscore[g] = per < 2 ? c[two[0]] : c[two[0]] + c[two[1]];
                } else {
                    float mx = c[0];
                    for (int64_t i = 1; i < per; i++) mx = c[i] > mx ? c[i] : mx;
                    gscore[g] = mx;
                }
            }
            topk_desc(gscore, n_group, topk_group, gidx);
            const float fill = method == MLS_TOPK_GROUP_TOP2 ? -INFINITY : 0.0f;
            for (int64_t g = 0; g < n_group; g++) {
                int kept = 0;
                for (int64_t q = 0; q < topk_group; q++) kept |= gidx[q] == g;
                if (!kept)
                    for (int64_t i = 0; i < per; i++) choice[g * per + i] = fill;
            }
        }
        int64_t *idx = out_idx + r * k;
        float *w = out_w + r * k, sum = 0.0f;
        topk_desc(choice, e, k, idx);
        for (int64_t j = 0; j < k; j++) sum += (w[j] = scores[idx[j]]);
        for (int64_t j = 0; j < k; j++) w[j] = (norm ? w[j] / (sum + 1e-20f) : w[j]) * scale;
    }
    return 0;
}

static inline float row_dot(row_fn fn, fused_fn fused, const uint8_t *w, const float *x, int64_t k, float *buf) {
    if (fused) {
        float y;
        fused(w, x, k, 1, k, &y, 1);
        return y;
    }
    fn(w, buf, k);
    return dot(buf, x, k);
}

/* Routed experts for the (token, expert) pairs of a few tokens, unsorted: pair p = t * kk + j uses
   expert idx[p] with weight wt[p]. gate_up [E, 2I] rows of gu_row_bytes (gate rows first), down [E, D]
   rows of dn_row_bytes. out [T, D] = sum_j wt[t, j] * down_e(silu(gate_e x_t) * up_e x_t).
   One parallel region: pairs x rows of gate_up, then silu * up, then output rows. */
int mls_moe_experts(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                    const uint8_t *gate_up, int64_t gu_expert_stride, int64_t gu_row_bytes, const uint8_t *down,
                    int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt, int64_t kk,
                    float *out, int threads) {
    row_fn fn_gu = ggml_row(type_gu), fn_dn = ggml_row(type_dn);
    if (!fn_gu || !fn_dn) return -1;
    if (d > MAX_K || inter > MAX_K) return -2;
    fused_fn fz_gu = fused_row(type_gu), fz_dn = fused_row(type_dn);
    const int64_t pairs = t * kk, n_gu = 2 * inter;
    float *gu = (float *)malloc(sizeof(float) * (size_t)(pairs * n_gu) + 1);
    float *h = (float *)malloc(sizeof(float) * (size_t)(pairs * inter) + 1);
    if (!gu || !h) {
        free(gu);
        free(h);
        return -4;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(d > inter ? d : inter));
        const int64_t runs = (n_gu + ROW_RUN - 1) / ROW_RUN;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * runs; it++) {
            const int64_t p = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_gu ? r0 + ROW_RUN : n_gu;
            const uint8_t *we = gate_up + idx[p] * gu_expert_stride;
            for (int64_t r = r0; r < r1; r++)
                gu[p * n_gu + r] = row_dot(fn_gu, fz_gu, we + r * gu_row_bytes, x + (p / kk) * d, d, buf);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * inter; it++) {
            const int64_t p = it / inter, i = it % inter;
            const float g = gu[p * n_gu + i];
            h[it] = (g / (1.0f + expf(-g))) * gu[p * n_gu + inter + i];
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * d; it++) {
            const int64_t tok = it / d, r = it % d;
            float acc = 0.0f;
            for (int64_t j = 0; j < kk; j++) {
                const int64_t p = tok * kk + j;
                const uint8_t *row = down + idx[p] * dn_expert_stride + r * dn_row_bytes;
                acc += wt[p] * row_dot(fn_dn, fz_dn, row, h + p * inter, inter, buf);
            }
            out[it] = acc;
        }
        free(buf);
    }
    free(gu);
    free(h);
    return 0;
}

/* ---------------------------------------------------------------- the MoE block at decode, in one call
   A decode step's whole MoE block with ggml-block weights (GGUFExperts and a GGUFLinear shared expert): the
   gate's logits (fp32 weights), the router (mls_moe_route), the routed experts grouped by expert (an active
   expert's rows are read once for all of its pairs), the shared expert, and the sum, in one parallel region,
   instead of ~10 native calls and ~30 tensor ops. For the same routing the routed part is exactly what
   mls_moe_experts computes (each row's products do not depend on how many activation rows share them, and
   the weighted sum runs over j in the same order) and the shared part exactly what three mls_gemm calls give;
   the gate's logits (dot order) and the shared SwiGLU's silu (expf) round differently from torch's. */
typedef struct { /* every field 8 bytes: the ctypes mirror (kernels/native_layers.py) has no padding to guess */
    int64_t d, e, kk, inter, shared_inter; /* hidden, experts, experts per token, I, shared I (0: none) */
    const float *gate_w, *bias;            /* [E, D] fp32, [E] fp32 or 0 */
    int64_t scoring, method, n_group, topk_group, norm;
    double scale; /* routed_scaling_factor (rounded to float, as the router's argument) */
    int64_t type_gu, type_dn;
    const uint8_t *gate_up, *down; /* [E, 2I] and [E, D] rows of ggml blocks */
    int64_t gu_expert_stride, gu_row_bytes, dn_expert_stride, dn_row_bytes;
    int64_t type_sg, type_su, type_sd; /* the shared expert's gate_proj [Is, D], up_proj [Is, D], down_proj [D, Is] */
    const uint8_t *sg, *su, *sd;
    int64_t sg_row_bytes, su_row_bytes, sd_row_bytes;
    int64_t int8; /* activations="int8": Q8_0 / Q4_0 products take int8 activations, as the per-op path's */
} mls_moe_block_t;

/* the int8-activation kernels, defined below */
typedef void (*q8rows_fn)(const uint8_t *, const int8_t *, const float *, int64_t, int64_t, float *, int64_t);
static q8rows_fn q8rows(int type);
static void quantize_rows_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d);

typedef struct {
    row_fn fn;
    fused_fn fz;
    int64_t row_bytes; /* for the prefetch of decoded (not fused) rows; 0: none */
} lin_kernel;

static inline lin_kernel lin_for(int64_t type) {
    lin_kernel l = {ggml_row((int)type), fused_row((int)type), 0};
    return l;
}

static inline lin_kernel lin_rows(int64_t type, int64_t row_bytes) {
    lin_kernel l = lin_for(type);
    l.row_bytes = row_bytes;
    return l;
}

/* y[i * ldy] (i < m) = the weight row at w (k values) . x[i * ldx]: mls_gemm's per-row operations */
static inline void lin_row(lin_kernel l, const uint8_t *w, const float *x, int64_t ldx, int64_t m, int64_t k,
                           float *y, int64_t ldy, float *buf) {
    if (l.fz) { /* it prefetches itself */
        l.fz(w, x, ldx, m, k, y, ldy);
        return;
    }
    prefetch_row(w, l.row_bytes);
    l.fn(w, buf, k);
    for (int64_t i = 0; i < m; i++) y[i * ldy] = dot(buf, x + i * ldx, k);
}

static inline float silu_mul(float g, float u) { return (g / (1.0f + expf(-g))) * u; }

/* x [T, D] (the post-attention norm's output, contiguous) -> out [T, D]; topk_w / topk_idx [T, kk] (may be 0)
   receive the routing. Returns mls_moe_route's -3 for router settings it refuses, -1 for a weight type without
   a decoder, -2 for rows longer than MAX_K, -4 when memory cannot be allocated. */
int mls_moe_block(const mls_moe_block_t *b, const float *x, int64_t t, float *out, float *topk_w, int64_t *topk_idx,
                  int threads) {
    const int64_t d = b->d, e = b->e, kk = b->kk, inter = b->inter, si = b->shared_inter;
    const lin_kernel kgu = lin_rows(b->type_gu, b->gu_row_bytes), kdn = lin_rows(b->type_dn, b->dn_row_bytes);
    const lin_kernel ksg = lin_rows(si ? b->type_sg : b->type_gu, b->sg_row_bytes),
                     ksu = lin_rows(si ? b->type_su : b->type_gu, b->su_row_bytes),
                     ksd = lin_rows(si ? b->type_sd : b->type_dn, b->sd_row_bytes);
    if (!kgu.fn || !kdn.fn || !ksg.fn || !ksu.fn || !ksd.fn) return -1;
    if (d > MAX_K || inter > MAX_K || si > MAX_K) return -2;
    if (e < 1 || e > 1024 || kk < 1 || kk > e) return -3;
    /* int8 activations where the per-op path takes them: each projection whose type has int8 kernels (Q8_0,
       Q4_0), on its own, as GGUFExperts' grouped products and the shared GGUFLinears decide */
    const q8rows_fn qgu = b->int8 ? q8rows((int)b->type_gu) : 0, qdn = b->int8 ? q8rows((int)b->type_dn) : 0;
    const q8rows_fn qsg = b->int8 && si ? q8rows((int)b->type_sg) : 0, qsu = b->int8 && si ? q8rows((int)b->type_su) : 0;
    const q8rows_fn qsd = b->int8 && si ? q8rows((int)b->type_sd) : 0;
    if ((qgu || qsg || qsu || qsd) && (d % 32 || inter % 32 || si % 32)) return -2;
    const int64_t pairs = t * kk, n_gu = 2 * inter, n_sgu = 2 * si;
    /* one allocation: logits, weights, ids, per-expert counts / starts / ids, pair order and position,
       xs (pairs sorted by expert), gate_up outputs, h, down outputs, and the shared expert's three */
    const size_t nf = (size_t)(t * e + pairs + pairs * d + pairs * n_gu + pairs * inter + pairs * d + t * n_sgu +
                               t * si + t * d);
    const size_t ni = (size_t)(pairs + e + (e + 1) + e + pairs + pairs);
    /* int8 codes and scales of xs, h, x and the shared h (allocated only with int8) */
    const size_t nq = b->int8 ? (size_t)(pairs * d + pairs * inter + t * d + t * si) : 0;
    char *mem = (char *)malloc(sizeof(float) * nf + sizeof(int64_t) * ni + nq * (1 + sizeof(float)) + 64);
    if (!mem) return -4;
    int64_t *idx = (int64_t *)mem, *count = idx + pairs, *start = count + e, *act = start + e + 1;
    int64_t *order = act + e, *pos = order + pairs;
    float *logits = (float *)(pos + pairs), *wt = logits + t * e, *xs = wt + pairs, *gu = xs + pairs * d;
    float *h = gu + pairs * n_gu, *ys = h + pairs * inter, *sgu = ys + pairs * d, *sh = sgu + t * n_sgu;
    float *ysh = sh + t * si;
    float *xsd = ysh + t * d, *hd = xsd + pairs * d / 32, *xd = hd + pairs * inter / 32, *shd = xd + t * d / 32;
    int8_t *xsq = (int8_t *)(shd + t * si / 32), *hq = xsq + pairs * d, *xq = hq + pairs * inter, *shq = xq + t * d;
    int64_t groups = 0;
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(d > inter ? (d > si ? d : si) : (inter > si ? inter : si)));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * e; it++) logits[it] = dot(b->gate_w + (it % e) * d, x + (it / e) * d, d);
#pragma omp single
        {
            rc = mls_moe_route(logits, t, e, b->bias, (int)b->scoring, (int)b->method, b->n_group, b->topk_group, kk,
                               (int)b->norm, (float)b->scale, wt, idx);
            if (rc == 0) { /* pairs sorted by expert (stable: token order within an expert), a counting sort */
                memset(count, 0, sizeof(int64_t) * (size_t)e);
                for (int64_t p = 0; p < pairs; p++) count[idx[p]]++;
                int64_t s = 0;
                for (int64_t ex = 0; ex < e; ex++)
                    if (count[ex]) {
                        act[groups] = ex;
                        start[groups++] = s;
                        s += count[ex];
                    }
                start[groups] = s;
                memset(count, 0, sizeof(int64_t) * (size_t)e); /* now: pairs placed per group */
                for (int64_t p = 0; p < pairs; p++) {
                    int64_t a = 0;
                    while (act[a] != idx[p]) a++;
                    const int64_t q = start[a] + count[a]++;
                    order[q] = p;
                    pos[p] = q;
                }
            }
        }
        if (rc == 0) {
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; q++) memcpy(xs + q * d, x + (order[q] / kk) * d, sizeof(float) * (size_t)d);
            if (b->int8) {
#pragma omp single
                {
                    if (qgu) quantize_rows_q8(xs, pairs, d, d, xsq, xsd);
                    if (qsg || qsu) quantize_rows_q8(x, t, d, d, xq, xd);
                }
            }
            /* gate_up: items of ROW_RUN rows of an active expert (all of its pairs), then of the shared expert */
            const int64_t runs = (n_gu + ROW_RUN - 1) / ROW_RUN, sruns = (n_sgu + ROW_RUN - 1) / ROW_RUN;
#pragma omp for schedule(dynamic, 4)
            for (int64_t it = 0; it < groups * runs + sruns; it++) {
                if (it < groups * runs) {
                    const int64_t a = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_gu ? r0 + ROW_RUN : n_gu;
                    const int64_t p0 = start[a], m = start[a + 1] - p0;
                    const uint8_t *we = b->gate_up + act[a] * b->gu_expert_stride;
                    for (int64_t r = r0; r < r1; r++) {
                        const uint8_t *row = we + r * b->gu_row_bytes;
                        if (qgu)
                            qgu(row, xsq + p0 * d, xsd + p0 * (d / 32), m, d, gu + p0 * n_gu + r, n_gu);
                        else
                            lin_row(kgu, row, xs + p0 * d, d, m, d, gu + p0 * n_gu + r, n_gu, buf);
                    }
                } else {
                    const int64_t r0 = (it - groups * runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_sgu ? r0 + ROW_RUN : n_sgu;
                    for (int64_t r = r0; r < r1; r++) {
                        const int up = r >= si;
                        const uint8_t *row = up ? b->su + (r - si) * b->su_row_bytes : b->sg + r * b->sg_row_bytes;
                        const q8rows_fn q8 = up ? qsu : qsg;
                        if (q8)
                            q8(row, xq, xd, t, d, sgu + r, n_sgu);
                        else
                            lin_row(up ? ksu : ksg, row, x, d, t, d, sgu + r, n_sgu, buf);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < pairs * inter + t * si; it++) {
                if (it < pairs * inter) {
                    const int64_t q = it / inter, i = it % inter;
                    h[it] = silu_mul(gu[q * n_gu + i], gu[q * n_gu + inter + i]);
                } else {
                    const int64_t j = it - pairs * inter, tok = j / si, i = j % si;
                    sh[j] = silu_mul(sgu[tok * n_sgu + i], sgu[tok * n_sgu + si + i]);
                }
            }
            if (qdn || qsd) {
#pragma omp single
                {
                    if (qdn) quantize_rows_q8(h, pairs, inter, inter, hq, hd);
                    if (qsd) quantize_rows_q8(sh, t, si, si, shq, shd);
                }
            }
            const int64_t druns = (d + ROW_RUN - 1) / ROW_RUN, sdruns = si ? druns : 0;
#pragma omp for schedule(dynamic, 4)
            for (int64_t it = 0; it < groups * druns + sdruns; it++) {
                const int64_t a = it / druns, r0 = (it % druns) * ROW_RUN, r1 = r0 + ROW_RUN < d ? r0 + ROW_RUN : d;
                if (a < groups) {
                    const int64_t p0 = start[a], m = start[a + 1] - p0;
                    const uint8_t *we = b->down + act[a] * b->dn_expert_stride;
                    for (int64_t r = r0; r < r1; r++) {
                        const uint8_t *row = we + r * b->dn_row_bytes;
                        if (qdn)
                            qdn(row, hq + p0 * inter, hd + p0 * (inter / 32), m, inter, ys + p0 * d + r, d);
                        else
                            lin_row(kdn, row, h + p0 * inter, inter, m, inter, ys + p0 * d + r, d, buf);
                    }
                } else {
                    for (int64_t r = r0; r < r1; r++) {
                        const uint8_t *row = b->sd + r * b->sd_row_bytes;
                        if (qsd)
                            qsd(row, shq, shd, t, si, ysh + r, d);
                        else
                            lin_row(ksd, row, sh, si, t, si, ysh + r, d, buf);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < t * d; it++) {
                const int64_t tok = it / d, r = it % d;
                float acc = 0.0f;
                for (int64_t j = 0; j < kk; j++) acc += wt[tok * kk + j] * ys[pos[tok * kk + j] * d + r];
                out[it] = si ? acc + ysh[it] : acc;
            }
        }
        free(buf);
    }
    if (rc == 0 && topk_w) memcpy(topk_w, wt, sizeof(float) * (size_t)pairs);
    if (rc == 0 && topk_idx) memcpy(topk_idx, idx, sizeof(int64_t) * (size_t)pairs);
    free(mem);
    return rc;
}

/* ---------------------------------------------------------------- int8 activations (an explicit option)
   llama.cpp's integer dot products, for Q8_0 and Q4_0 weights: each 32-value block of an activation row
   is quantized to int8 with its own fp32 scale d_x = max|x| / 127 (q_x = x / d_x rounded to nearest), and
   a block's product is d_w * d_x * (the exact int32 sum of q_w q_x). Not exact: |x - d_x q_x| <= d_x / 2
   per value, so |y - y_exact| <= sum_j |w_j| d_x(j) / 2, plus fp32 rounding of the block sums. About half
   the instructions of the float path per weight. Return -1 for other weight types. */

/* x [m, k] (row stride ldx) -> q [m, k] int8 in [-127, 127] and d [m, k / 32]. A block holding NaN or
   Inf gets scale NaN (its products come out NaN, as the float path's would) and codes 0; a block too
   small for a normal scale quantizes to zeros. */
static void quantize_rows_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d) {
    const int64_t kb = k / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < kb; b++) {
            const float *xb = x + i * ldx + b * 32;
            int8_t *qb = q + i * k + b * 32;
            float amax = 0.0f;
            int finite = 1;
            for (int j = 0; j < 32; j++) {
                finite &= isfinite(xb[j]) != 0;
                amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            }
            const float dd = amax / 127.0f, inv = dd >= FLT_MIN ? 1.0f / dd : 0.0f;
            for (int j = 0; j < 32; j++) {
                const float v = finite ? nearbyintf(xb[j] * inv) : 0.0f;
                qb[j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
            d[i * kb + b] = finite ? dd : NAN;
        }
}

/* One weight row (raw blocks b) times m quantized activation rows (xq [m, k] int8, xd [m, k / 32]) ->
   y[i * ldy]; each weight block is unpacked once per chunk of up to 4 rows. */

#ifdef MLS_SIMD
/* 8 float partial sums of the int8 products of a weight block (as |w| and its signs) with x (x in
   [-127, 127]: |w| x pairs stay inside maddubs' int16 range) */
static inline __m256 i8dot32(__m256i aw, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* VNNI: the same int32 sums of four u8 x s8 products in one instruction (maddubs cannot saturate here:
       |w| <= 128 and |x| <= 127, so the pairs' sums stay below 2^15), hence the same results */
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(x, w)));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(x, w)));
#else
    const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void q8rows_mr(const uint8_t *b, int type, const int8_t *xq,
                                                            const float *xd, const int mr, int64_t k, float *y,
                                                            int64_t ldy) {
    __m256 acc[4];
    const int64_t kb = k / 32, bytes = type == 8 ? 34 : 18;
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < kb; blk++, b += bytes) {
        const __m256i w = type == 8 ? _mm256_loadu_si256((const __m256i *)(b + 2))
                                    : _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
        const __m256i aw = _mm256_sign_epi8(w, w);
        const float dw = f16(b);
        for (int i = 0; i < mr; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * k + blk * 32));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[i * kb + blk]), i8dot32(aw, w, x), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

#define Q8ROWS_FN(name, type)                                                                              \
    static void name(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,    \
                     int64_t ldy) {                                                                        \
        const int64_t kb = k / 32;                                                                         \
        int64_t i = 0;                                                                                     \
        prefetch_row(b, kb * (type == 8 ? 34 : 18));                                                       \
        for (; i + 4 <= m; i += 4) q8rows_mr(b, type, xq + i * k, xd + i * kb, 4, k, y + i * ldy, ldy);    \
        switch (m - i) {                                                                                   \
        case 3: q8rows_mr(b, type, xq + i * k, xd + i * kb, 3, k, y + i * ldy, ldy); break;                \
        case 2: q8rows_mr(b, type, xq + i * k, xd + i * kb, 2, k, y + i * ldy, ldy); break;                \
        case 1: q8rows_mr(b, type, xq + i * k, xd + i * kb, 1, k, y + i * ldy, ldy); break;                \
        default: break;                                                                                    \
        }                                                                                                  \
    }
Q8ROWS_FN(q8rows_q8_0, 8)
Q8ROWS_FN(q8rows_q4_0, 2)
#else
static void q8rows_scalar(const uint8_t *b0, int type, const int8_t *xq, const float *xd, int64_t m, int64_t k,
                          float *y, int64_t ldy) {
    const int64_t kb = k / 32, bytes = type == 8 ? 34 : 18;
    prefetch_row(b0, kb * bytes);
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *b = b0;
        float acc = 0.0f;
        for (int64_t blk = 0; blk < kb; blk++, b += bytes) {
            const int8_t *x = xq + i * k + blk * 32;
            int32_t s = 0;
            for (int j = 0; j < 32; j++) {
                const int32_t w = type == 8 ? (int32_t)(int8_t)b[2 + j]
                                            : (int32_t)(j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4)) - 8;
                s += w * x[j];
            }
            acc += (f16(b) * xd[i * kb + blk]) * (float)s;
        }
        y[i * ldy] = acc;
    }
}
static void q8rows_q8_0(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    q8rows_scalar(b, 8, xq, xd, m, k, y, ldy);
}
static void q8rows_q4_0(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    q8rows_scalar(b, 2, xq, xd, m, k, y, ldy);
}
#endif

static q8rows_fn q8rows(int type) {
    if (type == 8) return q8rows_q8_0;
    if (type == 2) return q8rows_q4_0;
    return 0;
}

static inline float q8dot(q8rows_fn fn, const uint8_t *b, const int8_t *xq, const float *xd, int64_t k) {
    float y;
    fn(b, xq, xd, 1, k, &y, 1);
    return y;
}

/* Activations quantized once, then as mls_gemm / mls_grouped_gemm. */
int mls_gemm_q8(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                int64_t row_bytes, float *y, int64_t ldy, int threads) {
    q8rows_fn fn = q8rows(type);
    if (!fn) return -1;
    if (k % 32) return -2;
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * (k / 32)) + 1);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -4;
    }
    quantize_rows_q8(x, m, k, ldx, xq, xd);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) fn(w + r * row_bytes, xq, xd, m, k, y + r, ldy);
    free(xq);
    free(xd);
    return 0;
}

int mls_grouped_gemm_q8(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                        int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                        float *y, int threads) {
    q8rows_fn fn = q8rows(type);
    if (!fn) return -1;
    if (k % 32) return -2;
    const int64_t p = starts[groups], kb = k / 32, runs = (n + ROW_RUN - 1) / ROW_RUN;
    int8_t *xq = (int8_t *)malloc((size_t)(p * k) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(p * kb) + 1);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -4;
    }
    quantize_rows_q8(x, p, k, k, xq, xd);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t it = 0; it < groups * runs; it++) {
        const int64_t a = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
        const uint8_t *we = w + experts[a] * expert_stride;
        const int64_t p0 = starts[a];
        for (int64_t r = r0; r < r1; r++) fn(we + r * row_bytes, xq + p0 * k, xd + p0 * kb, starts[a + 1] - p0, k, y + p0 * n + r, n);
    }
    free(xq);
    free(xd);
    return 0;
}

/* mls_moe_experts with int8 activations: x quantized before gate_up, h before down. */
int mls_moe_experts_q8(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                       const uint8_t *gate_up, int64_t gu_expert_stride, int64_t gu_row_bytes, const uint8_t *down,
                       int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt,
                       int64_t kk, float *out, int threads) {
    q8rows_fn fn_gu = q8rows(type_gu), fn_dn = q8rows(type_dn);
    if (!fn_gu || !fn_dn) return -1;
    if (d % 32 || inter % 32) return -2;
    const int64_t pairs = t * kk, n_gu = 2 * inter, runs = (n_gu + ROW_RUN - 1) / ROW_RUN;
    int8_t *xq = (int8_t *)malloc((size_t)(t * d) + 1), *hq = (int8_t *)malloc((size_t)(pairs * inter) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(t * d / 32) + 1);
    float *hd = (float *)malloc(sizeof(float) * (size_t)(pairs * inter / 32) + 1);
    float *gu = (float *)malloc(sizeof(float) * (size_t)(pairs * n_gu) + 1);
    float *h = (float *)malloc(sizeof(float) * (size_t)(pairs * inter) + 1);
    int rc = 0;
    if (!xq || !hq || !xd || !hd || !gu || !h) {
        rc = -4;
        goto done;
    }
    quantize_rows_q8(x, t, d, d, xq, xd);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * runs; it++) {
            const int64_t p = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_gu ? r0 + ROW_RUN : n_gu;
            const uint8_t *we = gate_up + idx[p] * gu_expert_stride;
            const int64_t tok = p / kk;
            for (int64_t r = r0; r < r1; r++)
                gu[p * n_gu + r] = q8dot(fn_gu, we + r * gu_row_bytes, xq + tok * d, xd + tok * (d / 32), d);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * inter; it++) {
            const int64_t p = it / inter, i = it % inter;
            const float g = gu[p * n_gu + i];
            h[it] = (g / (1.0f + expf(-g))) * gu[p * n_gu + inter + i];
        }
#pragma omp single
        quantize_rows_q8(h, pairs, inter, inter, hq, hd);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * d; it++) {
            const int64_t tok = it / d, r = it % d;
            float acc = 0.0f;
            for (int64_t j = 0; j < kk; j++) {
                const int64_t p = tok * kk + j;
                const uint8_t *row = down + idx[p] * dn_expert_stride + r * dn_row_bytes;
                acc += wt[p] * q8dot(fn_dn, row, hq + p * inter, hd + p * (inter / 32), inter);
            }
            out[it] = acc;
        }
    }
done:
    free(xq);
    free(hq);
    free(xd);
    free(hd);
    free(gu);
    free(h);
    return rc;
}

/* ---------------------------------------------------------------- latent MQA over paged rows (absorbed path)
   Each query is a token t = q_index[query] of the step: per head hh its [q_lat | q_pe] (q_lat = q_nope W_UK,
   c = r + dr values) is read where it lies, at q_lat + t * ql_tok + hh * ql_head and q_pe + t * qp_tok +
   hh * qp_head (no concatenated or gathered copy). Queries [B, Q] (q_index [B, Q]), cache [S, c] rows
   [c_kv | k_pe], slots [B, L] (cache row of each key position), mask [B, Q, L] (bool bytes) -> out
   [B, Q, H, r] = softmax_l(scale * q . row_l) @ row_l[:r]. Rows are read where they are; each work item is
   one query and a group of heads. Attention over one shared row is compute-bound (every head reads it), so
   both products are register-blocked over heads: a row's 8-value slice, loaded once, is multiplied into
   MQA_HS heads' scores, and P c into MQA_HO heads x 16 outputs (a row slice is loaded once per MQA_HO heads
   instead of once per head, the accumulators stay in registers across all the rows). The probabilities
   are exp(s - max) / sum, as torch's softmax; a query with no allowed key gets NaN. */
#define MQA_HS 8 /* heads per score pass over a row */
#define MQA_HO 4 /* heads per output pass (x 16 values: 8 accumulators) */
#define MQA_TILE 128 /* cache rows per output tile */

/* s[i * ls] = row . [ql | qp] of head i, for n <= MQA_HS heads (strides ql_head / qp_head). Every head gets the
   same operations whatever n is (one 8-lane accumulator over r then dr, a scalar tail), so a head's score does
   not depend on how heads were grouped (the grouping follows the step's query count and the thread count). */
#ifdef MLS_SIMD
static inline __attribute__((always_inline)) void mqa_scores_n(const float *row, const float *ql, int64_t ql_head,
                                                               const float *qp, int64_t qp_head, int64_t r,
                                                               int64_t dr, const int n, float *s, int64_t ls) {
    __m256 a[MQA_HS];
    float tail[MQA_HS];
    for (int i = 0; i < n; i++) a[i] = _mm256_setzero_ps(), tail[i] = 0.0f;
    int64_t k = 0;
    for (; k + 8 <= r; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(v, _mm256_loadu_ps(ql + i * ql_head + k), a[i]);
    }
    for (; k < r; k++)
        for (int i = 0; i < n; i++) tail[i] += row[k] * ql[i * ql_head + k];
    int64_t e = 0;
    for (; e + 8 <= dr; e += 8) {
        const __m256 v = _mm256_loadu_ps(row + r + e);
        for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(v, _mm256_loadu_ps(qp + i * qp_head + e), a[i]);
    }
    for (; e < dr; e++)
        for (int i = 0; i < n; i++) tail[i] += row[r + e] * qp[i * qp_head + e];
    for (int i = 0; i < n; i++) s[i * ls] = hsum8(a[i]) + tail[i];
}
#endif

static inline void mqa_scores(const float *row, const float *ql, int64_t ql_head, const float *qp, int64_t qp_head,
                              int64_t r, int64_t dr, int n, float *s, int64_t ls) {
#ifdef MLS_SIMD
    if (n == MQA_HS) /* a constant count: the accumulators stay in registers */
        mqa_scores_n(row, ql, ql_head, qp, qp_head, r, dr, MQA_HS, s, ls);
    else
        mqa_scores_n(row, ql, ql_head, qp, qp_head, r, dr, n, s, ls);
#else
    for (int i = 0; i < n; i++) s[i * ls] = dot(row, ql + i * ql_head, r) + dot(row + r, qp + i * qp_head, dr);
#endif
}

/* o[i * r + k] (+)= sum_j p[i * lp + j] rows[j][k] for n <= MQA_HO heads, j over rows [j0, j1) in order; `acc`
   continues the sums already in o (a later tile of rows), so the result is the same sequential sum over j. */
static inline void mqa_outputs(const float *const *rows, int64_t j0, int64_t j1, const float *p, int64_t lp, int n,
                               int64_t r, int acc, float *o) {
    int64_t k = 0;
#ifdef MLS_SIMD
    if (n == MQA_HO) {
        for (; k + 16 <= r; k += 16) {
            __m256 a[MQA_HO][2];
            for (int i = 0; i < MQA_HO; i++) {
                a[i][0] = acc ? _mm256_loadu_ps(o + i * r + k) : _mm256_setzero_ps();
                a[i][1] = acc ? _mm256_loadu_ps(o + i * r + k + 8) : _mm256_setzero_ps();
            }
            for (int64_t j = j0; j < j1; j++) {
                const __m256 v0 = _mm256_loadu_ps(rows[j] + k), v1 = _mm256_loadu_ps(rows[j] + k + 8);
                for (int i = 0; i < MQA_HO; i++) {
                    const __m256 pv = _mm256_broadcast_ss(p + i * lp + j);
                    a[i][0] = _mm256_fmadd_ps(pv, v0, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(pv, v1, a[i][1]);
                }
            }
            for (int i = 0; i < MQA_HO; i++) {
                _mm256_storeu_ps(o + i * r + k, a[i][0]);
                _mm256_storeu_ps(o + i * r + k + 8, a[i][1]);
            }
        }
    }
#endif
    for (int i = 0; i < n; i++)
        for (int64_t kk = k; kk < r; kk++) {
            float sum = acc ? o[i * r + kk] : 0.0f;
            for (int64_t j = j0; j < j1; j++) sum = fmaf(p[i * lp + j], rows[j][kk], sum);
            o[i * r + kk] = sum;
        }
}

int mls_latent_mqa(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                   int64_t qp_head, const int64_t *q_index, const float *cache, const int64_t *slots,
                   const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                   float scale, float *out, int threads) {
    const int64_t c = r + dr, queries = b * nq;
    if (queries <= 0 || h <= 0) return 0;
    int64_t splits = queries >= threads ? 1 : (threads + queries - 1) / queries;
    if (splits > h) splits = h;
    const int64_t hg = (h + splits - 1) / splits, items = queries * splits;
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: scores [hg, L] over the allowed rows (compacted), and those rows' addresses */
        float *s = (float *)malloc(sizeof(float) * (size_t)(hg * l) + 1);
        const float **rows = (const float **)malloc(sizeof(float *) * (size_t)l + 1);
        if (!s || !rows) {
#pragma omp atomic write
            rc = -4;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!s || !rows) continue;
            const int64_t qi = it / splits, h0 = (it % splits) * hg, h1 = h0 + hg < h ? h0 + hg : h;
            const uint8_t *m = mask + qi * l;
            const int64_t *sl = slots + (qi / nq) * l;
            const float *ql = q_lat + q_index[qi] * ql_tok, *qp = q_pe + q_index[qi] * qp_tok;
            float *o = out + qi * h * r;
            int64_t n_ok = 0;
            for (int64_t j = 0; j < l; j++)
                if (m[j]) rows[n_ok++] = cache + sl[j] * c;
            if (n_ok == 0) {
                for (int64_t k = h0 * r; k < h1 * r; k++) o[k] = NAN;
                continue;
            }
            for (int64_t hb = h0; hb < h1; hb += MQA_HS) {
                const int n = h1 - hb < MQA_HS ? (int)(h1 - hb) : MQA_HS;
                for (int64_t j = 0; j < n_ok; j++)
                    mqa_scores(rows[j], ql + hb * ql_head, ql_head, qp + hb * qp_head, qp_head, r, dr, n,
                               s + (hb - h0) * n_ok + j, n_ok);
            }
            for (int64_t hh = h0; hh < h1; hh++) {
                float *sh = s + (hh - h0) * n_ok, mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < n_ok; j++) sh[j] *= scale;
                for (int64_t j = 0; j < n_ok; j++) mx = sh[j] > mx ? sh[j] : mx;
                for (int64_t j = 0; j < n_ok; j++) sum += (sh[j] = expf(sh[j] - mx));
                for (int64_t j = 0; j < n_ok; j++) sh[j] = sh[j] / sum;
            }
            /* tiles of MQA_TILE rows (~160 KB at r + dr = 320) stay in L2 while every head block and
               output slice passes over them: the rows come from memory once, not once per 16 outputs */
            for (int64_t j0 = 0; j0 < n_ok; j0 += MQA_TILE) {
                const int64_t j1 = j0 + MQA_TILE < n_ok ? j0 + MQA_TILE : n_ok;
                for (int64_t hb = h0; hb < h1; hb += MQA_HO) {
                    const int n = h1 - hb < MQA_HO ? (int)(h1 - hb) : MQA_HO;
                    mqa_outputs(rows, j0, j1, s + (hb - h0) * n_ok, n_ok, n, r, j0 > 0, o + hb * r);
                }
            }
        }
        free(s);
        free((void *)rows);
    }
    return rc;
}

/* ---------------------------------------------------------------- decode-step glue
   Small per-layer operations that torch composes from several ops (each ~3-10 us of dispatch at one token):
   RMSNorm, and the latent row of a step (kv_a_layernorm, rope, cache write) with the query heads' rope. */

/* 1 / sqrt(mean(x^2) + eps): torch's fp32 rms_norm computes the same (pow, mean, add, rsqrt), summing the
   squares in another order (fp32 rounding). */
static float rms_inv(const float *x, int64_t d, float eps) {
    int64_t i = 0;
    float ss = 0.0f;
#ifdef MLS_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    ss = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < d; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)d + eps);
}

/* y = (x * inv) * w elementwise, in that order (torch: x * rsqrt(...), then * weight). */
static void scale_rows(const float *x, float inv, const float *w, int64_t d, float *y) {
    for (int64_t i = 0; i < d; i++) y[i] = (x[i] * inv) * w[i];
}

/* x [T, ldx] rows of d values -> y [T, ldy]: RMSNorm with weight w [d]. */
int mls_rms_norm(const float *x, int64_t t, int64_t d, int64_t ldx, const float *w, float eps, float *y,
                 int64_t ldy, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) scale_rows(x + i * ldx, rms_inv(x + i * ldx, d, eps), w, d, y + i * ldy);
    return 0;
}

/* Rotate one rope slice of dr values in place: pairs (x1_i, x2_i) = (x[2i], x[2i+1]) when interleaved, else
   (x[i], x[i + dr/2]); the result is [x1 cos - x2 sin | x2 cos + x1 sin] (de-interleaved), exactly the
   products and differences of models/layers.py apply_rope, so bit-identical to it. */
static void rope_slice(float *x, int64_t dr, const float *cos, const float *sin, int interleaved) {
    float tmp[MAX_ROPE];
    const int64_t half = dr / 2, step = interleaved ? 2 : 1, off = interleaved ? 1 : half;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i * step], x2 = x[i * step + off];
        tmp[i] = x1 * cos[i] - x2 * sin[i];
        tmp[half + i] = x2 * cos[i] + x1 * sin[i];
    }
    memcpy(x, tmp, sizeof(float) * (size_t)dr);
}

/* One step's latent rows and query rope, for T tokens:
     kv    [T, ldkv]  kv_a_proj_with_mqa's output rows [c_kv (r) | k_pe (dr)] (read only)
     q     [T, H, ldh] query heads, q_pe at column dn of each head: rotated in place
     cos, sin [T, dr/2]
   cache[slots[t]] (rows of ldc = r + dr, n_slots of them) = [rmsnorm(c_kv) * w | rope(k_pe)]. */
int mls_latent_rope_write(const float *kv, int64_t t, int64_t ldkv, int64_t r, int64_t dr, const float *w,
                          float eps, float *q, int64_t h, int64_t ldh, int64_t dn, const float *cos,
                          const float *sin, int interleaved, float *cache, int64_t n_slots,
                          const int64_t *slots, int threads) {
    if (dr > MAX_ROPE || dr % 2) return -2;
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= n_slots) return -5;
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) {
        const float *src = kv + i * ldkv, *ci = cos + i * (dr / 2), *si = sin + i * (dr / 2);
        float *row = cache + slots[i] * (r + dr);
        scale_rows(src, rms_inv(src, r, eps), w, r, row);
        memcpy(row + r, src + r, sizeof(float) * (size_t)dr);
        rope_slice(row + r, dr, ci, si, interleaved);
        for (int64_t hh = 0; hh < h; hh++) rope_slice(q + (i * h + hh) * ldh + dn, dr, ci, si, interleaved);
    }
    return 0;
}

/* ---------------------------------------------------------------- a decoder layer's decode step in one call
   A whole decoder layer for a step of T requests with one query each (pure decode, dense absorbed attention),
   every weight in ggml blocks: input RMSNorm; q_a, its norm and q_b (or q_proj); kv_a_proj; the latent row, its
   norm and rope, and the query rope (mls_latent_rope_write); q_nope W_UK per head (attn_k_b); the latent MQA
   (mls_latent_mqa); o_lat W_UV^T per head (attn_v_b); o_proj and the residual; the post-attention norm; the
   MLP (mls_moe_block, or a dense SwiGLU) and the residual. Every weight is in ggml blocks or F32 rows (type 0).
   The same operations as the per-op native path in the same order (each product's rows, the norms, the rope,
   the attention kernel), so the result equals it up to where that path leaves C: torch's silu (the dense
   SwiGLU), BLAS for F32 rows (another summation order), and the MoE block's own differences (listed above it).
   One call instead of ~20 native calls and ~60 tensor ops per layer. */
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
    int64_t int8; /* activations="int8": Q8_0 / Q4_0 products with int8 activations, as the per-op path's */
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
} mls_decode_step_t;

static int lin_apply(const mls_lin_t *L, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int int8,
                     int threads) {
    if (int8 && q8rows((int)L->type))
        return mls_gemm_q8((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, y, ldy, threads);
    return mls_gemm((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, 0, 1, 1, 1, L->n, y, ldy, threads);
}

/* rows of x [t, d] -> y: RMSNorm, exactly mls_rms_norm's per-row operations (y may be x) */
static void norm_rows(const float *x, int64_t t, int64_t d, const float *w, double eps, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) scale_rows(x + i * d, rms_inv(x + i * d, d, (float)eps), w, d, y + i * d);
}

/* y[tok, hh, i] (ldy per token, row length n per head) = head hh's ggml matrix rows (n of k values) . x[tok, hh]:
   the per-head products of GGUFHeads (absorb / expand), each row with the same operations as its grouped GEMV */
static int per_head(int64_t type, const uint8_t *w, int64_t head_stride, int64_t row_bytes, int64_t h, int64_t n,
                    int64_t k, const float *x, int64_t ldx, int64_t x_head, int64_t t, float *y, int64_t ldy,
                    int int8, int threads) {
    if (int8 && q8rows((int)type)) { /* as GGUFHeads with int8: the rows gathered head by head, one grouped call */
        float *xs = (float *)malloc(sizeof(float) * (size_t)(h * t * k + h * t * n) + 1);
        int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * h + 1));
        int rc = xs && ids ? 0 : -4;
        if (!rc) {
            float *ys = xs + h * t * k;
            for (int64_t hh = 0; hh < h; hh++) {
                ids[hh] = hh;
                ids[h + hh] = hh * t;
                for (int64_t tok = 0; tok < t; tok++)
                    memcpy(xs + (hh * t + tok) * k, x + tok * ldx + hh * x_head, sizeof(float) * (size_t)k);
            }
            ids[2 * h] = h * t;
            rc = mls_grouped_gemm_q8((int)type, xs, k, w, n, row_bytes, head_stride, ids, ids + h, h, ys, threads);
            for (int64_t hh = 0; !rc && hh < h; hh++)
                for (int64_t tok = 0; tok < t; tok++)
                    memcpy(y + tok * ldy + hh * n, ys + (hh * t + tok) * n, sizeof(float) * (size_t)n);
        }
        free(xs);
        free(ids);
        return rc;
    }
    const lin_kernel kern = lin_rows(type, row_bytes);
    const int64_t runs = (n + ROW_RUN - 1) / ROW_RUN;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < h * runs; it++) {
            const int64_t hh = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
            for (int64_t i = r0; i < r1; i++)
                lin_row(kern, w + hh * head_stride + i * row_bytes, x + hh * x_head, ldx, t, k, y + hh * n + i, ldy, buf);
        }
        free(buf);
    }
    return 0;
}

/* x [T, D] -> out [T, D] (out may not be x), the layer's cache [n_slots, r + dr] written at the step's slots.
   Returns 0, or the first refusal of a part (-1 type, -2 sizes, -3 router, -4 memory, -5 slot). */
int mls_decode_layer(const mls_layer_t *ly, const mls_decode_step_t *st, const float *x, float *out, float *cache,
                     int threads) {
    const int64_t t = st->t, d = ly->d, h = ly->h, dn = ly->dn, dr = ly->dr, dv = ly->dv, r = ly->r;
    const int64_t lq = h * (dn + dr), ql = ly->q_lora, inter = ly->mlp_inter;
    const int i8 = (int)ly->int8;
    if ((ql && !lin_for(ly->q_a.type).fn) || !lin_for(ly->q_b.type).fn || !lin_for(ly->kv_a.type).fn ||
        !lin_for(ly->o_proj.type).fn || !lin_for(ly->type_k).fn || !lin_for(ly->type_v).fn)
        return -1;
    /* the buffers below are sized from the layer's dimensions: every weight must agree with them */
    if ((ql && (ly->q_a.k != d || ly->q_a.n != ql)) || ly->q_b.k != (ql ? ql : d) || ly->q_b.n != lq ||
        ly->kv_a.k != d || ly->kv_a.n != r + dr || ly->o_proj.k != h * dv || ly->o_proj.n != d ||
        (ly->moe && ly->moe->d != d) ||
        (!ly->moe && (ly->mlp_gate.k != d || ly->mlp_gate.n != inter || ly->mlp_up.k != d || ly->mlp_up.n != inter ||
                      ly->mlp_down.k != inter || ly->mlp_down.n != d)))
        return -2;
    if (!ly->moe && (!lin_for(ly->mlp_gate.type).fn || !lin_for(ly->mlp_up.type).fn || !lin_for(ly->mlp_down.type).fn))
        return -1;
    const size_t nf = (size_t)(t * d + t * ql + t * lq + t * (r + dr) + 2 * t * h * r + t * h * dv + t * d +
                               t * 2 * inter + t * inter);
    float *mem = (float *)malloc(sizeof(float) * nf + 64);
    if (!mem) return -4;
    float *xn = mem, *cq = xn + t * d, *q = cq + t * ql, *kv = q + t * lq, *q_lat = kv + t * (r + dr);
    float *o_lat = q_lat + t * h * r, *o = o_lat + t * h * r, *a = o + t * h * dv, *gu = a + t * d;
    float *hh = gu + t * 2 * inter;
    int rc = 0;
    norm_rows(x, t, d, ly->norm_in, ly->eps_in, xn, threads);
    if (ql) {
        if ((rc = lin_apply(&ly->q_a, xn, t, d, cq, ql, i8, threads))) goto done;
        norm_rows(cq, t, ql, ly->norm_q, ly->eps_q, cq, threads);
        if ((rc = lin_apply(&ly->q_b, cq, t, ql, q, lq, i8, threads))) goto done;
    } else if ((rc = lin_apply(&ly->q_b, xn, t, d, q, lq, i8, threads)))
        goto done;
    if ((rc = lin_apply(&ly->kv_a, xn, t, d, kv, r + dr, i8, threads))) goto done;
    rc = mls_latent_rope_write(kv, t, r + dr, r, dr, ly->norm_kv, (float)ly->eps_kv, q, h, dn + dr, dn, st->cos,
                               st->sin, (int)ly->interleaved, cache, st->n_slots, st->slots, threads);
    if (rc) goto done;
    rc = per_head(ly->type_k, ly->k_b, ly->k_head_stride, ly->k_row_bytes, h, r, dn, q, lq, dn + dr, t, q_lat, h * r,
                  i8, threads);
    if (rc) goto done;
    rc = mls_latent_mqa(q_lat, h * r, r, q + dn, lq, dn + dr, st->q_index, cache, st->kv_slots, st->mask, t, 1, st->l,
                        h, r, dr, (float)ly->scale, o_lat, threads);
    if (rc) goto done;
    rc = per_head(ly->type_v, ly->v_b, ly->v_head_stride, ly->v_row_bytes, h, dv, r, o_lat, h * r, r, t, o, h * dv, i8,
                  threads);
    if (rc) goto done;
    if ((rc = lin_apply(&ly->o_proj, o, t, h * dv, a, d, i8, threads))) goto done;
    for (int64_t i = 0; i < t * d; i++) out[i] = x[i] + a[i];
    norm_rows(out, t, d, ly->norm_post, ly->eps_post, xn, threads);
    if (ly->moe) {
        if ((rc = mls_moe_block(ly->moe, xn, t, a, 0, 0, threads))) goto done;
    } else {
        if ((rc = lin_apply(&ly->mlp_gate, xn, t, d, gu, 2 * inter, i8, threads))) goto done;
        if ((rc = lin_apply(&ly->mlp_up, xn, t, d, gu + inter, 2 * inter, i8, threads))) goto done;
        for (int64_t tok = 0; tok < t; tok++)
            for (int64_t i = 0; i < inter; i++)
                hh[tok * inter + i] = silu_mul(gu[tok * 2 * inter + i], gu[tok * 2 * inter + inter + i]);
        if ((rc = lin_apply(&ly->mlp_down, hh, t, inter, a, d, i8, threads))) goto done;
    }
    for (int64_t i = 0; i < t * d; i++) out[i] += a[i];
done:
    free(mem);
    return rc;
}

int mls_abi_version(void) { return 10; }

/* AVX2 (+ F16C, FMA): the decoders, the fused decode-and-dot kernels and the int8-activation row kernels,
   8 lanes at a time. Compiled where the build's target has them (MLS_SIMD, common.h); x86/avx512.c
   widens the fused kernels and reuses the code extraction below. */

#ifdef MLS_SIMD
/* ---------------------------------------------------------------- AVX2 decoders
   The same values as the reference decoders (ref/decode.c: same products, same order), 8 lanes at a time. */

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

static inline __m256i fifth_bits(uint32_t qh) { /* bit j of qh -> 16 in byte lane j, else 0 */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)); /* one masked move for AVX2's five */
#else
    return _mm256_and_si256(bits32(qh), _mm256_set1_epi8(16));
#endif
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

/* MXFP4: the nibbles (low ones first, as Q4_0) through a byte table of the doubled e2m1 values */
static inline __m256i mxfp4_codes32(const uint8_t *q) {
    const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6,
                                           8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm256_shuffle_epi8(table, nibbles32(q));
}

static void simd_mxfp4(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 17, y += 32) store32_mul(mxfp4_codes32(b + 1), _mm256_set1_ps(e8m0_half(b[0])), y);
}

/* IQ4_NL / IQ4_XS: the nibbles (low ones first) through a byte table of IQ4_NL's 16 values (all within int8) */
static inline __m128i iq4nl_table(void) { return _mm_loadu_si128((const __m128i *)IQ4NL_VALUES); }

static inline __m256i iq4_codes32(const uint8_t *q) {
    const __m128i t = iq4nl_table();
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles32(q));
}

static void simd_iq4_nl(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 18, y += 32) store32_mul(iq4_codes32(b + 2), _mm256_set1_ps(f16(b)), y);
}

/* IQ4_XS's 8 sub-block scales d * (ls - 32), as ref/iquants.c forms them */
static inline void iq4_xs_scales(const uint8_t *b, float dl[8]) {
    const float d = f16(b);
    const int sh = b[2] | (b[3] << 8);
    for (int ib = 0; ib < 8; ib++)
        dl[ib] = d * (float)((((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)) - 32);
}

static void simd_iq4_xs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 136) {
        float dl[8];
        iq4_xs_scales(b, dl);
        for (int ib = 0; ib < 8; ib++, y += 32) store32_mul(iq4_codes32(b + 8 + 16 * ib), _mm256_set1_ps(dl[ib]), y);
    }
}

static void simd_q4_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 20, y += 32)
        store32_mul_add(nibbles32(b + 4), _mm256_set1_ps(f16(b)), _mm256_set1_ps(f16(b + 2)), y);
}

static void simd_q5_0(const uint8_t *b, float *y, int64_t k) {
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < k / 32; i++, b += 22, y += 32) {
        __m256i q = _mm256_or_si256(nibbles32(b + 6), fifth_bits(u32(b + 2)));
        store32_mul(_mm256_sub_epi8(q, sixteen), _mm256_set1_ps(f16(b)), y);
    }
}

static void simd_q5_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 24, y += 32) {
        __m256i q = _mm256_or_si256(nibbles32(b + 8), fifth_bits(u32(b + 4)));
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

/* ---------------------------------------------------------------- fused decode-and-dot (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
   For the commonest decode types the row is not decoded into a buffer: each block's codes are
   converted to float once, multiplied into up to FUSED_ROWS activation rows, and the block scale
   is applied to the block's partial sum: y += d * sum_j(q_j * x_j) instead of sum_j((d * q_j) * x_j).
   That is a different rounding of the same exact sum, inside the same fp32 bound as any summation
   order (|y - y_exact| <= (K + 2) u sum_j |d q_j x_j|); about half the instructions per weight. */
#define FUSED_ROWS 4

static inline float hsum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* lane r = the sum of P[r]'s 8 int32 lanes, r < 8 (exact: integers) */
static inline __m256i lane_sums8x8(const __m256i P[8]) {
    const __m256i a = _mm256_hadd_epi32(P[0], P[1]), b = _mm256_hadd_epi32(P[2], P[3]);
    const __m256i c = _mm256_hadd_epi32(P[4], P[5]), d = _mm256_hadd_epi32(P[6], P[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d); /* halves: rows 0-3 | rows 0-3 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* the low 16 bits of each int32 lane (an fp16) as 8 floats */
static inline __m256 f16_lanes(__m256i v) {
    v = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
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
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(u32(b + 2))), _mm256_set1_epi8(16));
#else
    /* n + 16 f - 16 as n | (f ? 0 : 0xF0) (two's complement: n - 16 where the fifth bit is clear): one andnot for
       the and and the subtraction (llama.cpp's ggml_vec_dot_q5_0_q8_0 on AVX2), the same bytes */
    return _mm256_or_si256(nibbles32(b + 6), _mm256_andnot_si256(bits32(u32(b + 2)), _mm256_set1_epi8((char)0xF0)));
#endif
}

/* A block's 32 codes as 16-value halves (g[0]: values 0..15, g[1]: 16..31), with the loads and shuffles each type
   needs and no more (a 256-bit load split again costs a shuffle per half: measured 8-13% at one row) */
static inline void block_codes16(const uint8_t *b, const int type, __m128i g[2]) {
    if (type == 8) {
        g[0] = _mm_loadu_si128((const __m128i *)(b + 2));
        g[1] = _mm_loadu_si128((const __m128i *)(b + 18));
    } else if (type == 39) { /* MXFP4: the table lookup of each nibble (mxfp4_codes32) */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1)), m4 = _mm_set1_epi8(0x0F);
        const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        g[0] = _mm_shuffle_epi8(table, _mm_and_si128(raw, m4));
        g[1] = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    } else if (type == 20 || type == 23) { /* IQ4_NL (b: the block), IQ4_XS (b: a sub-block's 16 bytes) */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(type == 20 ? b + 2 : b)), m4 = _mm_set1_epi8(0x0F);
        g[0] = _mm_shuffle_epi8(iq4nl_table(), _mm_and_si128(raw, m4));
        g[1] = _mm_shuffle_epi8(iq4nl_table(), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
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

static inline int64_t block_bytes(const int type) {
    return type == 8 ? 34 : type == 2 || type == 20 ? 18 : type == 39 ? 17 : 22;
}

/* a block's scale d: fp16 at its start, or MXFP4's e8m0 byte (the halved power of two its doubled codes take) */
static inline float block_d(const uint8_t *b, const int type) { return type == 39 ? e8m0_half(b[0]) : f16(b); }

/* one kernel for the three types (type is a constant where it is inlined, so each is specialised) */
static inline __attribute__((always_inline)) void fused_codes_mr(const uint8_t *b, const int type, const float *x,
                                                                 int64_t ldx, const int mr, int64_t k, float *y,
                                                                 int64_t ldy) {
    __m256 acc[8]; /* the row-chunk switch below names chunks up to 7 rows */
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 32; blk++, b += block_bytes(type)) {
        pf = prefetch_stream(pf, b);
        const __m256 d = _mm256_set1_ps(block_d(b, type));
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
CODES_MR(fused_mxfp4_mr, fused_codes_mr, 39)
CODES_MR(fused_iq4_nl_mr, fused_codes_mr, 20)

/* IQ4_XS: each 32-value sub-block as an IQ4_NL block whose d is the sub-block's scale d * (ls - 32) */
static inline __attribute__((always_inline)) void fused_iq4_xs_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                  const int mr, int64_t k, float *y, int64_t ldy) {
    __m256 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 136) {
        pf = prefetch_stream(pf, b);
        float dl[8];
        iq4_xs_scales(b, dl);
        for (int ib = 0; ib < 8; ib++) {
            const __m256 d = _mm256_set1_ps(dl[ib]);
            __m128i h[2];
            block_codes16(b + 8 + 16 * ib, 23, h);
            const __m256 w0 = i8x8(h[0]), w1 = i8x8(_mm_srli_si128(h[0], 8));
            const __m256 w2 = i8x8(h[1]), w3 = i8x8(_mm_srli_si128(h[1], 8));
            FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, x + blk * 256 + 32 * ib, ldx)
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* SIGNS8[s]: byte j is -1 where bit j of s is set, else 1 (_mm_sign_epi8's operand for 8 grid bytes), filled when
   the library loads: one load per group instead of a broadcast, a mask and a compare */
static uint64_t SIGNS8[256];
__attribute__((constructor)) static void signs8_init(void) {
    for (int s = 0; s < 256; s++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((s >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        SIGNS8[s] = v;
    }
}

/* The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): per 32-value sub-block, each 8-value
   group's codes as int8 in the low 8 bytes (grid bytes, magnitudes <= 62, with their sign bits applied; IQ1: the
   grid's -1 / 0 / 1, the group's delta added in float, exact) and the scale the reference forms (ref/iquants.c,
   the same expression), applied to the partial sum of the values sharing it: the whole sub-block, or its two
   16-value halves (IQ2_XS, IQ2_S, IQ1_M: the Q6_K scheme). One sub-block reader per type (iq_sub_t), shared by
   the 8-lane kernels below and the 16-lane ones of x86/avx512.c. */
static inline __m128i signed_grid8(uint64_t entry, uint8_t signs) {
    return _mm_sign_epi8(_mm_cvtsi64_si128((long long)entry), _mm_cvtsi64_si128((long long)SIGNS8[signs]));
}

typedef struct {
    __m128i g[4];    /* the 4 groups' int8 codes (low 8 bytes each) */
    float s0, s1;    /* the scales of values 0..15 and 16..31 (equal where one scale covers the sub-block) */
    float delta[4];  /* IQ1: each group's delta; else unused */
} iq_sub_t;

static inline float iq_d_f16(const uint8_t *b) { return f16(b); }

static inline __attribute__((always_inline)) void iq2_xxs_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint8_t *q = b + 2 + 8 * ib;
    const uint32_t aux = u32(q + 4);
    o->s0 = o->s1 = d * (0.5f + (float)(aux >> 28)) * 0.25f;
    for (int l = 0; l < 4; l++) o->g[l] = signed_grid8(IQ2XXS_GRID[q[l]], ksigns((aux >> (7 * l)) & 127));
}

static inline __attribute__((always_inline)) void iq3_xxs_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint8_t *q = b + 2 + 8 * ib;
    const uint32_t aux = u32(b + 66 + 4 * ib);
    o->s0 = o->s1 = d * (0.5f + (float)(aux >> 28)) * 0.5f;
    for (int l = 0; l < 4; l++)
        o->g[l] = signed_grid8(IQ3XXS_GRID[q[2 * l]] | (uint64_t)IQ3XXS_GRID[q[2 * l + 1]] << 32,
                               ksigns((aux >> (7 * l)) & 127));
}

/* IQ2_XS (74 bytes): 32 uint16 of a 9-bit grid index and 7 sign bits (+ parity); a 4-bit scale per 16 values
   (groups 4 ib, 4 ib + 1: the low nibble of byte 66 + ib; 4 ib + 2, 4 ib + 3: the high one) */
static inline __attribute__((always_inline)) void iq2_xs_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint8_t sc = b[66 + ib];
    o->s0 = d * (0.5f + (float)(sc & 0x0F)) * 0.25f;
    o->s1 = d * (0.5f + (float)(sc >> 4)) * 0.25f;
    for (int l = 0; l < 4; l++) {
        const uint16_t q = u16(b + 2 + 2 * (4 * ib + l));
        o->g[l] = signed_grid8(IQ2XS_GRID[q & 511], ksigns(q >> 9));
    }
}

/* IQ2_S (82 bytes): 8 low index bits per group, 2 high ones in qh, 8 sign bits per group; a 4-bit scale per 16 */
static inline __attribute__((always_inline)) void iq2_s_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint8_t sc = b[74 + ib];
    o->s0 = d * (0.5f + (float)(sc & 0x0F)) * 0.25f;
    o->s1 = d * (0.5f + (float)(sc >> 4)) * 0.25f;
    for (int l = 0; l < 4; l++) {
        const int gi = 4 * ib + l, idx = b[2 + gi] | (((b[66 + ib] >> (2 * l)) & 3) << 8);
        o->g[l] = signed_grid8(IQ2S_GRID[idx], b[34 + gi]);
    }
}

/* IQ3_S (110 bytes): per group two 9-bit indices of 4-value grid entries, 8 sign bits; a 4-bit scale per 32 */
static inline __attribute__((always_inline)) void iq3_s_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const int s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    const uint8_t qh = b[66 + ib];
    o->s0 = o->s1 = d * (float)(1 + 2 * s);
    for (int l = 0; l < 4; l++) {
        const int e = 8 * ib + 2 * l;
        const int i1 = b[2 + e] | (((qh >> (2 * l)) & 1) << 8), i2 = b[3 + e] | (((qh >> (2 * l + 1)) & 1) << 8);
        o->g[l] = signed_grid8(IQ3S_GRID[i1] | (uint64_t)IQ3S_GRID[i2] << 32, b[74 + 4 * ib + l]);
    }
}

/* IQ1's delta (+-1/8) from its sign bit, the float's bits formed in an integer: the bit is data, and a table
   lookup or a ?: compiled to a branch on it mispredicted every other group (IQ1_M 6x slower) */
static inline float iq1_delta(uint32_t negative) {
    const uint32_t bits = 0x3E000000u | (negative << 31); /* 0.125f with the sign bit */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IQ1_S (50 bytes): per 32 values a uint16 of 4 x 3 index bits, a 3-bit scale and the delta's sign */
static inline __attribute__((always_inline)) void iq1_s_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint16_t qh = u16(b + 34 + 2 * ib);
    const uint8_t *q = b + 2 + 4 * ib;
    o->s0 = o->s1 = d * (float)(2 * ((qh >> 12) & 7) + 1);
    for (int l = 0; l < 4; l++) {
        o->g[l] = _mm_cvtsi64_si128((long long)IQ1S_GRID[q[l] | (((qh >> (3 * l)) & 7) << 8)]);
        o->delta[l] = iq1_delta(qh >> 15);
    }
}

/* IQ1_M (56 bytes): per group 8 index bits and a nibble (3 index bits, the delta's sign); a 3-bit scale per 16
   values in 4 uint16 whose top nibbles hold the fp16 d */
static inline float iq1_m_d(const uint8_t *b) {
    const uint16_t s0 = u16(b + 48), s1 = u16(b + 50), s2 = u16(b + 52), s3 = u16(b + 54);
    const uint16_t dbits = (s0 >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000);
    const uint8_t dbytes[2] = {(uint8_t)dbits, (uint8_t)(dbits >> 8)};
    return f16(dbytes);
}

static inline __attribute__((always_inline)) void iq1_m_sub(const uint8_t *b, float d, int ib, iq_sub_t *o) {
    const uint16_t sw = u16(b + 48 + 2 * (ib / 2)); /* halves 2 ib, 2 ib + 1: word ib / 2, bits 6 (ib % 2) + 0, 3 */
    const int sh = 6 * (ib % 2);
    o->s0 = d * (float)(2 * ((sw >> sh) & 7) + 1);
    o->s1 = d * (float)(2 * ((sw >> (sh + 3)) & 7) + 1);
    const uint16_t qh = u16(b + 32 + 2 * ib); /* the 4 groups' nibbles */
    const uint8_t *q = b + 4 * ib;
    for (int l = 0; l < 4; l++) {
        const int nib = (qh >> (4 * l)) & 0x0F;
        o->g[l] = _mm_cvtsi64_si128((long long)IQ1S_GRID[q[l] | ((nib & 7) << 8)]);
        o->delta[l] = iq1_delta((uint32_t)nib >> 3);
    }
}

/* acc[i] += s0 * (w0 x[i, 0:8] + w1 x[i, 8:16]) + s1 * (w2 x[i, 16:24] + w3 x[i, 24:32]) for i < mr */
#define FUSED_HALVES(mr, acc, s0, s1, w0, w1, w2, w3, xb, ldx)                                 \
    for (int i = 0; i < (mr); i++) {                                                           \
        const float *xi = (xb) + i * (ldx);                                                    \
        __m256 p0 = _mm256_mul_ps((w0), _mm256_loadu_ps(xi));                                  \
        p0 = _mm256_fmadd_ps((w1), _mm256_loadu_ps(xi + 8), p0);                               \
        __m256 p1 = _mm256_mul_ps((w2), _mm256_loadu_ps(xi + 16));                             \
        p1 = _mm256_fmadd_ps((w3), _mm256_loadu_ps(xi + 24), p1);                              \
        (acc)[i] = _mm256_fmadd_ps((s1), p1, _mm256_fmadd_ps((s0), p0, (acc)[i]));             \
    }

/* name(b, x, ldx, mr, k, y, ldy): a grid type's 8-lane kernel from its block bytes, d reader and sub-block reader;
   halves: the two 16-value scales apply apart; deltas: IQ1's per-group delta is added to the codes */
#define GRID_MR(name, bytes, d_of, sub, halves, deltas)                                                           \
    static inline __attribute__((always_inline)) void name(const uint8_t *b, const float *x, int64_t ldx,        \
                                                           const int mr, int64_t k, float *y, int64_t ldy) {    \
        __m256 acc[8];                                                                                          \
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();                                              \
        const char *pf = (const char *)b + PREFETCH_AHEAD;                                                      \
        for (int64_t blk = 0; blk < k / 256; blk++, b += (bytes)) {                                             \
            pf = prefetch_stream(pf, b);                                                                        \
            const float d = d_of(b);                                                                            \
            for (int ib = 0; ib < 8; ib++) {                                                                    \
                iq_sub_t o;                                                                                     \
                sub(b, d, ib, &o);                                                                              \
                __m256 w[4];                                                                                    \
                for (int l = 0; l < 4; l++)                                                                     \
                    w[l] = (deltas) ? _mm256_add_ps(i8x8(o.g[l]), _mm256_set1_ps(o.delta[l])) : i8x8(o.g[l]);   \
                const __m256 s0 = _mm256_set1_ps(o.s0), s1 = _mm256_set1_ps(o.s1);                              \
                const float *xb = x + blk * 256 + 32 * ib;                                                      \
                if (halves) {                                                                                   \
                    FUSED_HALVES(mr, acc, s0, s1, w[0], w[1], w[2], w[3], xb, ldx)                              \
                } else {                                                                                        \
                    FUSED_BLOCK(mr, acc, s0, w[0], w[1], w[2], w[3], xb, ldx)                                   \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);                                                \
    }
GRID_MR(fused_iq2_xxs_mr, 66, iq_d_f16, iq2_xxs_sub, 0, 0)
GRID_MR(fused_iq3_xxs_mr, 98, iq_d_f16, iq3_xxs_sub, 0, 0)
GRID_MR(fused_iq2_xs_mr, 74, iq_d_f16, iq2_xs_sub, 1, 0)
GRID_MR(fused_iq2_s_mr, 82, iq_d_f16, iq2_s_sub, 1, 0)
GRID_MR(fused_iq3_s_mr, 110, iq_d_f16, iq3_s_sub, 0, 0)
GRID_MR(fused_iq1_s_mr, 50, iq_d_f16, iq1_s_sub, 0, 1)
GRID_MR(fused_iq1_m_mr, 56, iq1_m_d, iq1_m_sub, 1, 1)

/* The ternary types: 2-bit codes (TQ2_0), base-3 digits (TQ1_0), one fp16 d per 256 values on each 32-value
   partial sum. */
/* TQ2_0 (66 bytes): 2-bit codes, value 32 j + m of chunk (j, l) in bits 2 l of byte 32 j + m; code - 1 */
static inline __attribute__((always_inline)) void fused_tq2_0_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                 const int mr, int64_t k, float *y, int64_t ldy) {
    __m256 acc[8];
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 66) {
        pf = prefetch_stream(pf, b);
        const __m256 d = _mm256_set1_ps(f16(b + 64));
        for (int j = 0; j < 2; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 32 * j));
            for (int l = 0; l < 4; l++) {
                const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * l)), three), one);
                const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                const __m256 w0 = i8x8(lo), w1 = i8x8(_mm_srli_si128(lo, 8)), w2 = i8x8(hi), w3 = i8x8(_mm_srli_si128(hi, 8));
                FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, x + blk * 256 + 128 * j + 32 * l, ldx)
            }
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* TQ1_0's base-3 digit of 8 bytes (as int32 lanes) times their powers of 3: ((uint8)(q p) * 3) >> 8, minus 1 */
static inline __m256 tq1_digits8(__m256i q, __m256i pow3) {
    const __m256i t = _mm256_and_si256(_mm256_mullo_epi32(q, pow3), _mm256_set1_epi32(0xFF));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(_mm256_mullo_epi32(t, _mm256_set1_epi32(3)), 8),
                                               _mm256_set1_epi32(1)));
}

static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* TQ1_0 (54 bytes): values 0..159: digit n of bytes 0..31; 160..239: digit n of bytes 32..47; 240..255: digit n
   of bytes 48..51 (ref/iquants.c row_tq1_0's order); 32 values per partial sum, d per super-block */
static inline __attribute__((always_inline)) void fused_tq1_0_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                 const int mr, int64_t k, float *y, int64_t ldy) {
    __m256 acc[8];
    static const int POW3[5] = {1, 3, 9, 27, 81};
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 54) {
        pf = prefetch_stream(pf, b);
        const __m256 d = _mm256_set1_ps(f16(b + 52));
        const float *xb = x + blk * 256;
        const __m256i q0 = u8x8(b), q1 = u8x8(b + 8), q2 = u8x8(b + 16), q3 = u8x8(b + 24);
        for (int n = 0; n < 5; n++) { /* values 32 n .. 32 n + 31 */
            const __m256i p = _mm256_set1_epi32(POW3[n]);
            const __m256 w0 = tq1_digits8(q0, p), w1 = tq1_digits8(q1, p), w2 = tq1_digits8(q2, p), w3 = tq1_digits8(q3, p);
            FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, xb + 32 * n, ldx)
        }
        const __m256i r0 = u8x8(b + 32), r1 = u8x8(b + 40);
        for (int n = 0; n < 4; n += 2) { /* values 160 + 16 n .. : digits n and n + 1 of bytes 32..47 */
            const __m256i p0 = _mm256_set1_epi32(POW3[n]), p1 = _mm256_set1_epi32(POW3[n + 1]);
            const __m256 w0 = tq1_digits8(r0, p0), w1 = tq1_digits8(r1, p0), w2 = tq1_digits8(r0, p1), w3 = tq1_digits8(r1, p1);
            FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, xb + 160 + 16 * n, ldx)
        }
        /* values 224..239: digit 4 of bytes 32..47; 240..255: digits 0..3 of bytes 48..51, 4 values each */
        const __m256i p4 = _mm256_set1_epi32(81), tail = _mm256_cvtepu8_epi32(_mm_set1_epi32((int)u32(b + 48)));
        const __m256 w0 = tq1_digits8(r0, p4), w1 = tq1_digits8(r1, p4);
        const __m256 w2 = tq1_digits8(tail, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
        const __m256 w3 = tq1_digits8(tail, _mm256_setr_epi32(9, 9, 9, 9, 27, 27, 27, 27));
        FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, xb + 224, ldx)
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* One weight row (raw blocks b) times m activation rows (x, stride ldx) -> y[i * ldy], in chunks of `chunk`
   rows (FUSED_ROWS = 4 for AVX2, 8 for AVX-512); the chunk size is a constant in each call so the accumulators
   stay in registers. */
#define FUSED_ROW_FN(name, kernel, bytes, chunk)                                                      \
    static void name(const uint8_t *b, const float *x, int64_t ldx, int64_t m, int64_t k, float *y,      \
                     int64_t ldy) {                                                                   \
        int64_t i = 0;                                                                                \
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
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 210) {
        pf = prefetch_stream(pf, b);
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
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 144) {
        pf = prefetch_stream(pf, b);
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

/* compressed-tensors' pack-quantized INT4 (quant/int4_group.py): 16 bytes hold 32 columns in order, two per byte,
   low nibble first, each q + 8. -> g[0] the codes q of columns 0..15, g[1] of 16..31, as int8 (the interleave
   of the low and high nibbles puts them in column order; Q4_0 keeps its low nibbles first instead). */
static inline void int4_codes16(const uint8_t *b, __m128i g[2]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    g[0] = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
    g[1] = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
}

/* INT4 decoder: q * the group's scale for 32 columns at a time (row_int4's products); a group that is not
   whole 32-column chunks takes the scalar decoder's arithmetic */
static void simd_int4(const uint8_t *q, const float *srow, int64_t group, float *y, int64_t k) {
    if (group % 32) {
        row_int4(q, srow, group, y, k);
        return;
    }
    for (int64_t c = 0; c + 32 <= k; c += 32) {
        __m128i g[2];
        int4_codes16(q + c / 2, g);
        store32_mul(_mm256_set_m128i(g[1], g[0]), _mm256_set1_ps(srow[c / group]), y + c);
    }
}

/* INT4 decode-and-dot, the Q4_0 scheme (FUSED_BLOCK: the 32 codes times each row, the group's scale applied to
   that partial sum) with the pack's nibble order and a float scale per group of `group` columns (a multiple of
   32) read from the row's scales */
static inline __attribute__((always_inline)) void fused_int4_mr(const uint8_t *b, const float *srow, int64_t group,
                                                                const float *x, int64_t ldx, const int mr,
                                                                int64_t k, float *y, int64_t ldy) {
    __m256 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const int64_t per = group / 32;
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t gi = 0, blk = 0; gi < k / group; gi++) {
        const __m256 d = _mm256_set1_ps(srow[gi]);
        for (int64_t j = 0; j < per; j++, blk++, b += 16) {
            pf = prefetch_stream(pf, b);
            __m128i g[2];
            int4_codes16(b, g);
            const __m256 w0 = i8x8(g[0]), w1 = i8x8(_mm_srli_si128(g[0], 8));
            const __m256 w2 = i8x8(g[1]), w3 = i8x8(_mm_srli_si128(g[1], 8));
            FUSED_BLOCK(mr, acc, d, w0, w1, w2, w3, x + blk * 32, ldx)
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

/* FUSED_ROW_FN for the kernels whose scales lie apart (the row's srow, `group` columns each): the shape of
   types.c's fused_scaled */
#define SCALED_ROW_FN(name, kernel, bytes, chunk)                                                          \
    static void name(const uint8_t *b, const float *s, int64_t group, const float *x, int64_t ldx, int64_t m, \
                     int64_t k, float *y, int64_t ldy) {                                                   \
        int64_t i = 0;                                                                                     \
        for (; i + (chunk) <= m; i += (chunk)) kernel(b, s, group, x + i * ldx, ldx, (chunk), k, y + i * ldy, ldy); \
        switch (m - i) {                                                                                   \
        case 7: kernel(b, s, group, x + i * ldx, ldx, 7, k, y + i * ldy, ldy); break;                      \
        case 6: kernel(b, s, group, x + i * ldx, ldx, 6, k, y + i * ldy, ldy); break;                      \
        case 5: kernel(b, s, group, x + i * ldx, ldx, 5, k, y + i * ldy, ldy); break;                      \
        case 4: kernel(b, s, group, x + i * ldx, ldx, 4, k, y + i * ldy, ldy); break;                      \
        case 3: kernel(b, s, group, x + i * ldx, ldx, 3, k, y + i * ldy, ldy); break;                      \
        case 2: kernel(b, s, group, x + i * ldx, ldx, 2, k, y + i * ldy, ldy); break;                      \
        case 1: kernel(b, s, group, x + i * ldx, ldx, 1, k, y + i * ldy, ldy); break;                      \
        default: break;                                                                                    \
        }                                                                                                  \
    }

#ifndef MLS_AVX512 /* otherwise x86/avx512.c instantiates these names with its 16-lane kernels */
FUSED_ROW_FN(fused_q8_0, fused_q8_0_mr, k / 32 * 34, FUSED_ROWS)
FUSED_ROW_FN(fused_q4_0, fused_q4_0_mr, k / 32 * 18, FUSED_ROWS)
FUSED_ROW_FN(fused_q5_0, fused_q5_0_mr, k / 32 * 22, FUSED_ROWS)
FUSED_ROW_FN(fused_mxfp4, fused_mxfp4_mr, k / 32 * 17, FUSED_ROWS)
FUSED_ROW_FN(fused_iq4_nl, fused_iq4_nl_mr, k / 32 * 18, FUSED_ROWS)
FUSED_ROW_FN(fused_iq4_xs, fused_iq4_xs_mr, k / 256 * 136, FUSED_ROWS)
FUSED_ROW_FN(fused_q4_k, fused_q4_k_mr, k / 256 * 144, FUSED_ROWS)
FUSED_ROW_FN(fused_q6_k, fused_q6_k_mr, k / 256 * 210, FUSED_ROWS)
SCALED_ROW_FN(fused_int4, fused_int4_mr, k / 2, FUSED_ROWS)
FUSED_ROW_FN(fused_iq2_xxs, fused_iq2_xxs_mr, k / 256 * 66, FUSED_ROWS)
FUSED_ROW_FN(fused_iq3_xxs, fused_iq3_xxs_mr, k / 256 * 98, FUSED_ROWS)
FUSED_ROW_FN(fused_iq2_xs, fused_iq2_xs_mr, k / 256 * 74, FUSED_ROWS)
FUSED_ROW_FN(fused_iq2_s, fused_iq2_s_mr, k / 256 * 82, FUSED_ROWS)
FUSED_ROW_FN(fused_iq3_s, fused_iq3_s_mr, k / 256 * 110, FUSED_ROWS)
FUSED_ROW_FN(fused_iq1_s, fused_iq1_s_mr, k / 256 * 50, FUSED_ROWS)
FUSED_ROW_FN(fused_iq1_m, fused_iq1_m_mr, k / 256 * 56, FUSED_ROWS)
#endif
/* the 8-lane kernels in both builds (no 16-lane variant: the digits are formed in 32-bit lanes, 8 at a time) */
FUSED_ROW_FN(fused_tq1_0, fused_tq1_0_mr, k / 256 * 54, FUSED_ROWS)
FUSED_ROW_FN(fused_tq2_0, fused_tq2_0_mr, k / 256 * 66, FUSED_ROWS)

/* ---------------------------------------------------------------- int8 activations (int8.c): the row kernels
   One weight row (raw blocks b) times m quantized activation rows (xq [m, k] int8, xd [m, k / 32]) ->
   y[i * ldy]; each weight block is unpacked once per chunk of up to 4 rows. */
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

/* The 32-value block types against Q8_0-style activations (one scale per 32 values), llama.cpp's
   vec_dot_q4_0_q8_0 and its kin: a block's codes as 32 int8 lanes (signed: Q8_0, Q4_0 nibble - 8, Q5_0 five bits
   - 16, IQ4_NL's table values; unsigned: Q4_1 nibbles, Q5_1 five bits), each activation block's products summed
   exactly in 8 int32 lanes of 4 values, then per lane acc = fma(d_w * d_x, S, acc); Q4_1 / Q5_1 (value = d q + m)
   add their min per lane: acc = fma(m * d_x, X, acc), X the lane's sum of activation codes (llama.cpp's q8_1 keeps
   d_x times that sum in the activation block; here the kernel forms it: the slots hold one float per 32 values).
   The row's 8 lanes are summed as hsum8 does. ref/int8.c runs the same lanes and operations (fmaf), so every
   build gives the same bits, and a row's result does not depend on the rows that share its call. */
static inline __m256i q8_codes32(const uint8_t *b, const int type) {
    switch (type) {
    case 8: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case 2: return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    case 6: return q5_0_codes(b);
    case 20: return iq4_codes32(b + 2);
    case 3: return nibbles32(b + 4);
    default: return _mm256_or_si256(nibbles32(b + 8), fifth_bits(u32(b + 4)));
    }
}
static inline int64_t q8_block_bytes(const int type) {
    return type == 8 ? 34 : type == 2 || type == 20 ? 18 : type == 6 ? 22 : type == 3 ? 20 : 24;
}

static inline __attribute__((always_inline)) void q8rows_mr(const uint8_t *b, const int type, const int8_t *xq,
                                                            const float *xd, const int mr, int64_t k, float *y,
                                                            int64_t ldy) {
    __m256 acc[4];
    const int64_t kb = k / 32, bytes = q8_block_bytes(type);
    const int with_min = type == 3 || type == 7;
    const __m256i ones = _mm256_set1_epi8(1);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < kb; blk++, b += bytes) {
        pf = prefetch_stream(pf, b);
        const __m256i w = q8_codes32(b, type);
        const __m256i aw = _mm256_sign_epi8(w, w);
        const float dw = f16(b), mw = with_min ? f16(b + 2) : 0.0f;
        for (int i = 0; i < mr; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * k + blk * 32));
            const float dx = xd[i * kb + blk];
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), i8dot32(aw, w, x), acc[i]);
            if (with_min) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(mw * dx), i8dot32(ones, ones, x), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = hsum8(acc[i]);
}

#define Q8ROWS_FN(name, type)                                                                              \
    static void name(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,    \
                     int64_t ldy) {                                                                        \
        const int64_t kb = k / 32;                                                                         \
        int64_t i = 0;                                                                                     \
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
Q8ROWS_FN(q8rows_q4_1, 3)
Q8ROWS_FN(q8rows_q5_0, 6)
Q8ROWS_FN(q8rows_q5_1, 7)
Q8ROWS_FN(q8rows_iq4_nl, 20)

/* ---------------------------------------------------------------- int8 activations for the K-quants (Q8_K-style)
   llama.cpp's scheme (ggml_vec_dot_q4_K_q8_K and its kin): per super-block of 256 values and activation row,
   every sub-block's u8 x s8 products are summed exactly in int32, times the sub-block's integer scale, summed in
   int32 over the super-block (|S| < 2^28), and only then touch floats, in a fixed order per row:
     Q4_K, Q5_K: y += (d * d_x) * S;  y -= (dmin * d_x) * M   (S = sum_j sc_j sum_i q_i x_i, M = sum_j m_j bsum_j)
     Q6_K:       y += (d * d_x) * S                            (S = sum_g sc_g sum_i (q_i - 32) x_i)
   ref/int8.c runs the same integer sums and the same float operations, so every build (VNNI, AVX2, scalar)
   gives the same bits, and a row's result does not depend on how many rows share the call. */

/* acc plus 8 int32 lanes, lane l = sc(l) * (the sum of the 4 products u[4l..4l+3] * s[4l..4l+3]): sc holds the
   int16 scale of values 0..15 in its low 128 bits and of values 16..31 in its high 128 bits (Q8K_SCALES). maddubs
   forms the pair sums, vpdpwssd (madd16_acc) scales and adds them: u <= 127 and |s| <= 127 (q8_K codes are
   clamped to +-127), so a pair stays inside int16 (2 * 127 * 127 = 32258) and the sums are exact. Until
   2026-12-07 the VNNI builds took vpdpbusd into a zero, vpmulld by a 32-bit scale and an add: the same integers
   in 5 uops per activation row and 32 values where these take 2. */
#define Q8K_SCALES(lo, hi) _mm256_set_m128i(_mm_set1_epi16((short)(hi)), _mm_set1_epi16((short)(lo)))
static inline __m256i madd16_acc(__m256i acc, __m256i p16, __m256i sc16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p16, sc16);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p16, sc16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc16));
#endif
}
static inline __m256i dot_u8s8_scaled_acc(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return madd16_acc(acc, _mm256_maddubs_epi16(u, s), sc);
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The q8_K row kernels' end of a super-block: acc[i] += (dw * d_x[i]) * S[i], S[i] the sum of s[i]'s int32 lanes,
   and where ms is given (the K-quants' mins) acc[i] -= (dmin * d_x[i]) * M[i], M[i] the sum of ms[i]'s lanes, for
   the rows i < mr; d_x[i] the rows' activation scales of the block (q8k_meta.d; xd at row 0's meta, `slots`
   floats per row). Two to four rows take their integer sums together (three hadds for all where hsum_i32 took seven
   instructions per row: the same integers) and the fp32 steps in one vector, lane i the scalar loop's operations in
   its order (-ffp-contract=off: no fused multiply-add), so every row keeps its bits; one row keeps that loop (the
   hadds cost it more shuffles than they save: 5-8% slower at one row on the 2-core AMX Xeon measured, 2026-12-05). */
static inline __m128i hsum4_i32(const __m256i s[4], const int mr) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i ab = _mm256_hadd_epi32(s[0], s[1]); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    const __m256i cd = mr > 2 ? _mm256_hadd_epi32(s[2], mr > 3 ? s[3] : z) : z;
    const __m256i all = _mm256_hadd_epi32(ab, cd); /* a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7 */
    return _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
}

static inline int32_t hsum_i32x4(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

static inline __attribute__((always_inline)) void q8k_block_end(float acc[4], const __m256i s[4], const __m128i *ms,
                                                                const float dw, const float dmin, const float *xd,
                                                                const int64_t slots, const int mr) {
    if (mr == 1) {
        acc[0] += (dw * xd[0]) * (float)hsum_i32(s[0]);
        if (ms) acc[0] -= (dmin * xd[0]) * (float)hsum_i32x4(ms[0]);
        return;
    }
    const __m128 dx = _mm_setr_ps(xd[0], xd[slots], mr > 2 ? xd[2 * slots] : 0.0f, mr > 3 ? xd[3 * slots] : 0.0f);
    __m128 a = _mm_loadu_ps(acc);
    a = _mm_add_ps(a, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dw), dx), _mm_cvtepi32_ps(hsum4_i32(s, mr))));
    if (ms) {
        const __m128i z = _mm_setzero_si128();
        const __m128i cd = mr > 2 ? _mm_hadd_epi32(ms[2], mr > 3 ? ms[3] : z) : z;
        const __m128i m = _mm_hadd_epi32(_mm_hadd_epi32(ms[0], ms[1]), cd);
        a = _mm_sub_ps(a, _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dmin), dx), _mm_cvtepi32_ps(m)));
    }
    _mm_storeu_ps(acc, a);
}

/* The Q4_K / Q5_K / Q6_K row kernels below take their integer sums in the same form (llama.cpp's
   ggml_vec_dot_q4_K_q8_K / q6_K_q8_K on AVX2): maddubs' int16 pair sums of unsigned codes times activation codes
   (u <= 63), then one vpdpwssd (or vpmaddwd and an add without VNNI) by the sub-block's int16 scale. Q6_K's codes
   stay unsigned (0..63): sum (q - 32) x = sum q x - 32 sum x, the second term by a second maddubs with 32s, in
   int16 (|sum q x - 32 sum x| over a pair <= 2 * 63 * 127 + 2 * 32 * 127 < 2^15). The sums are the same
   integers, so every result keeps its bits. */

/* a Q4_K / Q5_K super-block's 6-bit sub-block scales and mins (k_scales_int) as 16 bytes: scales 0..7, mins 0..7
   (llama.cpp's utmp shuffle of the 12 scale bytes) */
static inline __m128i k_scales_mins8(const uint8_t *s) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t sc_lo = u[0] & m6, sc_hi = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    const uint32_t mn_lo = u[1] & m6, mn_hi = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    return _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
}

/* int16 lanes all equal to lane j (0..7) of v (int16 x8 in both 128-bit halves) */
static inline __m256i bcast16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
}

static inline __attribute__((always_inline)) void q8k_q45_mr(const uint8_t *b, const int five, const int8_t *xq,
                                                             const float *xd, const int mr, int64_t k, float *y,
                                                             int64_t ldy) {
    const int64_t slots = k / 32, bytes = five ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += bytes) {
        pf = prefetch_stream(pf, b);
        const __m128i sm = k_scales_mins8(b + 4);
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm)); /* scales 0..7, both halves */
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        const float dw = f16(b), dmin = f16(b + 2);
        const uint8_t *qs = b + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256i sum[4][2]; /* two chains per row: one vpdpwssd's latency (5 cycles) would bound a single one */
        for (int i = 0; i < mr; i++) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                __m256i w = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, m4);
                if (five)
                    w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4));
                const __m256i s = bcast16(sc16, j);
                for (int i = 0; i < mr; i++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * k + blk * 256 + 32 * j));
                    sum[i][h] = madd16_acc(sum[i][h], _mm256_maddubs_epi16(w, x), s);
                }
            }
        }
        __m256i s[4];
        __m128i ms[4]; /* mins x code sums: lane j the pair of sub-blocks 2j, 2j + 1 (exact int32) */
        for (int i = 0; i < mr; i++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            s[i] = _mm256_add_epi32(sum[i][0], sum[i][1]);
            ms[i] = _mm_madd_epi16(mn16, _mm_loadu_si128((const __m128i *)meta->bsum));
        }
        q8k_block_end(acc, s, ms, dw, dmin, xd + blk * Q8K_SLOTS, slots, mr);
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = acc[i];
}

/* Q6_K: unsigned codes q (0..63) and sum (q - 32) x = sum q x - 32 sum x per int16 pair (above). One super-block
   br's exact int32 lanes P[i] against mr activation rows' codes (xb + i k: row i's codes of this super-block): the
   row kernel's integers, and the side-by-side kernels' (x86/rows8_q8k.c rows8_nomin) */
static inline __attribute__((always_inline)) void q6k_sums(const uint8_t *br, const int8_t *xb, int64_t k, const int mr,
                                                           __m256i *P) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    const __m128i scs = _mm_loadu_si128((const __m128i *)(br + 192)); /* 16 int8 scales, one per 16 values */
    __m256i sum[4][2]; /* two chains per row, as in q8k_q45_mr */
    for (int i = 0; i < mr; i++) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(br + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(br + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(br + 128 + 32 * h));
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(g & 1 ? ql1 : ql0, 4) : (g & 1 ? ql1 : ql0), m4);
            const __m256i hi = _mm256_and_si256(g ? _mm256_srli_epi16(qh, 2 * g) : qh, m3);
            const __m256i w = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            const int t = 128 * h + 32 * g, q = t >> 4; /* values 0..15 take scale q, 16..31 scale q + 1 */
            const __m128i pick = _mm_set_epi64x((long long)(0x0101010101010101ULL * (uint64_t)(q + 1)),
                                                (long long)(0x0101010101010101ULL * (uint64_t)q));
            const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scs, pick));
            for (int i = 0; i < mr; i++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xb + i * k + t));
                const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(w, x), _mm256_maddubs_epi16(k32, x));
                sum[i][g & 1] = madd16_acc(sum[i][g & 1], p, s);
            }
        }
    }
    for (int i = 0; i < mr; i++) P[i] = _mm256_add_epi32(sum[i][0], sum[i][1]);
}

static inline __attribute__((always_inline)) void q8k_q6k_mr(const uint8_t *b, const int8_t *xq, const float *xd,
                                                             const int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t slots = k / 32;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 210) {
        pf = prefetch_stream(pf, b);
        __m256i s[4];
        q6k_sums(b, xq + blk * 256, k, mr, s);
        q8k_block_end(acc, s, NULL, f16(b + 208), 0.0f, xd + blk * Q8K_SLOTS, slots, mr);
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = acc[i];
}

/* IQ4_XS: IQ4_NL's table values (signed, |q| <= 127: their magnitudes into maddubs / vpdpbusd, their signs onto
   x) in 32-value sub-blocks with integer scales ls - 32; S = sum_ib (ls_ib - 32) sum_i q_i x_i, y += (d * d_x) * S
   (llama.cpp's ggml_vec_dot_iq4_xs_q8_K) */
static inline void iq4_xs_ls(const uint8_t *b, int32_t ls[8]) {
    const int sh = b[2] | (b[3] << 8);
    for (int ib = 0; ib < 8; ib++) ls[ib] = ((((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4))) - 32;
}

/* the 8 sub-block scales ls - 32 of an IQ4_XS super-block as int16 lanes 0..7, in both 128-bit halves (a bcast16
   source): iq4_xs_ls's integers in ~12 vector instructions where its scalar loop took ~50 */
static inline __m256i iq4_xs_scales16(const uint8_t *b) {
    const __m128i sl = _mm_cvtsi32_si128((int)u32(b + 4)), m4 = _mm_set1_epi8(0x0F);
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(sl, m4), _mm_and_si128(_mm_srli_epi16(sl, 4), m4)); /* ib order */
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u16(b + 2)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
    const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(nib), _mm256_slli_epi32(hi, 4)),
                                        _mm256_set1_epi32(32));
    return _mm256_broadcastsi128_si256(_mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1)));
}

/* one IQ4_XS super-block br's exact int32 lanes P[i] against mr activation rows' codes (xb + i k) */
static inline __attribute__((always_inline)) void iq4xs_sums(const uint8_t *br, const int8_t *xb, int64_t k,
                                                             const int mr, __m256i *P) {
    const __m256i sc16 = iq4_xs_scales16(br);
    for (int i = 0; i < mr; i++) P[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const __m256i w = iq4_codes32(br + 8 + 16 * ib), aw = _mm256_sign_epi8(w, w), s = bcast16(sc16, ib);
        for (int i = 0; i < mr; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xb + i * k + 32 * ib));
            P[i] = dot_u8s8_scaled_acc(P[i], aw, _mm256_sign_epi8(x, w), s);
        }
    }
}

static inline __attribute__((always_inline)) void q8k_iq4xs_mr(const uint8_t *b, const int8_t *xq, const float *xd,
                                                               const int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t slots = k / 32;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 136) {
        pf = prefetch_stream(pf, b);
        __m256i sum[4];
        iq4xs_sums(b, xq + blk * 256, k, mr, sum);
        q8k_block_end(acc, sum, NULL, f16(b), 0.0f, xd + blk * Q8K_SLOTS, slots, mr);
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = acc[i];
}

/* The sign-grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) on q8_K, llama.cpp's way (ggml_vec_dot_iq2_xxs_q8_K
   and kin): the grid bytes as they are stored (all in 1..62) into the unsigned operand, each group's sign bits onto
   the activations as one 64-bit word of +-1 bytes from a table (KSIGNS64: 7 bits + parity, ksigns; SIGNS8: 8 stored
   bits), and no sub-block reader (iq_sub_t's signed codes, their magnitudes and their float scales, which the int8
   products never read; until 2026-12-03 these types went through it as IQ1 still does: iq1_operands). Each product
   g x (+-1) is the one |w| sign(x, w) of the signed codes formed, in the same lanes and order: the same int32 sums
   and the same bits, at about half the instructions per sub-block. Measured
   on a 2-core AVX-512 Xeon, one thread: IQ2_XXS 0.16-0.19 -> 0.10 ns per weight, IQ3_XXS 0.23-0.25 -> 0.15
   (llama.cpp's own 0.09-0.10 and 0.14-0.15). */
static uint64_t KSIGNS64[128];
__attribute__((constructor)) static void ksigns64_init(void) {
    for (int i = 0; i < 128; i++) {
        const uint8_t s = ksigns((uint32_t)i);
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((s >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        KSIGNS64[i] = v;
    }
}

static inline __m256i words4(uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3) { /* w0: bytes 0..7 */
    return _mm256_set_epi64x((long long)w3, (long long)w2, (long long)w1, (long long)w0);
}

/* sub-block ib's 32 grid bytes (*g, unsigned) and its 4 groups' sign words (*sg). The float readers above
   (iq2_xxs_sub ...) parse the same bits group by group: built on this function instead, they took 1.3-1.8x the
   time for IQ3_XXS, IQ3_S and IQ2_S at one row (splitting the 256-bit codes back into groups; one thread, the same
   Xeon, 2026-12-03), so the two stay apart, held to one decoding by the reference tests of both paths. */
static inline __attribute__((always_inline)) void sign_grid32(const uint8_t *b, const int type, const int ib, __m256i *g,
                                                              __m256i *sg) {
    if (type == MLS_IQ2_XXS || type == MLS_IQ3_XXS) {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t aux = type == MLS_IQ2_XXS ? u32(q + 4) : u32(b + 66 + 4 * ib);
        if (type == MLS_IQ2_XXS)
            *g = words4(IQ2XXS_GRID[q[0]], IQ2XXS_GRID[q[1]], IQ2XXS_GRID[q[2]], IQ2XXS_GRID[q[3]]);
        else
            *g = _mm256_set_epi32((int)IQ3XXS_GRID[q[7]], (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[5]],
                                  (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[2]],
                                  (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[0]]);
        *sg = words4(KSIGNS64[aux & 127], KSIGNS64[(aux >> 7) & 127], KSIGNS64[(aux >> 14) & 127],
                     KSIGNS64[(aux >> 21) & 127]);
    } else if (type == MLS_IQ2_XS) {
        const uint16_t q0 = u16(b + 2 + 8 * ib), q1 = u16(b + 4 + 8 * ib), q2 = u16(b + 6 + 8 * ib), q3 = u16(b + 8 + 8 * ib);
        *g = words4(IQ2XS_GRID[q0 & 511], IQ2XS_GRID[q1 & 511], IQ2XS_GRID[q2 & 511], IQ2XS_GRID[q3 & 511]);
        *sg = words4(KSIGNS64[q0 >> 9], KSIGNS64[q1 >> 9], KSIGNS64[q2 >> 9], KSIGNS64[q3 >> 9]);
    } else if (type == MLS_IQ2_S) {
        const uint8_t *q = b + 2 + 4 * ib, *sb = b + 34 + 4 * ib;
        const int qh = b[66 + ib];
        *g = words4(IQ2S_GRID[q[0] | ((qh & 3) << 8)], IQ2S_GRID[q[1] | ((qh & 12) << 6)],
                    IQ2S_GRID[q[2] | ((qh & 48) << 4)], IQ2S_GRID[q[3] | ((qh & 192) << 2)]);
        *sg = words4(SIGNS8[sb[0]], SIGNS8[sb[1]], SIGNS8[sb[2]], SIGNS8[sb[3]]);
    } else { /* IQ3_S: two 9-bit indices of 4-value entries per group */
        const uint8_t *q = b + 2 + 8 * ib, *sb = b + 74 + 4 * ib;
        const int qh = b[66 + ib];
        *g = _mm256_set_epi32((int)IQ3S_GRID[q[7] | ((qh << 1) & 256)], (int)IQ3S_GRID[q[6] | ((qh << 2) & 256)],
                              (int)IQ3S_GRID[q[5] | ((qh << 3) & 256)], (int)IQ3S_GRID[q[4] | ((qh << 4) & 256)],
                              (int)IQ3S_GRID[q[3] | ((qh << 5) & 256)], (int)IQ3S_GRID[q[2] | ((qh << 6) & 256)],
                              (int)IQ3S_GRID[q[1] | ((qh << 7) & 256)], (int)IQ3S_GRID[q[0] | ((qh << 8) & 256)]);
        *sg = words4(SIGNS8[sb[0]], SIGNS8[sb[1]], SIGNS8[sb[2]], SIGNS8[sb[3]]);
    }
}

/* 8 bytes of +1, or of -1 where the delta is negative, from its sign bit in an integer (no branch on the data:
   iq1_delta says why) */
static inline long long iq1_pm(float delta) {
    uint32_t bits;
    memcpy(&bits, &delta, 4);
    const uint64_t neg = 0 - (uint64_t)(bits >> 31);
    return (long long)(0x0101010101010101ULL ^ (neg & 0xFEFEFEFEFEFEFEFEULL));
}

/* IQ1_S / IQ1_M: a sub-block's codes 8 g +- 1 (the grid's -1 / 0 / 1 times 8, the group's delta by its sign) from
   the fused kernels' readers, as the unsigned magnitudes and the signed codes whose signs go onto the activations */
static inline __attribute__((always_inline)) void iq1_operands(const uint8_t *b, const int type, const int ib,
                                                               __m256i *u, __m256i *sg) {
    iq_sub_t o;
    if (type == MLS_IQ1_S)
        iq1_s_sub(b, 1.0f, ib, &o);
    else
        iq1_m_sub(b, 1.0f, ib, &o);
    const __m256i w = _mm256_set_m128i(_mm_unpacklo_epi64(o.g[2], o.g[3]), _mm_unpacklo_epi64(o.g[0], o.g[1]));
    const __m256i w2 = _mm256_add_epi8(w, w), w4 = _mm256_add_epi8(w2, w2);
    const __m256i pm = _mm256_setr_epi64x(iq1_pm(o.delta[0]), iq1_pm(o.delta[1]), iq1_pm(o.delta[2]), iq1_pm(o.delta[3]));
    *sg = _mm256_add_epi8(_mm256_add_epi8(w4, w4), pm);
    *u = _mm256_sign_epi8(*sg, *sg);
}

static inline int64_t grid_bytes(const int type) {
    return type == MLS_IQ2_XXS ? 66 : type == MLS_IQ2_XS ? 74 : type == MLS_IQ2_S ? 82 : type == MLS_IQ3_XXS ? 98
         : type == MLS_IQ3_S ? 110 : type == MLS_IQ1_S ? 50 : 56;
}

/* one grid super-block br's exact int32 lanes P[i] against mr activation rows' codes (xb + i k); type a constant
   where inlined */
static inline __attribute__((always_inline)) void grid_sums(const uint8_t *br, const int type, const int8_t *xb,
                                                            int64_t k, const int mr, __m256i *P) {
    for (int i = 0; i < mr; i++) P[i] = _mm256_setzero_si256();
    for (int ib = 0; ib < 8; ib++) {
        __m256i u, sg;
        if (type == MLS_IQ1_S || type == MLS_IQ1_M)
            iq1_operands(br, type, ib, &u, &sg);
        else
            sign_grid32(br, type, ib, &u, &sg);
        int32_t ls[2];
        iq_ls(br, type, ib, ls);
        const __m256i sc = Q8K_SCALES(ls[0], ls[1]);
        for (int i = 0; i < mr; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xb + i * k + 32 * ib));
            P[i] = dot_u8s8_scaled_acc(P[i], u, _mm256_sign_epi8(x, sg), sc);
        }
    }
}

/* The grid i-quants on q8_K: per sub-block the unsigned operand u and the sign source sg (sign_grid32,
   iq1_operands), its halves' integer multipliers (ref/iquants.c iq_ls), S = sum over the super-block of
   ls * (the exact sums of u * sign(x, sg)), acc += (d_w * d_x) * S, and the row's sum times the type's power-of-two
   factor at the end (llama.cpp's ggml_vec_dot_iq2_xxs_q8_K and kin: `0.125f * sumf`) */
static inline __attribute__((always_inline)) void q8k_grid_mr(const uint8_t *b, const int type, const int8_t *xq,
                                                              const float *xd, const int mr, int64_t k, float *y,
                                                              int64_t ldy) {
    const int64_t slots = k / 32, bytes = grid_bytes(type);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += bytes) {
        pf = prefetch_stream(pf, b);
        __m256i sum[4];
        grid_sums(b, type, xq + blk * 256, k, mr, sum);
        q8k_block_end(acc, sum, NULL, iq_int_d(b, type), 0.0f, xd + blk * Q8K_SLOTS, slots, mr);
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = acc[i] * iq_int_factor(type);
}
#define GRID_Q8K(name, type)                                                                                    \
    static inline __attribute__((always_inline)) void name(const uint8_t *b, const int8_t *xq, const float *xd, \
                                                           const int mr, int64_t k, float *y, int64_t ldy) {   \
        q8k_grid_mr(b, (type), xq, xd, mr, k, y, ldy);                                                         \
    }
GRID_Q8K(q8k_iq2_xxs_mr, MLS_IQ2_XXS)
GRID_Q8K(q8k_iq3_xxs_mr, MLS_IQ3_XXS)
GRID_Q8K(q8k_iq2_xs_mr, MLS_IQ2_XS)
GRID_Q8K(q8k_iq2_s_mr, MLS_IQ2_S)
GRID_Q8K(q8k_iq3_s_mr, MLS_IQ3_S)
GRID_Q8K(q8k_iq1_s_mr, MLS_IQ1_S)
GRID_Q8K(q8k_iq1_m_mr, MLS_IQ1_M)

static inline __attribute__((always_inline)) void q8k_q4k_mr(const uint8_t *b, const int8_t *xq, const float *xd,
                                                             const int mr, int64_t k, float *y, int64_t ldy) {
    q8k_q45_mr(b, 0, xq, xd, mr, k, y, ldy);
}
static inline __attribute__((always_inline)) void q8k_q5k_mr(const uint8_t *b, const int8_t *xq, const float *xd,
                                                             const int mr, int64_t k, float *y, int64_t ldy) {
    q8k_q45_mr(b, 1, xq, xd, mr, k, y, ldy);
}

/* one weight row times m activation rows, in chunks of up to 4 rows (each row's operations are the same in
   every chunk) */
#define Q8K_ROWS_FN(name, kernel, bytes)                                                                    \
    static void name(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,    \
                     int64_t ldy) {                                                                        \
        const int64_t slots = k / 32;                                                                      \
        int64_t i = 0;                                                                                     \
        for (; i + 4 <= m; i += 4) kernel(b, xq + i * k, xd + i * slots, 4, k, y + i * ldy, ldy);          \
        switch (m - i) {                                                                                   \
        case 3: kernel(b, xq + i * k, xd + i * slots, 3, k, y + i * ldy, ldy); break;                      \
        case 2: kernel(b, xq + i * k, xd + i * slots, 2, k, y + i * ldy, ldy); break;                      \
        case 1: kernel(b, xq + i * k, xd + i * slots, 1, k, y + i * ldy, ldy); break;                      \
        default: break;                                                                                    \
        }                                                                                                  \
    }
Q8K_ROWS_FN(q8rows_q4_k, q8k_q4k_mr, 144)
Q8K_ROWS_FN(q8rows_q5_k, q8k_q5k_mr, 176)
Q8K_ROWS_FN(q8rows_q6_k, q8k_q6k_mr, 210)
Q8K_ROWS_FN(q8rows_iq4_xs, q8k_iq4xs_mr, 136)
Q8K_ROWS_FN(q8rows_iq2_xxs, q8k_iq2_xxs_mr, 66)
Q8K_ROWS_FN(q8rows_iq2_xs, q8k_iq2_xs_mr, 74)
Q8K_ROWS_FN(q8rows_iq2_s, q8k_iq2_s_mr, 82)
Q8K_ROWS_FN(q8rows_iq3_xxs, q8k_iq3_xxs_mr, 98)
Q8K_ROWS_FN(q8rows_iq3_s, q8k_iq3_s_mr, 110)
Q8K_ROWS_FN(q8rows_iq1_s, q8k_iq1_s_mr, 50)
Q8K_ROWS_FN(q8rows_iq1_m, q8k_iq1_m_mr, 56)
#endif

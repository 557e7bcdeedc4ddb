/* AVX-512 (16 lanes, 32 registers), on top of x86/avx2.c: the fused kernels, under the same names (types.c).
   A block's 32 codes in two registers, 8 activation rows per pass; the same
   scheme (d applied to each block's partial sum, s = w0 x0 + w1 x1 in that order), so the same bound, and each
   row's operations still do not depend on how many rows share the pass. Where the CPU has it, about half the
   instructions per weight of the AVX2 kernels: the many-row (batched decode) products are compute-bound. */
#ifdef MLS_AVX512
/* r[0..16) as a 16 x 16 matrix of dwords, transposed in place (r[d] lane i = r[i] lane d before) */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int h = 0; h < 2; h++) {
            r[i + 2 * h] = _mm512_unpacklo_epi64(t[i + h], t[i + 2 + h]);
            r[i + 2 * h + 1] = _mm512_unpackhi_epi64(t[i + h], t[i + 2 + h]);
        }
    /* each 128-bit lane q of r[4 g + e] now holds dwords 4 q + e of rows 4 g .. 4 g + 3 */
    for (int e = 0; e < 4; e++)
        for (int g = 0; g < 4; g += 2) {
            t[4 * g + e] = _mm512_shuffle_i32x4(r[4 * g + e], r[4 * g + 4 + e], 0x88);     /* lanes 0, 2 | 0, 2 */
            t[4 * g + 4 + e] = _mm512_shuffle_i32x4(r[4 * g + e], r[4 * g + 4 + e], 0xDD); /* lanes 1, 3 | 1, 3 */
        }
    for (int e = 0; e < 4; e++) {
        r[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xDD);
        r[4 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(t[4 + e], t[12 + e], 0xDD);
    }
}

/* The kernels that read 16 weight rows side by side (x86/rows16_q8k.c, x86/int16_prefill.c qw_few): lane r's byte
   offset r row_bytes (for the gathers of the rows' block scales), and the next 16 rows streamed into L2 as one
   sequential run beside the reads, `step` bytes of it per block: the hardware prefetchers alone left the loads of
   16 interleaved rows unoverlapped with the work (12.6 against 21-22 GB/s one thread, the 2-core AMD EPYC) */
static inline __m512i rows16_offsets(int64_t row_bytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)row_bytes));
}
static inline const char *rows16_prefetch(const char *pf, const uint8_t *w, int64_t row_bytes, int64_t blk, int64_t step) {
    return prefetch_next_rows(pf, w, 16, row_bytes, blk, step);
}

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
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 32; blk++, b += block_bytes(type)) {
        pf = prefetch_stream(pf, b);
        const __m512 d = _mm512_set1_ps(block_d(b, type));
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
CODES_MR(wide_mxfp4_mr, wide_codes_mr, 39)
CODES_MR(wide_iq4_nl_mr, wide_codes_mr, 20)

/* IQ4_XS: each sub-block as an IQ4_NL block with its scale (x86/avx2.c fused_iq4_xs_mr) */
static inline __attribute__((always_inline)) void wide_iq4_xs_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                                 const int mr, int64_t k, float *y, int64_t ldy) {
    __m512 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 136) {
        pf = prefetch_stream(pf, b);
        float dl[8];
        iq4_xs_scales(b, dl);
        for (int ib = 0; ib < 8; ib++) {
            const __m512 d = _mm512_set1_ps(dl[ib]);
            __m128i g[2];
            block_codes16(b + 8 + 16 * ib, 23, g);
            const __m512 w0 = i8x16(g[0]), w1 = i8x16(g[1]);
            WIDE_BLOCK(mr, acc, d, w0, w1, x + blk * 256 + 32 * ib, ldx)
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

static inline __attribute__((always_inline)) void wide_q4_k_mr(const uint8_t *b, const float *x, int64_t ldx,
                                                               const int mr, int64_t k, float *y, int64_t ldy) {
    __m512 acc[8];
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < k / 256; blk++, b += 144) {
        pf = prefetch_stream(pf, b);
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

/* INT4 (x86/avx2.c fused_int4_mr): a 32-column chunk's codes in two registers, the group's scale on its partial sum */
static inline __attribute__((always_inline)) void wide_int4_mr(const uint8_t *b, const float *srow, int64_t group,
                                                               const float *x, int64_t ldx, const int mr, int64_t k,
                                                               float *y, int64_t ldy) {
    __m512 acc[8];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const int64_t per = group / 32;
    const char *pf = (const char *)b + PREFETCH_AHEAD;
    for (int64_t gi = 0, blk = 0; gi < k / group; gi++) {
        const __m512 d = _mm512_set1_ps(srow[gi]);
        for (int64_t j = 0; j < per; j++, blk++, b += 16) {
            pf = prefetch_stream(pf, b);
            __m128i g[2];
            int4_codes16(b, g);
            const __m512 w0 = i8x16(g[0]), w1 = i8x16(g[1]);
            WIDE_BLOCK(mr, acc, d, w0, w1, x + blk * 32, ldx)
        }
    }
    for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

/* The grid i-quants (x86/avx2.c GRID_MR, the same sub-block readers): a sub-block's 4 groups as two 16-value
   registers (groups 0, 1 and 2, 3: one scale each where the type keeps two); IQ1's deltas added per 8 lanes */
static inline __m512 halves16(float a, float b) { /* lanes 0..7 a, 8..15 b */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)), _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

#define WIDE_GRID_MR(name, bytes, d_of, sub, halves, deltas)                                                      \
    static inline __attribute__((always_inline)) void name(const uint8_t *b, const float *x, int64_t ldx,        \
                                                           const int mr, int64_t k, float *y, int64_t ldy) {    \
        __m512 acc[8];                                                                                          \
        for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();                                              \
        const char *pf = (const char *)b + PREFETCH_AHEAD;                                                      \
        for (int64_t blk = 0; blk < k / 256; blk++, b += (bytes)) {                                             \
            pf = prefetch_stream(pf, b);                                                                        \
            const float d = d_of(b);                                                                            \
            for (int ib = 0; ib < 8; ib++) {                                                                    \
                iq_sub_t o;                                                                                     \
                sub(b, d, ib, &o);                                                                              \
                __m512 w0 = i8x16(_mm_unpacklo_epi64(o.g[0], o.g[1])), w1 = i8x16(_mm_unpacklo_epi64(o.g[2], o.g[3])); \
                if (deltas) {                                                                                   \
                    w0 = _mm512_add_ps(w0, halves16(o.delta[0], o.delta[1]));                                   \
                    w1 = _mm512_add_ps(w1, halves16(o.delta[2], o.delta[3]));                                   \
                }                                                                                               \
                const __m512 s0 = _mm512_set1_ps(o.s0), s1 = _mm512_set1_ps(o.s1);                              \
                const float *xb = x + blk * 256 + 32 * ib;                                                      \
                if (halves) {                                                                                   \
                    for (int i = 0; i < mr; i++) {                                                              \
                        const float *xi = xb + i * ldx;                                                         \
                        const __m512 p0 = _mm512_mul_ps(w0, _mm512_loadu_ps(xi));                               \
                        const __m512 p1 = _mm512_mul_ps(w1, _mm512_loadu_ps(xi + 16));                          \
                        acc[i] = _mm512_fmadd_ps(s1, p1, _mm512_fmadd_ps(s0, p0, acc[i]));                      \
                    }                                                                                           \
                } else {                                                                                        \
                    WIDE_BLOCK(mr, acc, s0, w0, w1, xb, ldx)                                                    \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < mr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);                                 \
    }
WIDE_GRID_MR(wide_iq2_xxs_mr, 66, iq_d_f16, iq2_xxs_sub, 0, 0)
WIDE_GRID_MR(wide_iq3_xxs_mr, 98, iq_d_f16, iq3_xxs_sub, 0, 0)
WIDE_GRID_MR(wide_iq2_xs_mr, 74, iq_d_f16, iq2_xs_sub, 1, 0)
WIDE_GRID_MR(wide_iq2_s_mr, 82, iq_d_f16, iq2_s_sub, 1, 0)
WIDE_GRID_MR(wide_iq3_s_mr, 110, iq_d_f16, iq3_s_sub, 0, 0)
WIDE_GRID_MR(wide_iq1_s_mr, 50, iq_d_f16, iq1_s_sub, 0, 1)
WIDE_GRID_MR(wide_iq1_m_mr, 56, iq1_m_d, iq1_m_sub, 1, 1)

FUSED_ROW_FN(fused_q8_0, wide_q8_0_mr, k / 32 * 34, 8)
FUSED_ROW_FN(fused_q4_0, wide_q4_0_mr, k / 32 * 18, 8)
FUSED_ROW_FN(fused_q5_0, wide_q5_0_mr, k / 32 * 22, 8)
FUSED_ROW_FN(fused_mxfp4, wide_mxfp4_mr, k / 32 * 17, 8)
FUSED_ROW_FN(fused_iq4_nl, wide_iq4_nl_mr, k / 32 * 18, 8)
FUSED_ROW_FN(fused_iq4_xs, wide_iq4_xs_mr, k / 256 * 136, 8)
FUSED_ROW_FN(fused_q4_k, wide_q4_k_mr, k / 256 * 144, 8)
FUSED_ROW_FN(fused_q6_k, wide_q6_k_mr, k / 256 * 210, 8)
SCALED_ROW_FN(fused_int4, wide_int4_mr, k / 2, 8)
FUSED_ROW_FN(fused_iq2_xxs, wide_iq2_xxs_mr, k / 256 * 66, 8)
FUSED_ROW_FN(fused_iq3_xxs, wide_iq3_xxs_mr, k / 256 * 98, 8)
FUSED_ROW_FN(fused_iq2_xs, wide_iq2_xs_mr, k / 256 * 74, 8)
FUSED_ROW_FN(fused_iq2_s, wide_iq2_s_mr, k / 256 * 82, 8)
FUSED_ROW_FN(fused_iq3_s, wide_iq3_s_mr, k / 256 * 110, 8)
FUSED_ROW_FN(fused_iq1_s, wide_iq1_s_mr, k / 256 * 50, 8)
FUSED_ROW_FN(fused_iq1_m, wide_iq1_m_mr, k / 256 * 56, 8)
#endif

/* The int8-activation row kernels (int8.c) without SIMD: the same integer sums and float operations as the SIMD
   kernels (x86/avx2.c), one value at a time, so every build gives the same bits. */

#ifndef MLS_SIMD
/* The 32-value block types (x86/avx2.c q8rows_mr says the scheme): code j of a block as the SIMD kernels read it */
static inline int32_t q8_code(const uint8_t *b, int type, int j) {
    const int nib = j < 16 ? (b[(type == 3 ? 4 : type == 7 ? 8 : type == 6 ? 6 : 2) + j] & 0x0F)
                           : (b[(type == 3 ? 4 : type == 7 ? 8 : type == 6 ? 6 : 2) + j - 16] >> 4);
    switch (type) {
    case 8: return (int8_t)b[2 + j];
    case 2: return nib - 8;
    case 20: return IQ4NL_VALUES[nib];
    case 3: return nib;
    case 6: return (nib | (((u32(b + 2) >> j) & 1) << 4)) - 16;
    default: return nib | (((u32(b + 4) >> j) & 1) << 4);
    }
}

/* the same 8 lanes of 4 values, fmaf per lane and block, the lanes summed in hsum8's order: the SIMD builds' bits */
static void q8rows_scalar(const uint8_t *b0, int type, const int8_t *xq, const float *xd, int64_t m, int64_t k,
                          float *y, int64_t ldy) {
    const int64_t kb = k / 32;
    const int64_t bytes = type == 8 ? 34 : type == 2 || type == 20 ? 18 : type == 6 ? 22 : type == 3 ? 20 : 24;
    const int with_min = type == 3 || type == 7;
    prefetch_row(b0, kb * bytes);
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *b = b0;
        float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t blk = 0; blk < kb; blk++, b += bytes) {
            const int8_t *x = xq + i * k + blk * 32;
            const float dx = xd[i * kb + blk], c = f16(b) * dx, cm = with_min ? f16(b + 2) * dx : 0.0f;
            for (int l = 0; l < 8; l++) {
                int32_t s = 0, sx = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++) {
                    s += q8_code(b, type, j) * x[j];
                    sx += x[j];
                }
                a[l] = fmaf(c, (float)s, a[l]);
                if (with_min) a[l] = fmaf(cm, (float)sx, a[l]);
            }
        }
        y[i * ldy] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}
#define Q8ROWS_REF(name, type)                                                                                 \
    static void name(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,       \
                     int64_t ldy) {                                                                           \
        q8rows_scalar(b, type, xq, xd, m, k, y, ldy);                                                         \
    }
Q8ROWS_REF(q8rows_q8_0, 8)
Q8ROWS_REF(q8rows_q4_0, 2)
Q8ROWS_REF(q8rows_q4_1, 3)
Q8ROWS_REF(q8rows_q5_0, 6)
Q8ROWS_REF(q8rows_q5_1, 7)
Q8ROWS_REF(q8rows_iq4_nl, 20)

/* IQ4_XS with Q8_K-style activations (x86/avx2.c q8k_iq4xs_mr): the same integer sums and float operations */
static void q8rows_iq4_xs(const uint8_t *b0, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                          int64_t ldy) {
    const int64_t slots = k / 32;
    prefetch_row(b0, k / 256 * 136);
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *b = b0;
        float acc = 0.0f;
        for (int64_t blk = 0; blk < k / 256; blk++, b += 136) {
            const int8_t *x = xq + i * k + blk * 256;
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            const int sh = b[2] | (b[3] << 8);
            int32_t s = 0;
            for (int ib = 0; ib < 8; ib++) {
                const int32_t ls = ((((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4))) - 32;
                const uint8_t *q = b + 8 + 16 * ib;
                int32_t sj = 0;
                for (int j = 0; j < 16; j++) sj += IQ4NL_VALUES[q[j] & 0x0F] * x[32 * ib + j] + IQ4NL_VALUES[q[j] >> 4] * x[32 * ib + 16 + j];
                s += ls * sj;
            }
            acc += (f16(b) * meta->d) * (float)s;
        }
        y[i * ldy] = acc;
    }
}

/* The grid i-quants with Q8_K-style activations (x86/avx2.c q8k_grid_mr): the integer codes and multipliers of
   ref/iquants.c, the same integer sums and float operations */
static void q8rows_grid(const uint8_t *b0, int type, int64_t bytes, const int8_t *xq, const float *xd, int64_t m,
                        int64_t k, float *y, int64_t ldy) {
    const int64_t slots = k / 32;
    prefetch_row(b0, k / 256 * bytes);
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *b = b0;
        float acc = 0.0f;
        for (int64_t blk = 0; blk < k / 256; blk++, b += bytes) {
            const int8_t *x = xq + i * k + blk * 256;
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            int32_t s = 0;
            for (int ib = 0; ib < 8; ib++) {
                int8_t w[32];
                int32_t ls[2];
                iq_sub_int(b, type, ib, w);
                iq_ls(b, type, ib, ls);
                for (int h = 0; h < 2; h++) {
                    int32_t sh = 0;
                    for (int j = 16 * h; j < 16 * h + 16; j++) sh += w[j] * x[32 * ib + j];
                    s += ls[h] * sh;
                }
            }
            acc += (iq_int_d(b, type) * meta->d) * (float)s;
        }
        y[i * ldy] = acc * iq_int_factor(type);
    }
}
#define Q8ROWS_GRID(name, type, bytes)                                                                         \
    static void name(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,       \
                     int64_t ldy) {                                                                           \
        q8rows_grid(b, type, bytes, xq, xd, m, k, y, ldy);                                                    \
    }
Q8ROWS_GRID(q8rows_iq2_xxs, MLS_IQ2_XXS, 66)
Q8ROWS_GRID(q8rows_iq2_xs, MLS_IQ2_XS, 74)
Q8ROWS_GRID(q8rows_iq2_s, MLS_IQ2_S, 82)
Q8ROWS_GRID(q8rows_iq3_xxs, MLS_IQ3_XXS, 98)
Q8ROWS_GRID(q8rows_iq3_s, MLS_IQ3_S, 110)
Q8ROWS_GRID(q8rows_iq1_s, MLS_IQ1_S, 50)
Q8ROWS_GRID(q8rows_iq1_m, MLS_IQ1_M, 56)

/* The K-quants with Q8_K-style activations (x86/avx2.c says the scheme): the same integer sums, value by value,
   and the same float operations per super-block and row, hence the SIMD builds' bits. */
static void q8rows_kquant(const uint8_t *b0, int type, const int8_t *xq, const float *xd, int64_t m, int64_t k,
                          float *y, int64_t ldy) {
    const int64_t slots = k / 32, bytes = type == MLS_Q4_K ? 144 : type == MLS_Q5_K ? 176 : 210;
    prefetch_row(b0, k / 256 * bytes);
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *b = b0;
        float acc = 0.0f;
        for (int64_t blk = 0; blk < k / 256; blk++, b += bytes) {
            const int8_t *x = xq + i * k + blk * 256;
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            int32_t s = 0;
            if (type == MLS_Q6_K) {
                const uint8_t *ql = b, *qh = b + 128;
                const int8_t *sc = (const int8_t *)(b + 192);
                for (int g = 0; g < 16; g++) {
                    int32_t sg = 0;
                    for (int t = 16 * g; t < 16 * g + 16; t++) {
                        const int h = t >> 7, r = t & 127;
                        const int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0F;
                        const int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
                        sg += ((lo | (hi << 4)) - 32) * x[t];
                    }
                    s += sc[g] * sg;
                }
                acc += (f16(b + 208) * meta->d) * (float)s;
                continue;
            }
            int32_t sc[8], mn[8], msum = 0;
            k_scales_int(b + 4, sc, mn);
            const uint8_t *qs = b + (type == MLS_Q5_K ? 48 : 16), *qh = b + 16;
            for (int j = 0; j < 8; j++) {
                int32_t sj = 0;
                for (int l = 0; l < 32; l++) {
                    int q = (qs[(j / 2) * 32 + l] >> (4 * (j & 1))) & 0x0F;
                    if (type == MLS_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                    sj += q * x[32 * j + l];
                }
                s += sc[j] * sj;
                msum += mn[j] * meta->bsum[j];
            }
            acc += (f16(b) * meta->d) * (float)s;
            acc -= (f16(b + 2) * meta->d) * (float)msum;
        }
        y[i * ldy] = acc;
    }
}
static void q8rows_q4_k(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    q8rows_kquant(b, MLS_Q4_K, xq, xd, m, k, y, ldy);
}
static void q8rows_q5_k(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    q8rows_kquant(b, MLS_Q5_K, xq, xd, m, k, y, ldy);
}
static void q8rows_q6_k(const uint8_t *b, const int8_t *xq, const float *xd, int64_t m, int64_t k, float *y,
                        int64_t ldy) {
    q8rows_kquant(b, MLS_Q6_K, xq, xd, m, k, y, ldy);
}
#endif

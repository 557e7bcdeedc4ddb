/* The int8-activation row kernels (int8.c) without SIMD: the same integer block sums, one value at a time. */

#ifndef MLS_SIMD
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

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
#endif

/* ---------------------------------------------------------------- the 8-bit cache's quantizer (kv_cache_dtype)
   cache/quantized_rows.py quantize in C, for the one-call decode layer's writes (decode_layer.c): the layer
   computes a step's fp32 rows (its latent rows, its index keys) into a buffer and quantizes them here into the
   cache's codes and scales at the step's slots, as the per-op path's cache write (QuantizedRows.index_copy_)
   quantizes the same rows. Bit for bit the torch quantizer's (tests/kernels/test_decode_layer_kv8.py):
     x [T, q] fp32 in blocks of `block` values; per block
     scale = max(amax |x|, AMAX_FLOOR) / QMAX        (fp32: 1e-4 rounded to float; QMAX 127 int8, 448 e4m3)
     y = x / scale                                  (an fp32 division, as torch's, not a product by 1 / scale)
     int8: code = clamp(round(y), +-127), round to nearest, ties to even (nearbyintf, the default mode)
     e4m3: code = the e4m3fn value nearest clamp(y, +-448), ties to even (torch's cast): a normal y keeps 3
           mantissa bits (a carry may raise the exponent); below 2^-6 the step is 2^-9 (subnormals)
   A block holding a NaN gets a NaN scale (torch's amax and clamp keep NaN), so it reads back NaN. */

#define ROWS8_AMAX_FLOOR 1e-4f /* config/row_format.py AMAX_FLOOR */

static inline uint8_t e4m3_encode(float y) { /* |y| <= 448, not NaN */
    uint32_t u;
    memcpy(&u, &y, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(y);
    if (a < 0x1p-6f) /* subnormal codes m * 2^-9 (m = 8 is the smallest normal, bits 0x08): a * 512 is exact */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    memcpy(&u, &a, sizeof u);
    u += 0x7FFFFu + ((u >> 20) & 1u); /* round the 23 mantissa bits to 3, ties to even */
    return sign | (uint8_t)((((u >> 23) - 127u + 7u) << 3) | ((u >> 20) & 7u));
}

/* one row's q values -> codes [q] and scales [q / block] */
static void row8_encode(const float *x, int64_t q, int64_t block, int fp8, uint8_t *codes, float *scales) {
    const float qmax = fp8 ? 448.0f : 127.0f;
    for (int64_t c0 = 0, blk = 0; c0 < q; c0 += block, blk++) {
        float amax = 0.0f;
        int nan = 0;
        for (int64_t k = 0; k < block; k++) {
            const float a = fabsf(x[c0 + k]);
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        const float s = nan ? NAN : (amax > ROWS8_AMAX_FLOOR ? amax : ROWS8_AMAX_FLOOR) / qmax;
        scales[blk] = s;
        for (int64_t k = 0; k < block; k++) {
            if (nan) { /* reads back NaN through its scale; the codes torch's casts give NaN (int8 0, e4m3 NaN) */
                codes[c0 + k] = fp8 ? 0x7F : 0;
                continue;
            }
            float y = x[c0 + k] / s;
            y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
            codes[c0 + k] = fp8 ? e4m3_encode(y) : (uint8_t)(int8_t)nearbyintf(y);
        }
    }
}

/* rows x [T, width] (ldx apart) -> the 8-bit state dst at slots[T]: the first width - kept values quantized,
   the kept ones copied (fp32). Returns 0, -5 for a slot outside [0, n_slots). */
static int rows8_write(const float *x, int64_t t, int64_t ldx, int64_t width, int64_t q, const mls_rows_t *dst,
                       const int64_t *slots, int64_t n_slots) {
    const int64_t kept = width - q, nb = q / dst->block;
    for (int64_t tok = 0; tok < t; tok++)
        if (slots[tok] < 0 || slots[tok] >= n_slots) return -5;
    for (int64_t tok = 0; tok < t; tok++) {
        const int64_t s = slots[tok];
        row8_encode(x + tok * ldx, q, dst->block, (int)dst->fp8, dst->codes + s * q, dst->scales + s * nb);
        if (kept) memcpy(dst->kept + s * kept, x + tok * ldx + q, sizeof(float) * (size_t)kept);
    }
    return 0;
}

int mls_quantize_rows(const float *x, int64_t t, int64_t ldx, int64_t q, int64_t block, int fp8, uint8_t *codes,
                      float *scales) {
    if (block <= 0 || q % block) return -2;
    for (int64_t tok = 0; tok < t; tok++)
        row8_encode(x + tok * ldx, q, block, fp8, codes + tok * q, scales + tok * (q / block));
    return 0;
}

/* ---------------------------------------------------------------- 16-bit cache rows (kv_cache_dtype float16 / bfloat16)
   A state kept in 16 bits (cache/quantized_rows.py, fmt.half): every value of a row as one IEEE half (kind
   HALF_F16) or bfloat16 (HALF_BF16), no scales. Reading widens exactly (every 16-bit value is an fp32 value):
   F16C's vcvtph2ps, or bf16 << 16. Writing rounds to nearest, ties to even, as torch's casts (the per-op path's
   write, QuantizedRows.index_copy_): F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT (a NaN stays a NaN, beyond
   65504 rounds to inf), and for bfloat16 torch's c10::round_to_nearest_even (bits + 0x7FFF + the lsb kept, a NaN
   becomes the quiet NaN 0x7FC0). Bit for bit the torch casts: tests/kernels/test_rows16_native.py. */

#define HALF_F16 1
#define HALF_BF16 2

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* the scalar reference of vcvtps2ph: round to nearest even, overflow to inf, subnormals, NaN kept quiet */
static inline uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const float a = fabsf(f);
    if (a != a) return sign | 0x7E00u | (uint16_t)((u >> 13) & 0x3FFu);
    if (a >= 65520.0f) return sign | 0x7C00u; /* 65504 + half a step and above: inf */
    if (a < 0x1p-14f) return sign | (uint16_t)nearbyintf(a * 0x1p24f); /* subnormal steps of 2^-24 (exact product) */
    memcpy(&u, &a, 4);
    u += 0xFFFu + ((u >> 13) & 1u); /* round 23 mantissa bits to 10, ties to even (a carry raises the exponent) */
    return sign | (uint16_t)((((u >> 23) - 127u + 15u) << 10) | ((u >> 13) & 0x3FFu));
#endif
}

/* y[k] = the 16-bit values h[k] as fp32, k < n */
static inline void row16_decode(const uint16_t *h, int kind, int64_t n, float *y) {
    int64_t k = 0;
#ifdef MLS_SIMD
    if (kind == HALF_F16)
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k))));
    else
        for (; k + 8 <= n; k += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + k)));
            _mm256_storeu_ps(y + k, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#endif
    for (; k < n; k++) y[k] = kind == HALF_F16 ? f16((const uint8_t *)(h + k)) : bf16_to_f32(h[k]);
}

/* rows x [T, width] (ldx apart) -> the 16-bit state at slots[T]. Returns 0, -5 for a slot outside [0, n_slots). */
static int rows16_write(const float *x, int64_t t, int64_t ldx, int64_t width, int kind, uint16_t *dst,
                        const int64_t *slots, int64_t n_slots) {
    for (int64_t tok = 0; tok < t; tok++)
        if (slots[tok] < 0 || slots[tok] >= n_slots) return -5;
    for (int64_t tok = 0; tok < t; tok++) {
        const float *src = x + tok * ldx;
        uint16_t *o = dst + slots[tok] * width;
        for (int64_t k = 0; k < width; k++) o[k] = kind == HALF_F16 ? f32_to_f16(src[k]) : f32_to_bf16(src[k]);
    }
    return 0;
}

int mls_round16_rows(const float *x, int64_t t, int64_t width, int kind, uint16_t *out) {
    if (kind != HALF_F16 && kind != HALF_BF16) return -2;
    for (int64_t tok = 0; tok < t; tok++)
        for (int64_t k = 0; k < width; k++) {
            const float v = x[tok * width + k];
            out[tok * width + k] = kind == HALF_F16 ? f32_to_f16(v) : f32_to_bf16(v);
        }
    return 0;
}

/* The fp32 dot product of a decoded row with an activation row, and F32 rows dotted where they lie. */

/* stream: keep a prefetch stream PREFETCH_AHEAD bytes ahead of w (common.h: rows read from memory; a row decoded
   into a buffer needs none). The arithmetic is the same either way. */
static inline float dot_rows(const float *w, const float *x, int64_t k, int stream) {
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    const char *pf = (const char *)w + PREFETCH_AHEAD;
    for (; i + 32 <= k; i += 32) {
        if (stream) pf = prefetch_stream(pf, (const uint8_t *)(w + i));
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
    (void)stream;
    return (s0 + s1) + (s2 + s3);
#endif
}

static inline float dot(const float *w, const float *x, int64_t k) { return dot_rows(w, x, k, 0); }

/* F32 rows: dotted where they lie, streamed as the fused row kernels are (a 2048-wide row's whole-row prefetch was a
   burst of 128 lines) */
static void fused_f32(const uint8_t *b, const float *x, int64_t ldx, int64_t m, int64_t k, float *y, int64_t ldy) {
    for (int64_t i = 0; i < m; i++) y[i * ldy] = dot_rows((const float *)b, x + i * ldx, k, i == 0);
}

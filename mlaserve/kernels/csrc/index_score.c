/* ---------------------------------------------------------------- DSA index scores, heads along the lanes
   The decode step's indexer scores every allowed key of a request (indexer.c index_topk): with Hi index heads and
   Di values per key, score(key) = sum_h w[h] ReLU(q[h] . key) costs Hi * Di multiply-adds per key, 12.9 G per
   step at 32K keys x 8 requests x 32 heads x 128 (the DSA step's largest part). This file scores keys with the
   heads along the vector lanes:
     qT    [Di, Hi]   the token's queries transposed once per token (a row of Hi values per key dimension)
     acc_h = sum_d qT[d, h] * key[d]      one FMA chain per head, d = 0..Di-1 in order (lane h of Hi / 16 zmm)
     p_h   = ReLU(acc_h) * w[h]           per 16-head group g: p = ReLU(acc_g0) * w_g0, then
                                          p = fma(ReLU(acc_g), w_g, p) for g = 1.. (lane by lane)
     score = sum16(p)                     a fixed tree over the 16 lanes (sum16_tree), the same in every build
   Each key value is broadcast to every head (one load), each qT row loaded once per NK keys: per dimension NK
   broadcasts + Hi / 16 loads feed NK * Hi / 16 FMAs, so the loop is bound by its FMAs, not by loads or by one
   horizontal sum per (key, head) as the head-by-head dot products were (the path for other head counts and
   builds, indexer.c). The scalar form (`index_scores_lanes_scalar`) runs the same operations lane by lane with
   fmaf, so both give the same bits (tests/kernels/test_index_score_lanes.py holds them to each other and to a
   float64 reference within the fp32 bound derived there). Keys are fp32 rows, or FP8 e4m3 codes with a scale per
   key decoded NK at a time into a small buffer (attention.c e4m3_scaled: value = E4M3[code] * scale, one
   rounding, as the torch dequantizer), so scoring FP8 keys equals scoring their dequantized fp32 rows. */
#define ISC_NK 4    /* keys scored together: each qT row load feeds ISC_NK keys */
#define ISC_MAXG 4  /* 16-head groups held in registers: Hi <= 64 */

/* lanes_ok: this kernel takes Hi heads (a multiple of 16, at most 16 * ISC_MAXG) */
static inline int index_lanes_ok(int64_t hi) { return hi % 16 == 0 && hi / 16 <= ISC_MAXG; }

/* the 16 lanes' sum in a fixed order (pairs 8 apart, then 4, 2, 1): the SIMD and scalar forms share it */
static inline float sum16_tree(const float *x) {
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* qT [Di, Hi] from q [Hi, Di] */
static inline void index_q_transpose(const float *q, int64_t hi, int64_t di, float *qT) {
    for (int64_t h = 0; h < hi; h++)
        for (int64_t d = 0; d < di; d++) qT[d * hi + h] = q[h * di + d];
}

/* out[j] = score of keys[j] for j < n (n <= ISC_NK), scalar, lane by lane as the SIMD form */
static void index_scores_lanes_scalar(const float *qT, const float *w, int64_t hi, int64_t di,
                                      const float *const *keys, int n, float *out) {
    for (int j = 0; j < n; j++) {
        float p[16];
        for (int l = 0; l < 16; l++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < di; d++) acc = fmaf(qT[d * hi + l], keys[j][d], acc);
            p[l] = (acc > 0.0f ? acc : 0.0f) * w[l];
        }
        for (int64_t g = 1; g < hi / 16; g++)
            for (int l = 0; l < 16; l++) {
                float acc = 0.0f;
                for (int64_t d = 0; d < di; d++) acc = fmaf(qT[d * hi + g * 16 + l], keys[j][d], acc);
                p[l] = fmaf(acc > 0.0f ? acc : 0.0f, w[g * 16 + l], p[l]);
            }
        out[j] = sum16_tree(p);
    }
}

#ifdef MLS_AVX512
/* the same for ng = Hi / 16 groups (a compile-time constant in each instantiation: accumulators in registers) */
static inline __attribute__((always_inline)) void index_scores_lanes_ng(const float *qT, const float *w, int64_t hi,
                                                                       int64_t di, const float *const *keys, int n,
                                                                       const int ng, float *out) {
    __m512 a[ISC_NK][ISC_MAXG];
    const float *k0 = keys[0], *k1 = keys[n > 1 ? 1 : 0], *k2 = keys[n > 2 ? 2 : 0], *k3 = keys[n > 3 ? 3 : 0];
    for (int j = 0; j < ISC_NK; j++)
        for (int g = 0; g < ng; g++) a[j][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < di; d++) {
        const float *qd = qT + d * hi;
        const __m512 b0 = _mm512_set1_ps(k0[d]), b1 = _mm512_set1_ps(k1[d]);
        const __m512 b2 = _mm512_set1_ps(k2[d]), b3 = _mm512_set1_ps(k3[d]);
        for (int g = 0; g < ng; g++) {
            const __m512 qv = _mm512_loadu_ps(qd + 16 * g);
            a[0][g] = _mm512_fmadd_ps(qv, b0, a[0][g]);
            a[1][g] = _mm512_fmadd_ps(qv, b1, a[1][g]);
            a[2][g] = _mm512_fmadd_ps(qv, b2, a[2][g]);
            a[3][g] = _mm512_fmadd_ps(qv, b3, a[3][g]);
        }
    }
    const __m512 zero = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m512 p = _mm512_mul_ps(_mm512_max_ps(a[j][0], zero), _mm512_loadu_ps(w));
        for (int g = 1; g < ng; g++) p = _mm512_fmadd_ps(_mm512_max_ps(a[j][g], zero), _mm512_loadu_ps(w + 16 * g), p);
        float lanes[16];
        _mm512_storeu_ps(lanes, p);
        out[j] = sum16_tree(lanes);
    }
}
#endif

/* scores of n <= ISC_NK keys; simd = 0 forces the scalar form (the tests) */
static inline void index_scores_lanes(const float *qT, const float *w, int64_t hi, int64_t di,
                                      const float *const *keys, int n, int simd, float *out) {
#ifdef MLS_AVX512
    if (simd) {
        switch (hi / 16) {
        case 1: index_scores_lanes_ng(qT, w, hi, di, keys, n, 1, out); return;
        case 2: index_scores_lanes_ng(qT, w, hi, di, keys, n, 2, out); return;
        case 3: index_scores_lanes_ng(qT, w, hi, di, keys, n, 3, out); return;
        default: index_scores_lanes_ng(qT, w, hi, di, keys, n, 4, out); return;
        }
    }
#endif
    (void)simd;
    index_scores_lanes_scalar(qT, w, hi, di, keys, n, out);
}

/* The lanes kernel's build: "avx512" where it runs in SIMD, "scalar" where only its scalar form does. */
static inline int index_lanes_simd(void) {
#ifdef MLS_AVX512
    return 1;
#else
    return 0;
#endif
}

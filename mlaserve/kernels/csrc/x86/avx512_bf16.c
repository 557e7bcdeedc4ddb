/* ---------------------------------------------------- AVX512-BF16: a prompt's attention products without tiles
   The two products of a prompt's decompressed attention in bf16 (kernels/bf16_attention.py) where the process has no
   AMX-BF16 tiles but the CPU has AVX512-BF16 (AMD Zen 4 / 5, Intel Cooper Lake): the tiles' operands
   (x86/amx_bf16_bmm.c: A [m, k] bf16 rows, B the pairs of the right operand, C fp32) by vdpbf16ps, and the masked
   softmax that writes P as bf16 between the products (the tiles' path runs it too: it has no tile instruction).

   Notation (one 32 x 32 block of C; vdpbf16ps per lane j: C[j] += A[2p + 1] Bm[2p + 1, j], then += A[2p] Bm[2p, j],
   each product exact in fp32 and each sum rounded to nearest even; bf16 subnormal inputs read as zero, fp32
   subnormal results flushed: no effect at attention scales)
     C[i, j] = sum over p in order of A[i, 2p] Bm[2p, j] + A[i, 2p + 1] Bm[2p + 1, j]   (k roundings):
               |C - A Bm| <= gamma_k sum_k |A[i, k]| |Bm[k, j]|, gamma_k = k 2^-24 / (1 - k 2^-24)
     (about twice the tiles' bound, whose unit rounds once per pair; tests/kernels/test_bf16_attention.py holds each
     unit to its own)
   Registers: 8 rows x 32 columns (16 accumulators), A's pair broadcast, B's two 16-column pair rows loaded once per
   p for the 8 rows; the block's 4 row groups one after another over the whole depth (B's 32 columns x k / 2 pairs
   stay in L1). A row's result does not depend on the other rows, the batch or the threads. */
#if defined(MLS_AVX512) && defined(__AVX512BF16__)
#define MLS_BF16_DOT 1

/* one 32 x 32 block of C: rows i0 .., columns j0 .. (B's columns j0 .. j0 + 15 at bp, j0 + 16 .. at bp + bj) */
static void dot_block(const uint16_t *a, int64_t lda, const int32_t *bp, int64_t ldb, int64_t bj, int64_t k, float *c,
                      int64_t ldc) {
    for (int g = 0; g < 32; g += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t p = 0; p < k / 2; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + p * ldb);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + bj + p * ldb);
            for (int i = 0; i < 8; i++) {
                int32_t pair;
                memcpy(&pair, a + (g + i) * lda + 2 * p, 4);
                const __m512bh ai = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(c + (g + i) * ldc, acc[i][0]);
            _mm512_storeu_ps(c + (g + i) * ldc + 16, acc[i][1]);
        }
    }
}

/* exp(x) for x <= 0 (a score minus its row's max), 16 at a time: x = k ln2 + t, |t| <= ln2 / 2, e^t by Cephes' expf
   polynomial (within 2 ulp), times 2^k; below -87.3 (e^x under fp32's normal range) 0 */
static inline __m512 bmm_exp(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 t = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    t = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), t);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, t), t, _mm512_add_ps(t, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, k));
}

/* One row of scores s [n] (already scaled) -> its probabilities as bf16 p [n]: the keys whose mask byte is nonzero
   (allow, the first nv; none past them) take softmax(s) over those keys, the rest 0. A NaN or +inf score a key may
   read makes the whole row NaN (as torch's softmax: NaN, or inf - inf), and so does a row that allows no key (0 / 0):
   the engine's NaN checks name them. s is overwritten. */
static void bmm_softmax_row(float *s, const uint8_t *allow, int64_t nv, int64_t n, uint16_t *p) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    __mmask16 bad = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 tail = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __mmask16 inside = j >= nv ? 0 : nv - j >= 16 ? 0xFFFF : (__mmask16)((1u << (nv - j)) - 1);
        const __mmask16 ok = _mm_mask_test_epi8_mask(inside, _mm_maskz_loadu_epi8(inside, allow + j), _mm_set1_epi8(-1));
        const __m512 v = _mm512_maskz_loadu_ps(ok, s + j);
        bad |= _mm512_mask_cmp_ps_mask(ok, v, v, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(ok, v, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
        mx = _mm512_mask_max_ps(mx, ok, mx, v);
        _mm512_mask_storeu_ps(s + j, tail, _mm512_mask_mov_ps(ninf, ok, v)); /* keys it may not read: -inf */
    }
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 tail = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(tail, s + j);
        const __mmask16 live = _mm512_mask_cmp_ps_mask(tail, v, ninf, _CMP_NEQ_UQ);
        const __m512 e = _mm512_maskz_mov_ps(live, bmm_exp(_mm512_sub_ps(v, vm)));
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(s + j, tail, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    const __m512 inv = _mm512_set1_ps(bad ? NAN : 1.0f / total); /* total 0: no key allowed, inf, NaN below */
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 tail = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + j), inv));
        _mm256_mask_storeu_epi16(p + j, tail, h);
    }
}
#endif

/* P = softmax of the scores s [b, g, m, n] (fp32, scaled) per row over the keys its request's mask [b, mq, nv]
   (bytes) allows, as bf16 p [b, g, m, n]: keys past nv 0, query rows past mq (padding) 0. 0, -1 a build without
   AVX512-BF16 */
int mls_softmax_bf16(float *s, int64_t b, int64_t g, int64_t m, int64_t n, const uint8_t *mask, int64_t mq, int64_t nv,
                     uint16_t *p, int threads) {
#ifdef MLS_BF16_DOT
    const int64_t rows = b * g * m;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t bi = r / (g * m), i = r % m;
        if (i >= mq)
            memset(p + r * n, 0, sizeof(uint16_t) * (size_t)n);
        else
            bmm_softmax_row(s + r * n, mask + (bi * mq + i) * nv, nv, n, p + r * n);
    }
    return 0;
#else
    (void)s, (void)b, (void)g, (void)m, (void)n, (void)mask, (void)mq, (void)nv, (void)p, (void)threads;
    return -1;
#endif
}


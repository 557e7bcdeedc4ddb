/* ---------------------------------------------------- AMX-BF16 tiles: batched bf16 products with fp32 sums
   The two products of a prompt's decompressed attention (scores = q K^T, then P V) where the kernel plan runs that
   attention in bf16 (kernels/bf16_attention.py): bf16 operands, the unit's fp32 sums, an fp32 result. torch's CPU
   bf16 GEMMs round their result to bf16 (no bf16 x bf16 -> fp32 GEMM in torch 2.13), which would round every score;
   here only the operands are bf16.

   Notation (one batch entry b; the tile unit's TDPBF16PS: C[i, j] += sum_p A[i, 2p] B[p, j].lo + A[i, 2p + 1]
   B[p, j].hi, tiles of 16 rows x 64 bytes):
     A  [m, k]      bf16, rows lda apart (q's rows, or P's)
     B  [k / 2, n]  int32: the pairs (Bm[2p, j], Bm[2p + 1, j]) of the right operand Bm [k, n], pair row p of
                    columns j0 .. j0 + 15 at B + (j0 / 16) bj + p ldb (K^T in blocks of 16 keys, [n / 16, k / 2, 16],
                    so that a tile is 1 KiB in a row, not 16 lines a context's row apart: bj = 8 k, ldb = 16; V
                    with two consecutive rows interleaved, [k / 2, n]: bj = 16, ldb = n), packed by the caller once
                    per head group
     C  [m, n]      fp32, rows ldc apart: sum_k A[i, k] Bm[k, j], the products exact, their sums in fp32 inside the
                    unit, k / 32 tile steps in order:
                    |C - A Bm| <= (k / 2 + 1) 2^-24 sum_k |A[i, k]| |Bm[k, j]| (bf16 products are exact in fp32)
   Blocks of 32 x 32 outputs (tiles 0-3), two A tiles (4, 5) and two B tiles (6, 7) per step of 32 values; m, n
   multiples of 32 and k of 32 (the caller pads with zeros). A row's result does not depend on the other rows, the
   batch or the threads (the same steps in the same order). The unit treats bf16 subnormals as zero and flushes fp32
   subnormal outputs (no effect at attention scales). */
#ifdef MLS_AMX_BF16

/* one 32 x 32 block of C: rows i0.., columns j0.. of batch entry b */
static void bmm_block(const uint16_t *a, int64_t lda, const int32_t *bp, int64_t ldb, int64_t bj, int64_t k, float *c,
                      int64_t ldc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += 32) {
        _tile_loadd(4, a + kk, lda * 2);
        _tile_loadd(5, a + 16 * lda + kk, lda * 2);
        _tile_loadd(6, bp + (kk / 2) * ldb, ldb * 4);
        _tile_loadd(7, bp + bj + (kk / 2) * ldb, ldb * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
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
   (bytes) allows, as bf16 p [b, g, m, n]: keys past nv 0, query rows past mq (padding) 0. 0, -1 no bf16 tiles */
int mls_softmax_bf16(float *s, int64_t b, int64_t g, int64_t m, int64_t n, const uint8_t *mask, int64_t mq, int64_t nv,
                     uint16_t *p, int threads) {
#ifdef MLS_AMX_BF16
    if (amx_permission() != 1) return -1;
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

/* C_b = A_b Bm_b for b < batch (batch strides sa, sb, sc in elements), as above: 0, -1 this build or process has
   no bf16 tiles, -2 m or n not a multiple of 32, k not a multiple of 32 */
int mls_bf16_bmm(const uint16_t *a, int64_t batch, int64_t m, int64_t k, int64_t lda, int64_t sa, const int32_t *bp,
                 int64_t n, int64_t ldb, int64_t bj, int64_t sb, float *c, int64_t ldc, int64_t sc, int threads) {
#ifdef MLS_AMX_BF16
    if (amx_permission() != 1) return -1;
    if (m % 32 || n % 32 || k % 32) return -2;
    const int64_t mb = m / 32, nb = n / 32, items = batch * mb * nb;
    if (items == 0) return 0;
#pragma omp parallel num_threads(threads)
    {
        bx_load_full_tiles(); /* x86/amx_bf16.c */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / (mb * nb), i0 = (it / nb) % mb * 32, j0 = it % nb * 32;
            bmm_block(a + b * sa + i0 * lda, lda, bp + b * sb + (j0 / 16) * bj, ldb, bj, k, c + b * sc + i0 * ldc + j0,
                      ldc);
        }
        _tile_release();
    }
    return 0;
#else
    (void)a, (void)batch, (void)m, (void)k, (void)lda, (void)sa, (void)bp, (void)n, (void)ldb, (void)bj, (void)sb, (void)c;
    (void)ldc, (void)sc, (void)threads;
    return -1;
#endif
}

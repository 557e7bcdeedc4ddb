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
   subnormal outputs (no effect at attention scales). Where the process has no tiles, x86/avx512_bf16.c's dot
   products take the same operands; the masked softmax between the products is there too. */
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
#endif

/* C_b = A_b Bm_b for b < batch (batch strides sa, sb, sc in elements), as above, on the AMX-BF16 tiles where the
   process has them, else by AVX512-BF16 dot products (x86/avx512_bf16.c, its own bound): 0, -1 this build has
   neither, -2 m or n not a multiple of 32, k not a multiple of 32 */
int mls_bf16_bmm(const uint16_t *a, int64_t batch, int64_t m, int64_t k, int64_t lda, int64_t sa, const int32_t *bp,
                 int64_t n, int64_t ldb, int64_t bj, int64_t sb, float *c, int64_t ldc, int64_t sc, int threads) {
    if (m % 32 || n % 32 || k % 32) return -2;
    const int64_t mb = m / 32, nb = n / 32, items = batch * mb * nb;
#ifdef MLS_AMX_BF16
    if (amx_permission() == 1) {
        if (items == 0) return 0;
#pragma omp parallel num_threads(threads)
        {
            bx_load_full_tiles(); /* x86/amx_bf16.c */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                const int64_t b = it / (mb * nb), i0 = (it / nb) % mb * 32, j0 = it % nb * 32;
                bmm_block(a + b * sa + i0 * lda, lda, bp + b * sb + (j0 / 16) * bj, ldb, bj, k,
                          c + b * sc + i0 * ldc + j0, ldc);
            }
            _tile_release();
        }
        return 0;
    }
#endif
#ifdef MLS_BF16_DOT
    if (items == 0) return 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (mb * nb), i0 = (it / nb) % mb * 32, j0 = it % nb * 32;
        dot_block(a + b * sa + i0 * lda, lda, bp + b * sb + (j0 / 16) * bj, ldb, bj, k, c + b * sc + i0 * ldc + j0, ldc);
    }
    return 0;
#else
    (void)a, (void)batch, (void)bp, (void)ldb, (void)bj, (void)sb, (void)c, (void)ldc, (void)sc, (void)threads;
    (void)lda, (void)sa, (void)items;
    return -1;
#endif
}

/* which unit runs mls_bf16_bmm here: 2 the AMX-BF16 tiles, 1 AVX512-BF16 dot products, 0 neither */
int mls_bf16_bmm_unit(void) {
#ifdef MLS_AMX_BF16
    if (amx_permission() == 1) return 2;
#endif
#ifdef MLS_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------- fp32 products of many rows on decoded weight panels (AVX-512)
   Prefill's exact (fp32) products of stored weight rows where the rows per weight are too many for the decode kernels
   (kernels/ggml.py: more than GEMV_ROWS) and the weight stays fp32 grade (Q8_0 under the bf16 rule, every type under
   prefill_matmul="float"). The alternative, every weight decoded to fp32 in memory and then the BLAS GEMM, writes and
   reads 4 bytes per weight value for each product, and on routed experts (tens of rows per expert) the BLAS ran at
   ~60% of its 512-row speed (a 2-core AVX-512 EPYC: 48 rows 57, 512 rows 80-86 GMAC/s): its packing of the
   weight is amortized over few rows. Here a panel of PR weight rows is decoded once into a thread's buffer (the
   reference decoder's values, ref/ or x86/avx2.c's decoders, bit for bit) and every activation row of the chunk
   meets it from there.

   Notation (one product y = x W^T)
     x   [M, K]  fp32 activation rows, ldx apart (K a multiple of 16)
     W   [N]     stored rows; w [N, K] their decoded values, a panel w[r0 .. r0 + PR) at a time ([PR][K] fp32)
     y   [M, N]  fp32, rows ldy apart: y[i, r] = sum_k x[i, k] w[r, k]
   A tile is MR activation rows x PR weight rows: MR x PR accumulators of 16 lanes, lane l summing x[i, k] w[r, k]
   over k = l (mod 16) in order of k, one fused multiply-add each, then the 16 lanes by _mm512_reduce_add_ps:
     |y - x w^T| <= (K / 16 + 4) 2^-24 (1 + 2^-23)^... sum_k |x[i, k]| |w[r, k]|, to first order (K / 16 + 4) 2^-24
     (tests/kernels/test_panels.py holds it against fp64)
   An output's operations are the same whatever tile, chunk, depth block, batch or thread it falls in: a row's result
   does not depend on the batch. Activation rows are taken in chunks and the depth PANEL_KC values at a time: a chunk's
   rows of one depth block fill PANEL_CHUNK_BYTES and stay in L2 while its tiles pass; each panel is decoded once per
   chunk, and the tiles' accumulators wait between depth blocks in a stash, exactly (long rows, on the 2-core AVX-512
   EPYC of 2026-12-06: ds-real's Q8_0 dense down, K 10944, at 64 / 128 / 256 rows 31-38 / 64-70 / 121-132 ms -> 20 /
   38 / 75-80 ms, when the whole depth at once left 6 rows per chunk). */
#ifdef MLS_AVX512
#define PANEL_PR 4                       /* weight rows per panel: 4 accumulators per activation row */
#define PANEL_MR 6                       /* activation rows per tile: 24 accumulators, 4 panel rows, 1 x */
#define PANEL_CHUNK_BYTES (512 << 10)    /* a chunk's activations of one depth block (half of a 1 MiB L2) */
#define PANEL_RUN 8                      /* panels per work item */
#define PANEL_KC 2048                    /* depth per pass over a chunk's tiles (PANEL_CHUNK_BYTES counts this) */

/* rows [0, mr) of x times the panel wp [PR][K] over the depth [k0, k1): the accumulators start at zero (first) or
   from stash, and end in stash or, at the depth's end (last), summed into y (columns [0, nr)); mr a constant where
   inlined with one */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t ldx, const int mr,
                                                              const float *wp, int64_t k, int64_t k0, int64_t k1,
                                                              __m512 *stash, int first, int last, float *y,
                                                              int64_t ldy, int nr) {
    __m512 acc[PANEL_MR][PANEL_PR];
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < PANEL_PR; r++) acc[i][r] = first ? _mm512_setzero_ps() : stash[i * PANEL_PR + r];
    for (int64_t kk = k0; kk < k1; kk += 16) {
        const __m512 w0 = _mm512_load_ps(wp + kk), w1 = _mm512_load_ps(wp + k + kk);
        const __m512 w2 = _mm512_load_ps(wp + 2 * k + kk), w3 = _mm512_load_ps(wp + 3 * k + kk);
        for (int i = 0; i < mr; i++) {
            const __m512 xi = _mm512_loadu_ps(x + i * ldx + kk);
            acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xi, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xi, w3, acc[i][3]);
        }
    }
    if (last) {
        for (int i = 0; i < mr; i++)
            for (int r = 0; r < nr; r++) y[i * ldy + r] = _mm512_reduce_add_ps(acc[i][r]);
    } else {
        for (int i = 0; i < mr; i++)
            for (int r = 0; r < PANEL_PR; r++) stash[i * PANEL_PR + r] = acc[i][r];
    }
}

/* rows [0, m) of x times the panel, PANEL_KC values of depth at a time (a chunk's activations of one depth block
   stay in L2 while its tiles pass, however long the rows; each tile's accumulators wait in stash between blocks,
   exactly), MR rows at a time (the last tile's rows as constants too). Each output's operations are the same in a
   tile of any height and for any number of depth blocks: one lane chain in order of k, then the lanes' sum. */
static void panel_rows(const float *x, int64_t ldx, int64_t m, const float *wp, int64_t k, __m512 *stash, float *y,
                       int64_t ldy, int nr) {
    const int64_t full = m / PANEL_MR * PANEL_MR;
    for (int64_t k0 = 0; k0 < k; k0 += PANEL_KC) {
        const int64_t k1 = k - k0 < PANEL_KC ? k : k0 + PANEL_KC;
        const int first = k0 == 0, last = k1 == k;
        int64_t i = 0;
        for (; i < full; i += PANEL_MR)
            panel_tile(x + i * ldx, ldx, PANEL_MR, wp, k, k0, k1, stash + i * PANEL_PR, first, last, y + i * ldy,
                       ldy, nr);
        const float *xi = x + i * ldx;
        __m512 *si = stash + i * PANEL_PR;
        float *yi = y + i * ldy;
        switch (m - i) {
        case 5: panel_tile(xi, ldx, 5, wp, k, k0, k1, si, first, last, yi, ldy, nr); break;
        case 4: panel_tile(xi, ldx, 4, wp, k, k0, k1, si, first, last, yi, ldy, nr); break;
        case 3: panel_tile(xi, ldx, 3, wp, k, k0, k1, si, first, last, yi, ldy, nr); break;
        case 2: panel_tile(xi, ldx, 2, wp, k, k0, k1, si, first, last, yi, ldy, nr); break;
        case 1: panel_tile(xi, ldx, 1, wp, k, k0, k1, si, first, last, yi, ldy, nr); break;
        default: break;
        }
    }
}

/* one item: weight rows [r0, r1) of we (PANEL_RUN panels at most) times activation rows [0, m) of x, a panel at a
   time decoded into wp (rows past r1 zero) */
static void panel_item(const mls_type_t *ty, const uint8_t *we, int64_t row_bytes, int64_t r0, int64_t r1,
                       const float *x, int64_t ldx, int64_t m, int64_t k, float *wp, __m512 *stash, float *y,
                       int64_t ldy) {
    for (int64_t p0 = r0; p0 < r1; p0 += PANEL_PR) {
        const int nr = r1 - p0 < PANEL_PR ? (int)(r1 - p0) : PANEL_PR;
        for (int r = 0; r < PANEL_PR; r++) {
            if (r < nr) {
                prefetch_row(we + (p0 + r) * row_bytes, row_bytes);
                ty->decode(we + (p0 + r) * row_bytes, wp + r * k, k);
            } else {
                memset(wp + r * k, 0, sizeof(float) * (size_t)k);
            }
        }
        panel_rows(x, ldx, m, wp, k, stash, y + p0, ldy, nr);
    }
}

/* The grouped form: rows [starts[a], starts[a + 1]) of x [P, ldx] times the rows of w + experts[a] * expert_stride
   (groups of them; one weight: groups 1, experts {0}, starts {0, M}), into y [P, ldy] (columns [0, n)). Items (a
   group's chunk of activation rows, PANEL_RUN panels of its weight) go to the threads dynamically. Returns 0, -4
   when memory runs out. */
static int panels_grouped(const mls_type_t *ty, const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t n,
                          int64_t row_bytes, int64_t expert_stride, const int64_t *experts, const int64_t *starts,
                          int64_t groups, float *y, int64_t ldy, int threads) {
    const int64_t kc = k < PANEL_KC ? k : PANEL_KC; /* a chunk's rows of one depth block fill PANEL_CHUNK_BYTES */
    const int64_t fit = PANEL_CHUNK_BYTES / (4 * kc);
    const int64_t chunk_rows = fit > PANEL_MR ? fit / PANEL_MR * PANEL_MR : PANEL_MR;
    const int64_t runs = (n + PANEL_PR * PANEL_RUN - 1) / (PANEL_PR * PANEL_RUN);
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1)); /* each group's first item */
    if (!first) return -4;
    first[0] = 0;
    for (int64_t a = 0; a < groups; a++)
        first[a + 1] = first[a] + (starts[a + 1] - starts[a] + chunk_rows - 1) / chunk_rows * runs;
    const int64_t items = first[groups];
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        /* the thread's panel [PR][K], then the accumulators of a chunk's tiles between depth blocks */
        const size_t panel_bytes = sizeof(float) * PANEL_PR * (size_t)k;
        const size_t stash_bytes = sizeof(__m512) * PANEL_PR * (size_t)(chunk_rows + PANEL_MR);
        float *wp = (float *)aligned_alloc(64, panel_bytes + stash_bytes);
        __m512 *stash = wp ? (__m512 *)((char *)wp + panel_bytes) : 0;
        if (!wp) {
#pragma omp atomic write
            rc = -4;
        }
        int64_t a = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!wp) continue;
            while (first[a + 1] <= it) a++;
            while (first[a] > it) a--;
            const int64_t j = it - first[a], c = j / runs, run = j % runs;
            const int64_t i0 = starts[a] + c * chunk_rows, r0 = run * PANEL_PR * PANEL_RUN;
            const int64_t i1 = i0 + chunk_rows < starts[a + 1] ? i0 + chunk_rows : starts[a + 1];
            const int64_t r1 = r0 + PANEL_PR * PANEL_RUN < n ? r0 + PANEL_PR * PANEL_RUN : n;
            panel_item(ty, w + experts[a] * expert_stride, row_bytes, r0, r1, x + i0 * ldx, ldx, i1 - i0, k, wp, stash,
                       y + i0 * ldy, ldy);
        }
        free(wp);
    }
    free(first);
    return rc;
}
#endif

/* y [P, ldy] (columns [0, n)) = rows [starts[a], starts[a + 1]) of x [P, k] times the decoded rows of w +
   experts[a] * expert_stride, for a < groups, on decoded panels as above: 0, -1 the build has no AVX-512 or the
   type no plain decoder, -2 k not a multiple of 16 or over MAX_K, -4 out of memory */
int mls_grouped_panels(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                       int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                       int64_t ldy, int threads) {
#ifdef MLS_AVX512
    const mls_type_t *ty = type_of(type);
    if (!ty->decode) return -1;
    if (k % 16 || k > MAX_K) return -2;
    if (n == 0 || groups == 0) return 0;
    return panels_grouped(ty, x, k, k, w, n, row_bytes, expert_stride, experts, starts, groups, y, ldy, threads);
#else
    (void)type, (void)x, (void)k, (void)w, (void)n, (void)row_bytes, (void)expert_stride, (void)experts, (void)starts;
    (void)groups, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* whether this build has the panel products: 1 yes (AVX-512), 0 no */
int mls_panels(void) {
#ifdef MLS_AVX512
    return 1;
#else
    return 0;
#endif
}

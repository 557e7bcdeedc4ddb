/* ------------------------------ the int16 products of few activation rows on AVX2 (a build without AVX512-VNNI)
   The decode steps' int16 products (activations "int8_6bit_int16": Q8_0, Q5_0, MXFP4 at every decode row count,
   int16.c qw_in) where the build has no AVX512-VNNI: an AVX2 CPU. Before this file such a CPU ran them in fp32 (the
   fused row kernels: a Q8_0 code widened to int32 and then to float, one FMA per 8 values), which read 21-22 GB/s
   of a 37-38 GB/s ceiling at one activation row (2-core AMD EPYC, AVX2 only, benchmarks/gemv_bandwidth.py), while
   the int8 row kernels read 29 on the same weights. Here a weight block's 32 codes are widened to int16 in two
   vpmovsxbw and met by the activation block's 32 int16 codes in two vpmaddwd (8 int32 lanes of pair sums): the
   int8 kernels' instruction count at int16's grade.

   Notation and arithmetic: x86/int16_prefill.c's. Per activation row i, weight row r, block b:
     S_b[i, r] = sum_{k in b} q[r, k] c[i, k]     exact in int32 (a pair sum <= 2 128 32767; the sum < 2^31)
     lane r of acc_i += fl(d[r, b] d_x[i, b]) fl(S_b[i, r])      one mul and one fma per block, in block order
   The activations' codes and scales are qw_quantize_row's values (the same rounding of the same products: an
   AVX-512 build's codes), so a row's result has the AVX512-VNNI build's bits (its rows and panels), and does not
   depend on the rows beside it: more than QW_FEW rows run QW_FEW at a time over the same weight rows (Q8_0's,
   whose codes are bytes as they lie, read again from cache; the other types' codes of each run of 8 rows unpacked
   once into the caller's buffer: qw_run). The codes lie in their natural order here (the VNNI build's pair order serves its
   panels only).

   The decode steps take these, and a prompt's routed experts (up to 128 rows an expert: int16_prefill.py
   takes_expert_rows); a prompt's dense products stay fp32 on such a CPU (kernels/bf16_prefill.takes_bf16: the
   many-rows int16 path is the panels', MLS_INT16_PANELS), where BLAS's fp32 GEMM keeps the FMA units busy and a
   widening per weight value and activation row would not. */
#if !defined(MLS_INT16) && defined(MLS_SIMD)
#define MLS_INT16 1
#define QW_R 16      /* weight rows per work item (two runs of 8 here), as the VNNI build's panels */
#define QW_FEW 3     /* activation rows met per pass over the weight rows */
#define QW_CHUNK 256 /* activation rows per work item (int16.c's work lists) */
#define QW_TINY 0x1p-100f

/* one activation row's blocks into int16 codes (natural order) and scales: x86/int16_prefill.c's values */
static void qw_quantize_row(const float *x, int64_t k, int16_t *xc, float *xd) {
    const __m256 zero = _mm256_setzero_ps(), abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < k / 32; b++) {
        __m256 v[4], m = zero, nan = zero;
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
            nan = _mm256_add_ps(nan, _mm256_mul_ps(v[j], zero)); /* NaN for a NaN or an infinity, 0 otherwise */
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))), finite = hsum8(nan);
        if (finite != finite || !(amax >= QW_TINY)) {
            xd[b] = finite != finite ? finite : 0.0f;
            memset(xc + 32 * b, 0, 64);
            continue;
        }
        const __m256 id = _mm256_set1_ps(32767.0f / amax);
        xd[b] = amax / 32767.0f;
        for (int h2 = 0; h2 < 2; h2++) { /* rne (the default rounding), packed without saturating: |c| <= 32767 */
            const __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h2], id));
            const __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h2 + 1], id));
            _mm256_storeu_si256((__m256i *)(xc + 32 * b + 16 * h2),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8));
        }
    }
}

/* the types whose products run here (x86/int16_prefill.c's) */
static inline int qw_type(int type) {
    return type == MLS_Q8_0 || type == MLS_Q4_0 || type == MLS_Q5_0 || type == MLS_IQ4_NL || type == MLS_MXFP4;
}

/* the 8 rows' block scales d at block b (block_d; lanes past nr: 0): the fp16 at each block's start by one gather,
   MXFP4's e8m0 row by row */
static inline __attribute__((always_inline)) __m256 qw_scales8(const uint8_t *b0, __m256i offs, __m256i live,
                                                               const int type, int64_t row_bytes, int64_t nr) {
    if (type != MLS_MXFP4)
        return f16_lanes(_mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)b0, offs, live, 1));
    float d[8] __attribute__((aligned(32))) = {0};
    for (int64_t r = 0; r < nr; r++) d[r] = block_d(b0 + r * row_bytes, type);
    return _mm256_load_ps(d);
}

/* nr (<= 8) weight rows at w (row_bytes apart) times activation rows [0, mr) (codes xc, k apart; scales xd) into y
   (row stride ldy); type and mr constants where inlined. The next 8 rows (the next run, mostly this thread's)
   stream into L2 beside the reads, one line per 64 bytes consumed (x86/rows8_q8k.c rows8_q45's scheme). */
static inline __attribute__((always_inline)) void qw_few8(const int type, const uint8_t *w, int64_t row_bytes,
                                                          int64_t nr, const int16_t *pc, const int16_t *xc,
                                                          const float *xd, const int mr, int64_t k, float *y,
                                                          int64_t ldy) {
    const int64_t kb = k / 32, bytes = block_bytes(type), step = (8 * row_bytes + kb - 1) / kb;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr), lane);
    const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)row_bytes));
    const char *pf = (const char *)w + 8 * row_bytes;
    __m256 acc[QW_FEW];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        if (!pc) pf = prefetch_next_rows(pf, w, 8, row_bytes, b, step);
        __m256i xl[QW_FEW], xh[QW_FEW], H[QW_FEW][4];
        for (int i = 0; i < mr; i++) {
            xl[i] = _mm256_loadu_si256((const __m256i *)(xc + i * k + 32 * b));
            xh[i] = _mm256_loadu_si256((const __m256i *)(xc + i * k + 32 * b + 16));
        }
        for (int p = 0; p < 4; p++) { /* rows 2p, 2p + 1: their pair sums, then one hadd (the lane sums' first step) */
            __m256i P[2][QW_FEW];
            for (int s = 0; s < 2; s++) {
                const int r = 2 * p + s;
                if (r >= nr) {
                    for (int i = 0; i < mr; i++) P[s][i] = _mm256_setzero_si256();
                    continue;
                }
                __m256i lo, hi;
                if (pc) { /* the run's codes unpacked once (qw_unpack8) */
                    lo = _mm256_load_si256((const __m256i *)(pc + r * k + 32 * b));
                    hi = _mm256_load_si256((const __m256i *)(pc + r * k + 32 * b + 16));
                } else {
                    __m128i g[2];
                    block_codes16(w + r * row_bytes + bytes * b, type, g);
                    lo = _mm256_cvtepi8_epi16(g[0]), hi = _mm256_cvtepi8_epi16(g[1]);
                }
                for (int i = 0; i < mr; i++)
                    P[s][i] = _mm256_add_epi32(_mm256_madd_epi16(lo, xl[i]), _mm256_madd_epi16(hi, xh[i]));
            }
            for (int i = 0; i < mr; i++) H[i][p] = _mm256_hadd_epi32(P[0][i], P[1][i]);
        }
        const __m256 D = qw_scales8(w + bytes * b, offs, live, type, row_bytes, nr);
        for (int i = 0; i < mr; i++) { /* lane r = S_b[i, r] (lane_sums8x8's remaining steps) */
            const __m256i ab = _mm256_hadd_epi32(H[i][0], H[i][1]), cd = _mm256_hadd_epi32(H[i][2], H[i][3]);
            const __m256i S = _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(D, _mm256_set1_ps(xd[i * kb + b])), _mm256_cvtepi32_ps(S), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_maskstore_ps(y + i * ldy, live, acc[i]);
}

/* mr (<= QW_FEW) activation rows times n8 (<= 8) weight rows, type specialised; pc: the rows' codes unpacked
   (qw_unpack8), or NULL to read the blocks where they lie */
static void qw_few8_rows(int type, const uint8_t *wr, int64_t row_bytes, int64_t n8, const int16_t *pc,
                         const int16_t *xc, const float *xd, int64_t mr, int64_t k, float *y, int64_t ldy) {
#define QW_FEW_CASE(t)                                                                            \
    case t:                                                                                       \
        if (pc && mr == 3) qw_few8(t, wr, row_bytes, n8, pc, xc, xd, 3, k, y, ldy);                \
        else if (pc && mr == 2) qw_few8(t, wr, row_bytes, n8, pc, xc, xd, 2, k, y, ldy);           \
        else if (pc) qw_few8(t, wr, row_bytes, n8, pc, xc, xd, 1, k, y, ldy);                      \
        else if (mr == 1) qw_few8(t, wr, row_bytes, n8, NULL, xc, xd, 1, k, y, ldy);               \
        else if (mr == 2) qw_few8(t, wr, row_bytes, n8, NULL, xc, xd, 2, k, y, ldy);               \
        else qw_few8(t, wr, row_bytes, n8, NULL, xc, xd, 3, k, y, ldy);                            \
        break;
    switch (type) {
        QW_FEW_CASE(MLS_Q8_0) QW_FEW_CASE(MLS_Q4_0) QW_FEW_CASE(MLS_Q5_0) QW_FEW_CASE(MLS_IQ4_NL)
        default: QW_FEW_CASE(MLS_MXFP4)
    }
#undef QW_FEW_CASE
}

/* mr (<= QW_FEW) activation rows times nr (<= QW_R) weight rows, in runs of 8, read where they lie */
static void qw_few_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc, const float *xd,
                        int64_t mr, int64_t k, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < nr; r0 += 8)
        qw_few8_rows(type, w + r0 * row_bytes, row_bytes, nr - r0 < 8 ? nr - r0 : 8, NULL, xc, xd, mr, k, y + r0, ldy);
}

/* a thread's buffer: one run's 8 rows of int16 codes */
static inline size_t qw_panel_bytes(int64_t k) { return (size_t)(8 * k) * sizeof(int16_t) + 64; }

/* n8 (<= 8) rows' codes (block_codes16, widened: the values qw_few8 meets the activations with) into pc [8, k] */
static void qw_unpack8(int type, const uint8_t *w, int64_t row_bytes, int64_t n8, int64_t k, int16_t *pc) {
    const int64_t bytes = block_bytes(type);
    for (int64_t r = 0; r < n8; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            __m128i g[2];
            block_codes16(w + r * row_bytes + bytes * b, type, g);
            _mm256_store_si256((__m256i *)(pc + r * k + 32 * b), _mm256_cvtepi8_epi16(g[0]));
            _mm256_store_si256((__m256i *)(pc + r * k + 32 * b + 16), _mm256_cvtepi8_epi16(g[1]));
        }
}

/* nr (<= QW_R) weight rows at w times m activation rows (qw_quantize_row's codes xc, k apart, and scales xd) into y
   (row stride ldy): QW_FEW rows at a time. Up to QW_FEW rows read the weight rows where they lie; more (a 16-request
   step's dense products, an expert's larger groups) with a panel (the callers' buffer of qw_panel_bytes) unpack each
   run of 8 rows' codes once and meet every pass with them: the same integers and float steps, so the same bits,
   without a block's unpacking per pass (Q5_0's five bits, ~8 instructions a block and row; 16 rows: 6 passes).
   Q5_0's 3072 x 384 at 2 threads, the AVX2 EPYC: 5 rows 0.19 -> 0.16 ms, 8 rows 0.28 -> 0.19, 16 rows 0.56 -> 0.33;
   Q8_0's 1024 x 2048 unpacked measured slower (16 rows 0.54 -> 0.69 ms, 5 rows 0.18 -> 0.25): it reads in place. */
static void qw_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc, const float *xd,
                   int64_t m, int64_t k, float *y, int64_t ldy, void *panel) {
    if (m <= QW_FEW || !panel || type == MLS_Q8_0) { /* Q8_0's codes are bytes as they lie: unpacked, slower */
        for (int64_t i = 0; i < m; i += QW_FEW)
            qw_few_rows(type, w, row_bytes, nr, xc + i * k, xd + i * (k / 32), m - i < QW_FEW ? m - i : QW_FEW, k,
                        y + i * ldy, ldy);
        return;
    }
    int16_t *pc = (int16_t *)panel;
    for (int64_t r0 = 0; r0 < nr; r0 += 8) {
        const int64_t n8 = nr - r0 < 8 ? nr - r0 : 8;
        qw_unpack8(type, w + r0 * row_bytes, row_bytes, n8, k, pc);
        /* the next run's rows into L2 while the passes meet this one (qw_unpack8 reads 8 rows a block at a time,
           row_bytes apart, which the hardware prefetchers do not run ahead of: x86/avx2_panels.c a2_prefetch_item) */
        if (r0 + 8 < nr) prefetch_l2(w + (r0 + 8) * row_bytes, (nr - r0 - 8 < 8 ? nr - r0 - 8 : 8) * row_bytes);
        for (int64_t i = 0; i < m; i += QW_FEW)
            qw_few8_rows(type, w + r0 * row_bytes, row_bytes, n8, pc, xc + i * k, xd + i * (k / 32),
                         m - i < QW_FEW ? m - i : QW_FEW, k, y + i * ldy + r0, ldy);
    }
}
#endif

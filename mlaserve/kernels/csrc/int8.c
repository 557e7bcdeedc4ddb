/* ---------------------------------------------------------------- int8 activations
   llama.cpp's integer dot products. Each activation row is quantized once per product to int8 codes with fp32
   scales, in the form the weight type's kernel takes (types.c `act`):
   - Q8_0-style (Q8_0, Q4_0 weights): each 32-value block with d_x = max|x| / 127, q_x = x / d_x rounded to
     nearest; a block's product is d_w * d_x * (the exact int32 sum of q_w q_x).
   - Q8_K-style (Q4_K, Q5_K, Q6_K weights), llama.cpp's quantize_row_q8_K: each 256-value super-block with
     iscale = -127 / max (max: the value of largest magnitude, the first of ties), q_x = nearest(iscale * x)
     and d_x = 1 / iscale, plus the sums of its codes per 32 values (q8k_meta); the weight's sub-block scales
     and mins apply to exact integer sums (x86/avx2.c).
   Not exact: |x - d_x q_x| <= |d_x| / 2 per value, so |y - y_exact| <= sum_j |w_j| |d_x(j)| / 2, plus fp32
   rounding of the block sums. About half the instructions of the float path per weight, or fewer. Return -1 for
   other weight types. */

/* x [m, k] (row stride ldx) -> q [m, k] int8 in [-127, 127] and d [m, k / 32]. A block holding NaN or
   Inf gets scale NaN (its products come out NaN, as the float path's would) and codes 0; a block too
   small for a normal scale quantizes to zeros. */
static void quantize_rows_q8(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d) {
    const int64_t kb = k / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < kb; b++) {
            const float *xb = x + i * ldx + b * 32;
            int8_t *qb = q + i * k + b * 32;
            float amax = 0.0f;
            int finite = 1;
            for (int j = 0; j < 32; j++) {
                finite &= isfinite(xb[j]) != 0;
                amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            }
            const float dd = amax / 127.0f, inv = dd >= FLT_MIN ? 1.0f / dd : 0.0f;
            for (int j = 0; j < 32; j++) {
                const float v = finite ? nearbyintf(xb[j] * inv) : 0.0f;
                qb[j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
            d[i * kb + b] = finite ? dd : NAN;
        }
}

#ifdef MLS_AVX512
/* One super-block of quantize_rows_q8k below in 16 lanes, for prefill's many rows (the scalar loop took ~15% of a
   64-row tile product): the same fp32 operations per value (|x|, the first value of the largest magnitude,
   iscale = -127 / max, nearest(iscale x) in the current rounding mode as nearbyintf, the clamp, the integer sums),
   so the same bytes. Returns 0 for a super-block holding NaN or Inf (the scalar loop's rule then applies). */
static inline int q8k_block_avx512(const float *xb, int8_t *qb, q8k_meta *meta) {
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int j = 0; j < 256; j += 16) {
        const __m512 v = _mm512_loadu_ps(xb + j);
        bad |= _mm512_fpclass_ps_mask(v, 0x99); /* QNaN 0x01, +Inf 0x08, -Inf 0x10, SNaN 0x80 */
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    if (bad) return 0;
    const float amax = _mm512_reduce_max_ps(vmax);
    float max = 0.0f;
    for (int j = 0; amax > 0.0f && j < 256; j += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
        if (hit) {
            max = xb[j + __builtin_ctz(hit)]; /* the first of equal magnitudes, as the scalar `ax > amax` */
            break;
        }
    }
    float iscale = amax > 0.0f ? -127.0f / max : 0.0f;
    if (!isfinite(iscale)) iscale = 0.0f;
    const __m512 s = _mm512_set1_ps(iscale), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int c = 0; c < 8; c++) {
        int32_t sum = 0;
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(s, _mm512_loadu_ps(xb + 32 * c + 16 * h)), _MM_FROUND_CUR_DIRECTION);
            const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)); /* integral: exact */
            _mm_storeu_si128((__m128i *)(qb + 32 * c + 16 * h), _mm512_cvtsepi32_epi8(q));
            sum += _mm512_reduce_add_epi32(q);
        }
        meta->bsum[c] = (int16_t)sum;
    }
    meta->pad[0] = meta->pad[1] = meta->pad[2] = 0;
    meta->d = iscale != 0.0f ? 1.0f / iscale : 0.0f;
    return 1;
}
#endif

/* x [m, k] -> q [m, k] and Q8_K-style scales: 8 float slots per super-block hold a q8k_meta (common.h). A
   super-block holding NaN or Inf gets d NaN and codes 0 (as quantize_rows_q8); an all-zero one d 0 and codes 0
   (llama.cpp's rule); one whose largest magnitude is too small for a finite 127 / max also quantizes to zeros. */
static void quantize_rows_q8k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d) {
    const int64_t slots = k / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t blk = 0; blk < k / 256; blk++) {
            const float *xb = x + i * ldx + blk * 256;
            int8_t *qb = q + i * k + blk * 256;
            q8k_meta *meta = (q8k_meta *)(d + i * slots + blk * Q8K_SLOTS);
#ifdef MLS_AVX512
            if (q8k_block_avx512(xb, qb, meta)) continue;
#endif
            float amax = 0.0f, max = 0.0f;
            int finite = 1;
            for (int j = 0; j < 256; j++) {
                finite &= isfinite(xb[j]) != 0;
                const float ax = fabsf(xb[j]);
                if (ax > amax) {
                    amax = ax;
                    max = xb[j];
                }
            }
            float iscale = finite && amax > 0.0f ? -127.0f / max : 0.0f;
            if (!isfinite(iscale)) iscale = 0.0f;
            for (int j = 0; j < 256; j++) {
                const float v = iscale != 0.0f ? nearbyintf(iscale * xb[j]) : 0.0f;
                qb[j] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
            }
            for (int j = 0; j < 8; j++) {
                int32_t s = 0;
                for (int l = 0; l < 32; l++) s += qb[32 * j + l];
                meta->bsum[j] = (int16_t)s;
            }
            meta->pad[0] = meta->pad[1] = meta->pad[2] = 0;
            meta->d = !finite ? NAN : iscale != 0.0f ? 1.0f / iscale : 0.0f;
        }
}

/* x [m, k] -> the activations a type's int8 kernel takes (q [m, k], k / 32 float slots per row) */
static inline void quantize_act(int type, const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d) {
    if (type_of(type)->act == 256)
        quantize_rows_q8k(x, m, k, ldx, q, d);
    else
        quantize_rows_q8(x, m, k, ldx, q, d);
}

/* quantize_act with the rows spread over the threads when there are many (prefill: one thread took ~3% of a
   512-token step); each row's codes and slots are its own, so the same bytes */
static void quantize_act_rows(int type, const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d,
                              int threads) {
    if (m < 64 || threads < 2) {
        quantize_act(type, x, m, k, ldx, q, d);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        const int64_t mr = m - i0 < 16 ? m - i0 : 16;
        quantize_act(type, x + i0 * ldx, mr, k, ldx, q + i0 * k, d + i0 * (k / 32));
    }
}

/* whether rows of k values fit a type's int8 activations (whole activation blocks) */
static inline int act_fits(int type, int64_t k) { return type_of(type)->act > 0 && k % type_of(type)->act == 0; }

int mls_quantize_act(int type, const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d) {
    if (!q8rows(type)) return -1;
    if (!act_fits(type, k) || k > MAX_K) return -2;
    quantize_act(type, x, m, k, ldx, q, d);
    return 0;
}

/* whether a product of m activation rows runs on the int8 weight panels (x86/vnni_panels.c with AVX512-VNNI,
   x86/avx2_panels.c without): where the AMX tiles do not take it */
#ifdef MLS_INT8_PANELS
static int int8_panels_take(int type, int64_t m) {
#ifdef MLS_AMX
    if (amx_takes(type, m)) return 0;
#endif
    return int8_panels_min_rows(type) > 0 && m >= int8_panels_min_rows(type);
}
#define PANELS_TOOK(m) int8_panels_take(type, (m))
#else
#define PANELS_TOOK(m) 0
#endif

/* the activation rows from which an int8 product on this type takes the panels in this process; 0 when it never does
   (not a panel type, no panels in the build, or the tiles take its products) */
int64_t mls_int8_panel_rows(int type) {
#ifdef MLS_INT8_PANELS
#ifdef MLS_AMX
    if (amx_type(type) && amx_permission() == 1) return 0;
#endif
    return int8_panels_min_rows(type);
#else
    (void)type;
    return 0;
#endif
}

/* the panels' instructions: "avx512-vnni", "avx2", or "" in a build without them */
const char *mls_int8_panels_isa(void) {
#ifdef MLS_INT8_PANELS
    return MLS_INT8_PANELS;
#else
    return "";
#endif
}

static inline float q8dot(q8rows_fn fn, const uint8_t *b, const int8_t *xq, const float *xd, int64_t k) {
    float y;
    fn(b, xq, xd, 1, k, &y, 1);
    return y;
}

#ifdef MLS_Q8K_ROWS16
/* weight rows [r0, r1) of one run (row r at lo + r row_bytes below split, hi + (r - split) row_bytes from it: gate
   and up of a MoE block) times a group's m >= 2 activation rows packed as pairs (xp, dxt: q4_0_pairs_pack's chunks)
   into y (row stride ldy) at column r: two weight rows per call where both lie on one side */
static void q4_0_pairs_run(const uint8_t *lo, const uint8_t *hi, int64_t split, int64_t row_bytes, int64_t r0,
                           int64_t r1, const int8_t *xp, const float *dxt, int64_t m, int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32;
    for (int64_t r = r0, nr; r < r1; r += nr) {
        nr = r + 1 < r1 && (r + 1 < split) == (r < split) ? 2 : 1;
        const uint8_t *row = r < split ? lo + r * row_bytes : hi + (r - split) * row_bytes;
        for (int64_t c = 0; c * 16 < m; c++)
            q4_0_pairs_rows(row, row_bytes, nr, xp + c * kb * 8 * 64, dxt + c * kb * 16, m - c * 16 < 16 ? m - c * 16 : 16,
                            k, y + c * 16 * ldy + r, ldy);
    }
}

/* each group of 2+ rows (rows start[a] .. start[a + 1] of codes [*, k] / scales [*, k / 32]) packed as pairs at its
   chunk offset off[a] (a MoE block's routed groups) */
static void q4_0_pairs_pack_groups(const int8_t *codes, const float *scales, int64_t k, const int64_t *start,
                                   int64_t groups, const int64_t *off, int8_t *xp, float *dxt) {
    for (int64_t a = 0; a < groups; a++)
        if (start[a + 1] - start[a] >= 2)
            q4_0_pairs_pack(codes + start[a] * k, scales + start[a] * (k / 32), start[a + 1] - start[a], k,
                            xp + off[a] * (k / 32) * 512, dxt + off[a] * (k / 32) * 16);
}

/* Q4_0 at m >= 2 rows (x86/rows16_q8k.c q4_0_pairs_rows): the activations packed as pairs once, then pairs of
   weight rows over the threads, each over every chunk of 16 activation rows. Returns 0, -4 out of memory. */
static int q4_0_pairs_gemm(const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd, int64_t m,
                           int64_t k, float *y, int64_t ldy, int threads) {
    const int64_t kb = k / 32, chunks = (m + 15) / 16;
    int8_t *xp = (int8_t *)aligned_alloc(64, (size_t)(chunks * kb * 8 * 64));
    float *dxt = (float *)malloc(sizeof(float) * (size_t)(chunks * kb * 16));
    if (!xp || !dxt) {
        free(xp);
        free(dxt);
        return -4;
    }
    q4_0_pairs_pack(xq, xd, m, k, xp, dxt);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < n; r0 += 2)
        q4_0_pairs_run(w, w, n, row_bytes, r0, r0 + 2 < n ? r0 + 2 : n, xp, dxt, m, k, y, ldy);
    free(xp);
    free(dxt);
    return 0;
}
#define Q4_0_PAIRS(type, m) q4_0_pairs_takes((type), (m))
#else
#define Q4_0_PAIRS(type, m) 0
static inline int q4_0_pairs_gemm(const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd,
                                  int64_t m, int64_t k, float *y, int64_t ldy, int threads) {
    (void)w, (void)n, (void)row_bytes, (void)xq, (void)xd, (void)m, (void)k, (void)y, (void)ldy, (void)threads;
    return -1;
}
static inline void q4_0_pairs_run(const uint8_t *lo, const uint8_t *hi, int64_t split, int64_t row_bytes, int64_t r0,
                                  int64_t r1, const int8_t *xp, const float *dxt, int64_t m, int64_t k, float *y,
                                  int64_t ldy) {
    (void)lo, (void)hi, (void)split, (void)row_bytes, (void)r0, (void)r1, (void)xp, (void)dxt, (void)m, (void)k, (void)y;
    (void)ldy;
}
static inline void q4_0_pairs_pack(const int8_t *xq, const float *xd, int64_t m, int64_t k, int8_t *xp, float *dxt) {
    (void)xq, (void)xd, (void)m, (void)k, (void)xp, (void)dxt;
}
static inline void q4_0_pairs_pack_groups(const int8_t *codes, const float *scales, int64_t k, const int64_t *start,
                                          int64_t groups, const int64_t *off, int8_t *xp, float *dxt) {
    (void)codes, (void)scales, (void)k, (void)start, (void)groups, (void)off, (void)xp, (void)dxt;
}
#endif

/* Activations quantized once (for the type's kernel), then as mls_gemm / mls_grouped_gemm. */
int mls_gemm_q8(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                int64_t row_bytes, float *y, int64_t ldy, int threads) {
    q8rows_fn fn = q8rows(type);
    if (!fn) return -1;
    if (!act_fits(type, k)) return -2;
    int8_t *xq = (int8_t *)malloc((size_t)(m * k) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * (k / 32)) + 1);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -4;
    }
    quantize_act_rows(type, x, m, k, ldx, xq, xd, threads);
    int rc = 0;
#ifdef MLS_AMX
    if (amx_takes(type, m))
        rc = amx_gemm(type, w, n, row_bytes, xq, xd, m, k, y, ldy, threads);
    else
#endif
#ifdef MLS_INT8_PANELS
    if (PANELS_TOOK(m)) {
        const int64_t one[2] = {0, m}, expert = 0;
        rc = int8_panels_grouped(type, &w, 1, n, row_bytes, 0, &expert, one, 1, xq, xd, k, y, ldy, threads,
                                 int8_panels_take);
    } else
#endif
    if (rows16_in(type, m)) { /* 16 weight rows side by side (a decode row; Q4_K / Q5_K rows), the same bits */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r0 = 0; r0 < n; r0 += 16)
            rows16_run(type, w + r0 * row_bytes, row_bytes, n - r0 < 16 ? n - r0 : 16, xq, xd, m, k, y + r0, ldy);
    } else if (Q4_0_PAIRS(type, m)) { /* two activation rows per vector, two weight rows per pass, the same bits */
        rc = q4_0_pairs_gemm(w, n, row_bytes, xq, xd, m, k, y, ldy, threads);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r++) fn(w + r * row_bytes, xq, xd, m, k, y + r, ldy);
    }
    free(xq);
    free(xd);
    return rc;
}

/* Groups of rows times their experts, every part of each expert (ws[q]: the stacks of one projection's parts, e.g.
   gate and up, each [E, n] rows with the same row_bytes and expert_stride): y [P, nparts * n], part q in columns
   q * n .. q * n + n. The activations quantized once for all parts; the groups of many rows on the tiles in one
   call (amx_grouped), the rest on the row kernels. */
int mls_grouped_gemm_q8_parts(int type, const float *x, int64_t k, const uint8_t *const *ws, int64_t nparts,
                              int64_t n, int64_t row_bytes, int64_t expert_stride, const int64_t *experts,
                              const int64_t *starts, int64_t groups, float *y, int threads) {
    q8rows_fn fn = q8rows(type);
    if (!fn) return -1;
    if (!act_fits(type, k)) return -2;
    /* runs of 16 rows where a group's rows take them side by side (rows16_in: the same bits) */
    const int64_t run = rows16_takes(type) ? 16 : ROW_RUN;
    const int64_t p = starts[groups], kb = k / 32, runs = (n + run - 1) / run, ldy = nparts * n;
    int8_t *xq = (int8_t *)malloc((size_t)(p * k) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(p * kb) + 1);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -4;
    }
    quantize_act_rows(type, x, p, k, k, xq, xd, threads);
    int rc = 0;
#ifdef MLS_AMX
#define AMX_TOOK(m) amx_takes(type, (m))
#else
#define AMX_TOOK(m) 0
#endif
    int64_t rest = 0, panels = 0; /* groups left to the row kernels (all of a decode step's: no tile call, no allocation) */
    for (int64_t a = 0; a < groups; a++) {
        const int64_t rows = starts[a + 1] - starts[a];
        (void)rows; /* builds without the tiles and the panels read it in neither macro */
        panels += PANELS_TOOK(rows) != 0;
        rest += !AMX_TOOK(rows) && !PANELS_TOOK(rows);
    }
#ifdef MLS_AMX
    if (rest + panels < groups)
        rc = amx_grouped(type, ws, nparts, n, row_bytes, expert_stride, experts, starts, groups, xq, xd, k, y, ldy,
                         threads);
#endif
#ifdef MLS_INT8_PANELS
    if (panels && rc == 0)
        rc = int8_panels_grouped(type, ws, nparts, n, row_bytes, expert_stride, experts, starts, groups, xq, xd, k, y,
                                 ldy, threads, int8_panels_take);
#endif
    if (rest && rc == 0) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < groups * nparts * runs; it++) {
            const int64_t a = it / (nparts * runs), q = it / runs % nparts;
            const int64_t r0 = (it % runs) * run, r1 = r0 + run < n ? r0 + run : n;
            const uint8_t *we = ws[q] + experts[a] * expert_stride;
            const int64_t p0 = starts[a];
            if (AMX_TOOK(starts[a + 1] - p0) || PANELS_TOOK(starts[a + 1] - p0)) continue;
            if (rows16_in(type, starts[a + 1] - p0)) {
                rows16_run(type, we + r0 * row_bytes, row_bytes, r1 - r0, xq + p0 * k, xd + p0 * kb, starts[a + 1] - p0, k,
                           y + p0 * ldy + q * n + r0, ldy);
                continue;
            }
            for (int64_t r = r0; r < r1; r++)
                fn(we + r * row_bytes, xq + p0 * k, xd + p0 * kb, starts[a + 1] - p0, k, y + p0 * ldy + q * n + r, ldy);
        }
    }
#undef AMX_TOOK
    free(xq);
    free(xd);
    return rc;
}

int mls_grouped_gemm_q8(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                        int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                        float *y, int threads) {
    return mls_grouped_gemm_q8_parts(type, x, k, &w, 1, n, row_bytes, expert_stride, experts, starts, groups, y,
                                     threads);
}

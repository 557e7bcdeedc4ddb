/* ---------------------------------------------------------------- latent MQA over paged rows (absorbed path)
   Each query is a token t = q_index[query] of the step: per head hh its [q_lat | q_pe] (q_lat = q_nope W_UK,
   c = r + dr values) is read where it lies, at q_lat + t * ql_tok + hh * ql_head and q_pe + t * qp_tok +
   hh * qp_head (no concatenated or gathered copy). Queries [B, Q] (q_index [B, Q]), cache [S, c] rows
   [c_kv | k_pe], slots [B, L] (cache row of each key position), mask [B, Q, L] (bool bytes) -> out
   [B, Q, H, r] = softmax_l(scale * q . row_l) @ row_l[:r]. Rows are read where they are; each work item is
   one query and a group of heads. Attention over one shared row is compute-bound (every head reads it), so
   both products are register-blocked over heads: a row's 8-value slice, loaded once, is multiplied into
   MQA_HS heads' scores, and P c into MQA_HO heads x 16 outputs (a row slice is loaded once per MQA_HO heads
   instead of once per head, the accumulators stay in registers across all the rows). The softmax is taken a
   tile of rows at a time with a running max and sum (the driver below says how); a query with no allowed key
   gets NaN. */
#define MQA_HS 8 /* heads per score pass over a row */
#ifdef MLS_AVX512
#define MQA_HO 8 /* heads per output pass (x 32 values: 16 of the 32 vector registers; per row 2 loads and 8
                    broadcasts feed 16 fmas, so the pass is bound by its fmas, not its loads) */
#else
#define MQA_HO 4 /* heads per output pass (x 16 values: 8 of the 16 vector registers) */
#endif
#define MQA_TILE 128 /* cache rows per tile (loaded once; 288 KB at r + dr = 576, in L2) */

/* s[i * ls + t] = rw[t] . [ql | qp] of head i, for R <= 2 rows and n <= MQA_HS heads (strides ql_head / qp_head).
   Every (head, row) gets the same operations whatever n and R are (16 lanes where the build has them, then one
   8-lane accumulator over what is left of r then dr, the 16 folded in as their halves' sum, a scalar tail), so
   a head's score does not depend on how heads or rows were grouped (the grouping follows the step's query count,
   the thread count and the tile's rows). Two rows per call: each of the 8 query rows loaded feeds two fmas, so
   the pass is bound by its fmas, not by its loads. */
#ifdef MLS_SIMD
static inline __attribute__((always_inline)) void mqa_scores_n(const float *const *rw, const int R, const float *ql,
                                                               int64_t ql_head, const float *qp, int64_t qp_head,
                                                               int64_t r, int64_t dr, const int n, float *s,
                                                               int64_t ls) {
    int64_t k0 = 0, e0 = 0;
#ifdef MLS_AVX512
    __m512 z[2][MQA_HS];
    for (int t = 0; t < R; t++)
        for (int i = 0; i < n; i++) z[t][i] = _mm512_setzero_ps();
    for (; k0 + 16 <= r; k0 += 16) {
        __m512 v[2];
        for (int t = 0; t < R; t++) v[t] = _mm512_loadu_ps(rw[t] + k0);
        for (int i = 0; i < n; i++) {
            const __m512 q = _mm512_loadu_ps(ql + i * ql_head + k0);
            for (int t = 0; t < R; t++) z[t][i] = _mm512_fmadd_ps(v[t], q, z[t][i]);
        }
    }
    for (; e0 + 16 <= dr; e0 += 16) {
        __m512 v[2];
        for (int t = 0; t < R; t++) v[t] = _mm512_loadu_ps(rw[t] + r + e0);
        for (int i = 0; i < n; i++) {
            const __m512 q = _mm512_loadu_ps(qp + i * qp_head + e0);
            for (int t = 0; t < R; t++) z[t][i] = _mm512_fmadd_ps(v[t], q, z[t][i]);
        }
    }
#endif
    for (int t = 0; t < R; t++) {
        const float *row = rw[t];
        __m256 a[MQA_HS];
        float tail[MQA_HS];
        for (int i = 0; i < n; i++) a[i] = _mm256_setzero_ps(), tail[i] = 0.0f;
        int64_t k = k0, e = e0;
        for (; k + 8 <= r; k += 8) {
            const __m256 v = _mm256_loadu_ps(row + k);
            for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(v, _mm256_loadu_ps(ql + i * ql_head + k), a[i]);
        }
        for (; k < r; k++)
            for (int i = 0; i < n; i++) tail[i] += row[k] * ql[i * ql_head + k];
        for (; e + 8 <= dr; e += 8) {
            const __m256 v = _mm256_loadu_ps(row + r + e);
            for (int i = 0; i < n; i++) a[i] = _mm256_fmadd_ps(v, _mm256_loadu_ps(qp + i * qp_head + e), a[i]);
        }
        for (; e < dr; e++)
            for (int i = 0; i < n; i++) tail[i] += row[r + e] * qp[i * qp_head + e];
#ifdef MLS_AVX512
        for (int i = 0; i < n; i++)
            a[i] = _mm256_add_ps(a[i], _mm256_add_ps(_mm512_castps512_ps256(z[t][i]), _mm512_extractf32x8_ps(z[t][i], 1)));
#endif
        for (int i = 0; i < n; i++) s[i * ls + t] = hsum8(a[i]) + tail[i];
    }
}
#endif

/* the scores of rows rw[0 .. R) (R 1 or 2) for n heads, as mqa_scores_n */
static inline void mqa_scores(const float *const *rw, int R, const float *ql, int64_t ql_head, const float *qp,
                              int64_t qp_head, int64_t r, int64_t dr, int n, float *s, int64_t ls) {
#ifdef MLS_SIMD
    /* constant counts per call: the accumulators stay in registers for a remainder block too (20 heads over 2
       threads leave blocks of 8 and 2) */
#define MQA_SCORES_R(N)                                                                                              \
    (R == 2 ? mqa_scores_n(rw, 2, ql, ql_head, qp, qp_head, r, dr, N, s, ls)                                          \
            : mqa_scores_n(rw, 1, ql, ql_head, qp, qp_head, r, dr, N, s, ls))
    switch (n) {
    case 8: MQA_SCORES_R(8); break;
    case 4: MQA_SCORES_R(4); break;
    case 2: MQA_SCORES_R(2); break;
    default: MQA_SCORES_R(n);
    }
#undef MQA_SCORES_R
#else
    for (int t = 0; t < R; t++)
        for (int i = 0; i < n; i++)
            s[i * ls + t] = dot(rw[t], ql + i * ql_head, r) + dot(rw[t] + r, qp + i * qp_head, dr);
#endif
}

/* o[i * r + k] (+)= sum_j p[i * lp + j] rows[j][k] for n <= MQA_HO heads, j over rows [j0, j1) in order; `acc`
   continues the sums already in o (a later tile of rows), so the result is the same sequential sum over j. Each
   output is one fma chain over j (vector lanes or fmaf alike: one rounding per step), so every head count takes
   the vector loop: a remainder of 1-3 heads (10 heads per thread leave 2) once summed each value in a scalar
   loop that read the rows with a stride, ~2.5x the whole step at 4K context on 20 heads. */
#ifdef MLS_SIMD
static inline __attribute__((always_inline)) int64_t mqa_outputs_n(const float *const *rows, int64_t j0, int64_t j1,
                                                                   const float *p, int64_t lp, const int n, int64_t r,
                                                                   int acc, float *o) {
    int64_t k = 0;
#ifdef MLS_AVX512
    for (; k + 32 <= r; k += 32) { /* 32 values per slice where the build has 16 lanes: the same chains */
        __m512 a[MQA_HO][2];
        for (int i = 0; i < n; i++) {
            a[i][0] = acc ? _mm512_loadu_ps(o + i * r + k) : _mm512_setzero_ps();
            a[i][1] = acc ? _mm512_loadu_ps(o + i * r + k + 16) : _mm512_setzero_ps();
        }
        for (int64_t j = j0; j < j1; j++) {
            const __m512 v0 = _mm512_loadu_ps(rows[j] + k), v1 = _mm512_loadu_ps(rows[j] + k + 16);
            for (int i = 0; i < n; i++) {
                const __m512 pv = _mm512_set1_ps(p[i * lp + j]);
                a[i][0] = _mm512_fmadd_ps(pv, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(pv, v1, a[i][1]);
            }
        }
        for (int i = 0; i < n; i++) {
            _mm512_storeu_ps(o + i * r + k, a[i][0]);
            _mm512_storeu_ps(o + i * r + k + 16, a[i][1]);
        }
    }
#endif
    for (; k + 16 <= r; k += 16) {
        __m256 a[MQA_HO][2];
        for (int i = 0; i < n; i++) {
            a[i][0] = acc ? _mm256_loadu_ps(o + i * r + k) : _mm256_setzero_ps();
            a[i][1] = acc ? _mm256_loadu_ps(o + i * r + k + 8) : _mm256_setzero_ps();
        }
        for (int64_t j = j0; j < j1; j++) {
            const __m256 v0 = _mm256_loadu_ps(rows[j] + k), v1 = _mm256_loadu_ps(rows[j] + k + 8);
            for (int i = 0; i < n; i++) {
                const __m256 pv = _mm256_broadcast_ss(p + i * lp + j);
                a[i][0] = _mm256_fmadd_ps(pv, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(pv, v1, a[i][1]);
            }
        }
        for (int i = 0; i < n; i++) {
            _mm256_storeu_ps(o + i * r + k, a[i][0]);
            _mm256_storeu_ps(o + i * r + k + 8, a[i][1]);
        }
    }
    return k;
}
#endif

static inline void mqa_outputs(const float *const *rows, int64_t j0, int64_t j1, const float *p, int64_t lp, int n,
                               int64_t r, int acc, float *o) {
    int64_t k = 0;
#ifdef MLS_SIMD
    switch (n) { /* a constant count per call: the accumulators stay in registers */
#if MQA_HO == 8
    case 8: k = mqa_outputs_n(rows, j0, j1, p, lp, 8, r, acc, o); break;
    case 7: k = mqa_outputs_n(rows, j0, j1, p, lp, 7, r, acc, o); break;
    case 6: k = mqa_outputs_n(rows, j0, j1, p, lp, 6, r, acc, o); break;
    case 5: k = mqa_outputs_n(rows, j0, j1, p, lp, 5, r, acc, o); break;
#endif
    case 4: k = mqa_outputs_n(rows, j0, j1, p, lp, 4, r, acc, o); break;
    case 3: k = mqa_outputs_n(rows, j0, j1, p, lp, 3, r, acc, o); break;
    case 2: k = mqa_outputs_n(rows, j0, j1, p, lp, 2, r, acc, o); break;
    default: k = mqa_outputs_n(rows, j0, j1, p, lp, 1, r, acc, o);
    }
#endif
    for (int i = 0; i < n; i++)
        for (int64_t kk = k; kk < r; kk++) {
            float sum = acc ? o[i * r + kk] : 0.0f;
            for (int64_t j = j0; j < j1; j++) sum = fmaf(p[i * lp + j], rows[j][kk], sum);
            o[i * r + kk] = sum;
        }
}

/* One head's running softmax over a tile's scores sh[0 .. nt) (scaled here): m' = max(m, max_j sh[j]); on a later
   tile (first == 0) the outputs so far o[0 .. r) and the sum are multiplied by exp(m - m') when the max moved;
   sh[j] = exp(sh[j] - m') (the weights of this tile's rows), sum += their sum in order. */
static inline void mqa_softmax_step(float *sh, int64_t nt, float scale, int first, float *m, float *sum, float *o,
                                    int64_t r) {
    float mt = -INFINITY, ts = 0.0f;
    for (int64_t j = 0; j < nt; j++) sh[j] *= scale;
    for (int64_t j = 0; j < nt; j++) mt = sh[j] > mt ? sh[j] : mt;
    const float m1 = first || mt > *m ? mt : *m;
    if (!first && m1 != *m) {
        const float alpha = expf(*m - m1);
        for (int64_t k = 0; k < r; k++) o[k] *= alpha;
        *sum *= alpha;
    }
    for (int64_t j = 0; j < nt; j++) ts += (sh[j] = expf(sh[j] - m1));
    *sum = first ? ts : *sum + ts;
    *m = m1;
}

/* ---------------------------------------------------------------- a tile of cache rows, fp32 or coded
   The driver below loads each tile of allowed rows into a per-thread fp32 buffer: fp32 rows copied, a cache
   kept as 8-bit codes (cache/quantized_rows.py: codes [S, r] int8 or e4m3fn bit patterns when fp8, scales
   [S, r / block] fp32, kept [S, dr] fp32 k_pe; a quarter of the fp32 rows' bytes) decoded, value =
   (float)code * scale (one rounding, as the torch dequantizer), 16-bit rows widened. Everything after the load
   is the same code, so over the same decoded rows the fp32, 8-bit and 16-bit readers agree bit for bit. */
/* y[k] = E4M3[q[k]] * s for k < n, bit for bit, 8 codes at a time: a code's 7 exponent-and-mantissa bits
   shifted to the top of an fp32's mantissa (bits 20..26) and its sign to bit 31 read as 2^-120 times the e4m3
   value (a normal code as a normal fp32, a subnormal one as an fp32 subnormal), so a product by 2^120 (exact)
   gives the value; the NaN codes (0x7F, 0xFF) are blended in. The table lookup this replaces is a scalar
   load per value: profiled at L = 32K the top-k over FP8 keys spent as long decoding as scoring. */
static inline void e4m3_scaled(const uint8_t *q, float s, int64_t n, float *y) {
    int64_t k = 0;
#ifdef MLS_SIMD
    const __m256i low7 = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32(0x80);
    const __m256 pow120 = _mm256_set1_ps(0x1p120f), sv = _mm256_set1_ps(s), nan = _mm256_set1_ps(NAN);
    for (; k + 8 <= n; k += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + k)));
        const __m256i em = _mm256_and_si256(b, low7);
        const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(em, 20), _mm256_slli_epi32(_mm256_and_si256(b, sign), 24));
        __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), pow120);
        v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, low7)));
        _mm256_storeu_ps(y + k, _mm256_mul_ps(v, sv));
    }
#endif
    for (; k < n; k++) y[k] = E4M3[q[k]] * s;
}

static inline void row8_decode(const uint8_t *codes, const float *sc, const float *kept, int fp8, int64_t r,
                               int64_t dr, int64_t block, float *y) {
    for (int64_t c0 = 0, blk = 0; c0 < r; c0 += block, blk++) {
        const float s = sc[blk];
        const uint8_t *q = codes + c0;
        float *o = y + c0;
        if (fp8)
            e4m3_scaled(q, s, block, o);
        else
            for (int64_t k = 0; k < block; k++) o[k] = (float)(int8_t)q[k] * s;
    }
    memcpy(y + r, kept, sizeof(float) * (size_t)dr);
}

/* A cache's stored rows for the decoding MQA below: fp32 rows [S, r + dr] (rows32), 8-bit codes (int8 or e4m3,
   scales, kept k_pe) or 16-bit values (half = HALF_F16 / HALF_BF16, codes then [S, r + dr] 16-bit values;
   rows16.c). */
typedef struct {
    const float *rows32;
    const uint8_t *codes;
    const float *scales, *kept;
    int fp8, half;
    int64_t block;
} coded_rows;

/* cache row `slot` -> y [r + dr] fp32 (an fp32 row copied as it is) */
static inline void coded_decode(const coded_rows *cr, int64_t slot, int64_t r, int64_t dr, float *y) {
    if (cr->rows32) {
        memcpy(y, cr->rows32 + slot * (r + dr), sizeof(float) * (size_t)(r + dr));
        return;
    }
    if (cr->half) {
        row16_decode((const uint16_t *)cr->codes + slot * (r + dr), cr->half, r + dr, y);
        return;
    }
    const int64_t nb = r / cr->block;
    row8_decode(cr->codes + slot * r, cr->scales + slot * nb, cr->kept + slot * dr, cr->fp8, r, dr, cr->block, y);
}

/* ---------------------------------------------------------------- the driver: online softmax, tile by tile
   One work item is one query and a group of heads [h0, h1) (the heads are split when there are fewer queries than
   threads). Its allowed rows (mask) are compacted in order and taken MQA_TILE at a time: the tile is loaded once
   (tile_load) and both products read it from L2. Per head the softmax is the running one of flash attention:
   scores of the tile -> its max m_t; m' = max(m, m_t); the outputs so far and the running sum are multiplied by
   alpha = exp(m - m') (only when the max moved), p_j = exp(s_j - m'), sum += sum_j p_j, o += sum_j p_j row_j[:r];
   at the end o / sum. The tiles start at the first allowed row whatever the threads or the grouping, so a head's
   result is the same for every thread count, head grouping and batch.
   Why one pass: the exact two-pass softmax read every row twice (scores, then P c after the softmax), and the
   second pass, one 64-byte line of each of 128 rows at a time, missed the hardware prefetcher: at 4K rows per
   layer, with the weights streamed between layers evicting the rows from the last-level cache, the attention
   of a 16-head layer took 12.5 ms of CPU per call (DeepSeek-V3-shaped Q8_0 file, 2 threads), 7.6 of it in the
   output pass. */
static int latent_mqa_rows(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                           int64_t qp_head, const int64_t *q_index, const coded_rows *cr, const int64_t *slots,
                           const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                           float scale, float *out, int threads) {
    const int64_t c = r + dr, queries = b * nq;
    if (queries <= 0 || h <= 0) return 0;
    int64_t splits = queries >= threads ? 1 : (threads + queries - 1) / queries;
    if (splits > h) splits = h;
    const int64_t hg = (h + splits - 1) / splits, items = queries * splits;
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: the allowed rows' slots, a loaded tile and its rows' addresses, the tile's scores [hg,
           MQA_TILE], each head's running max and sum */
        int64_t *ok = (int64_t *)malloc(sizeof(int64_t) * (size_t)l + 1);
        float *tile = (float *)malloc(sizeof(float) * (size_t)(MQA_TILE * c) + 1);
        const float **rows = (const float **)malloc(sizeof(float *) * MQA_TILE);
        float *s = (float *)malloc(sizeof(float) * (size_t)(hg * MQA_TILE) + 1);
        float *run = (float *)malloc(sizeof(float) * (size_t)(2 * hg) + 1);
        if (!ok || !tile || !rows || !s || !run) {
#pragma omp atomic write
            rc = -4;
        }
        for (int64_t j = 0; j < MQA_TILE && rows; j++) rows[j] = tile + j * c;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!ok || !tile || !rows || !s || !run) continue;
            const int64_t qi = it / splits, h0 = (it % splits) * hg, h1 = h0 + hg < h ? h0 + hg : h;
            const uint8_t *m = mask + qi * l;
            const int64_t *sl = slots + (qi / nq) * l;
            const float *ql = q_lat + q_index[qi] * ql_tok, *qp = q_pe + q_index[qi] * qp_tok;
            float *o = out + qi * h * r, *mx = run, *sum = run + hg;
            int64_t n_ok = 0;
            for (int64_t j = 0; j < l; j++)
                if (m[j]) ok[n_ok++] = sl[j];
            if (n_ok == 0) {
                for (int64_t k = h0 * r; k < h1 * r; k++) o[k] = NAN;
                continue;
            }
            for (int64_t j0 = 0; j0 < n_ok; j0 += MQA_TILE) {
                const int64_t nt = j0 + MQA_TILE < n_ok ? MQA_TILE : n_ok - j0;
                for (int64_t j = 0; j < nt; j++) coded_decode(cr, ok[j0 + j], r, dr, tile + j * c);
                for (int64_t hb = h0; hb < h1; hb += MQA_HS) {
                    const int n = h1 - hb < MQA_HS ? (int)(h1 - hb) : MQA_HS;
                    for (int64_t j = 0; j < nt; j += 2)
                        mqa_scores(rows + j, j + 1 < nt ? 2 : 1, ql + hb * ql_head, ql_head, qp + hb * qp_head,
                                   qp_head, r, dr, n, s + (hb - h0) * MQA_TILE + j, MQA_TILE);
                }
                for (int64_t i = 0; i < h1 - h0; i++)
                    mqa_softmax_step(s + i * MQA_TILE, nt, scale, j0 == 0, &mx[i], &sum[i], o + (h0 + i) * r, r);
                for (int64_t hb = h0; hb < h1; hb += MQA_HO) {
                    const int n = h1 - hb < MQA_HO ? (int)(h1 - hb) : MQA_HO;
                    mqa_outputs(rows, 0, nt, s + (hb - h0) * MQA_TILE, MQA_TILE, n, r, j0 > 0, o + hb * r);
                }
            }
            for (int64_t i = 0; i < h1 - h0; i++)
                for (int64_t k = 0; k < r; k++) o[(h0 + i) * r + k] /= sum[i];
        }
        free(ok);
        free(tile);
        free((void *)rows);
        free(s);
        free(run);
    }
    return rc;
}

int mls_latent_mqa(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                   int64_t qp_head, const int64_t *q_index, const float *cache, const int64_t *slots,
                   const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                   float scale, float *out, int threads) {
    const coded_rows cr = {cache, NULL, NULL, NULL, 0, 0, 0};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, out, threads);
}

int mls_latent_mqa8(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                    int64_t qp_head, const int64_t *q_index, const uint8_t *codes, const float *scales,
                    const float *kept, int fp8, int64_t block, const int64_t *slots, const uint8_t *mask, int64_t b,
                    int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr, float scale, float *out, int threads) {
    if (block <= 0 || r % block) return -1;
    if (fp8 && !e4m3_ready) e4m3_init();
    const coded_rows cr = {NULL, codes, scales, kept, fp8, 0, block};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, out, threads);
}

/* mls_latent_mqa over rows kept in 16 bits (rows16.c): rows [S, r + dr] float16 (half 1) or bfloat16 (half 2),
   read where they lie (half the fp32 rows' bytes) and widened a tile at a time: over the same widened rows equal
   to mls_latent_mqa bit for bit. */
int mls_latent_mqa16(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                     int64_t qp_head, const int64_t *q_index, const uint16_t *rows, int half, const int64_t *slots,
                     const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                     float scale, float *out, int threads) {
    if (half != HALF_F16 && half != HALF_BF16) return -1;
    const coded_rows cr = {NULL, (const uint8_t *)rows, NULL, NULL, 0, half, 0};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, out, threads);
}

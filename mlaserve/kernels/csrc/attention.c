/* ---------------------------------------------------------------- latent MQA over paged rows (absorbed path)
   Each query is a token t = q_index[query] of the step: per head hh its [q_lat | q_pe] (q_lat = q_nope W_UK,
   c = r + dr values) is read where it lies, at q_lat + t * ql_tok + hh * ql_head and q_pe + t * qp_tok +
   hh * qp_head (no concatenated or gathered copy). Queries [B, Q] (q_index [B, Q]), cache [S, c] rows
   [c_kv | k_pe], slots [B, L] (cache row of each key position), mask [B, Q, L] (bool bytes) -> out
   [B, Q, H, r] = softmax_l(scale * q . row_l) @ row_l[:r]. Rows are read where they are; each work item is
   one query and a group of heads. Attention over one shared row is compute-bound (every head reads it), so
   both products are register-blocked over heads: a row's 8-value slice (16 with AVX-512, two rows at a time),
   loaded once, is multiplied into MQA_HS heads' scores, and P c into MQA_HO heads x 16 outputs (8 heads x 32
   with AVX-512; a row slice is loaded once per MQA_HO heads instead of once per head, the accumulators stay in
   registers across the tile's rows). The softmax is taken a
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

/* One head's softmax over one tile's scores sh[0 .. nt) (scaled here): its max m_t, sh[j] = exp(sh[j] - m_t) (the
   weights of the tile's rows), their sum l_t in order. */
static inline void mqa_tile_softmax(float *sh, int64_t nt, float scale, float *m_t, float *l_t) {
    float mt = -INFINITY, ts = 0.0f;
    for (int64_t j = 0; j < nt; j++) sh[j] *= scale;
    for (int64_t j = 0; j < nt; j++) mt = sh[j] > mt ? sh[j] : mt;
    for (int64_t j = 0; j < nt; j++) ts += (sh[j] = expf(sh[j] - mt));
    *m_t = mt;
    *l_t = ts;
}

/* One head's running result (o [r], max m, sum l) takes the next tile's partial (o_t [r], m_t, l_t): the first
   is copied; then M = max(m, m_t), o = o exp(m - M) + o_t exp(m_t - M), l likewise. */
static inline void mqa_fold(float *o, const float *o_t, int64_t r, int first, float *m, float *l, float m_t,
                            float l_t) {
    if (first) {
        memcpy(o, o_t, sizeof(float) * (size_t)r);
        *m = m_t;
        *l = l_t;
        return;
    }
    const float mm = m_t > *m ? m_t : *m, a = expf(*m - mm), b = expf(m_t - mm);
    for (int64_t k = 0; k < r; k++) o[k] = o[k] * a + o_t[k] * b;
    *l = *l * a + l_t * b;
    *m = mm;
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
   rows16.c), or fp32 rows wherever they lie, slot s at the address at[s] (mls_sink_mqa_parts). */
typedef struct {
    const float *rows32;
    const uint8_t *codes;
    const float *scales, *kept;
    int fp8, half;
    int64_t block;
    const float *const *at;
} coded_rows;

/* cache row `slot` -> y [r + dr] fp32 (an fp32 row copied as it is) */
static inline void coded_decode(const coded_rows *cr, int64_t slot, int64_t r, int64_t dr, float *y) {
    if (cr->at) {
        memcpy(y, cr->at[slot], sizeof(float) * (size_t)(r + dr));
        return;
    }
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

/* ---------------------------------------------------------------- the driver: tile partials, folded in order
   A query's allowed rows (mask) are compacted in order and cut into tiles of MQA_TILE from the first. For a tile
   and a head: the tile is loaded once (coded_decode) and both products read it from L2; the tile's partial is
   its scores' max m_t, the weights exp(s - m_t), their sum l_t and o_t = their weighted sum of the rows' first r
   values (mqa_tile_softmax, mqa_outputs). The head's result folds the partials in tile order (mqa_fold: the
   recurrence of flash attention) and divides by the sum at the end.
   Two ways to share the work, with the same operations per head, so a head's result is the same bit for bit
   whatever the threads, the batch or the grouping (test_latent_mqa_kernel):
   - by heads: each item is a query and a group of heads (the heads split when queries < threads) and runs its
     tiles in order, folding each partial as it comes;
   - by tiles, when there are fewer queries than threads and their partials fit MQA_PARTS_BYTES: each item is
     one tile of one query with a group of MQA_HG heads, its partial kept; the folds follow, per query and head,
     in order. The items go to the threads in contiguous runs of about equal cost (rows x heads: mqa_shares), a
     tile's groups mostly on one thread, which reads its rows once from memory and again from L2. Whole tiles
     per item split a 129-256-row context 128 : 1-128 over two threads (one batch-1 decode step's attention
     ~25% longer on average than an even split, 12-layer model at 128-540 context, 2-core AMD EPYC).
   Why tiles: the exact two-pass softmax read every row twice (scores, then P c after the softmax), the second
   pass one 64-byte line of each of 128 rows at a time, which the hardware prefetcher does not follow: at 4K rows
   per layer, with the weights streamed between layers evicting the rows from the last-level cache, a 16-head
   layer's attention took 11.6-12.5 ms of CPU per call (DeepSeek-V3-shaped Q8_0 file, 2 threads). */
#define MQA_PARTS_BYTES ((int64_t)64 << 20)
#define MQA_HG 4 /* heads per by-tiles item (a remainder group may hold fewer) */

typedef struct {
    const float *ql, *qp;
    int64_t ql_head, qp_head, r, dr;
    float scale;
} mqa_query;

/* the partial of one tile (rows[0 .. nt), loaded) for heads [h0, h1): o_t [h1 - h0, r], m_t / l_t [h1 - h0];
   s: scores scratch [h1 - h0, MQA_TILE] */
static void mqa_tile_partial(const mqa_query *q, const float *const *rows, int64_t nt, int64_t h0, int64_t h1,
                             float *s, float *o_t, float *m_t, float *l_t) {
    const int64_t r = q->r;
    for (int64_t hb = h0; hb < h1; hb += MQA_HS) {
        const int n = h1 - hb < MQA_HS ? (int)(h1 - hb) : MQA_HS;
        for (int64_t j = 0; j < nt; j += 2)
            mqa_scores(rows + j, j + 1 < nt ? 2 : 1, q->ql + hb * q->ql_head, q->ql_head, q->qp + hb * q->qp_head,
                       q->qp_head, r, q->dr, n, s + (hb - h0) * MQA_TILE + j, MQA_TILE);
    }
    for (int64_t i = 0; i < h1 - h0; i++) mqa_tile_softmax(s + i * MQA_TILE, nt, q->scale, &m_t[i], &l_t[i]);
    for (int64_t hb = h0; hb < h1; hb += MQA_HO) {
        const int n = h1 - hb < MQA_HO ? (int)(h1 - hb) : MQA_HO;
        mqa_outputs(rows, 0, nt, s + (hb - h0) * MQA_TILE, MQA_TILE, n, r, 0, o_t + (hb - h0) * r);
    }
}

/* the allowed rows' slots of query qi, in order -> their count */
static inline int64_t mqa_allowed(const uint8_t *m, const int64_t *sl, int64_t l, int64_t *ok) {
    int64_t n = 0;
    for (int64_t j = 0; j < l; j++)
        if (m[j]) ok[n++] = sl[j];
    return n;
}

/* by tiles: item it = (tile it / groups, heads of group it % groups); its cost = the tile's rows x the group's heads.
   lo[k] .. lo[k + 1] are part k's items (k < parts): item it goes to the part that holds the middle of its cost in
   the running total, so each part's cost is within one item of total / parts. */
static void mqa_shares(const int64_t *first, const int64_t *n_all, int64_t queries, int64_t groups, int64_t h,
                       int64_t parts, int64_t *lo) {
    int64_t total = 0, acc = 0, k = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t qi = 0, it = 0; qi < queries; qi++)
            for (int64_t t = first[qi]; t < first[qi + 1]; t++) {
                const int64_t rest = n_all[qi] - (t - first[qi]) * MQA_TILE, nt = rest < MQA_TILE ? rest : MQA_TILE;
                for (int64_t gi = 0; gi < groups; gi++, it++) {
                    const int64_t nh = h - gi * MQA_HG < MQA_HG ? h - gi * MQA_HG : MQA_HG, c = nt * nh;
                    if (pass == 0) {
                        total += c;
                        continue;
                    }
                    const int64_t own = (2 * acc + c) * parts / (2 * total); /* < parts: 2 acc + c < 2 total */
                    while (k < own) lo[++k] = it;
                    acc += c;
                }
            }
    }
    lo[0] = 0;
    while (k < parts) lo[++k] = first[queries] * groups;
}

/* A call's constants (latent_mqa_rows' arguments and its plan) and a thread's scratch: the allowed rows' slots, a
   decoded tile (coded rows only) and its rows' addresses, scores [hg, MQA_TILE], a tile's partial [hg, r + 2] and
   the running max and sum [2 hg] */
typedef struct {
    const float *q_lat, *q_pe;
    int64_t ql_tok, ql_head, qp_tok, qp_head;
    const int64_t *q_index;
    const coded_rows *cr;
    const int64_t *slots;
    const uint8_t *mask;
    int64_t nq, l, h, r, dr;
    float scale;
    float *out;
    const int64_t *first, *allowed, *n_all; /* by tiles (else NULL): each query's first tile, allowed rows, counts */
    float *parts;                           /* by tiles: the tiles' partials [tiles, h, r + 2] */
    int64_t splits, groups, hg;
    const float *sinks; /* [h] each head's sink logit (joins the softmax's sum only), or NULL */
    int at_index;       /* 1: query qi writes row q_index[qi] of out, a negative q_index (a pad slot) is skipped;
                           0: it writes row qi */
} mqa_job;

/* query qi's output row, or -1 where it is a pad slot (at_index) */
static inline int64_t mqa_out_row(const mqa_job *J, int64_t qi) { return J->at_index ? J->q_index[qi] : qi; }

typedef struct {
    int64_t *ok;
    float *tile;
    const float **rows;
    float *s, *part;
} mqa_scratch;

/* rows[0 .. nt) = the addresses of allowed rows j0 .. j0 + nt: fp32 rows where they lie, coded ones decoded */
static void mqa_load_tile(const mqa_job *J, const mqa_scratch *S, const int64_t *rows_ok, int64_t j0, int64_t nt) {
    const coded_rows *cr = J->cr;
    const int64_t c = J->r + J->dr;
    for (int64_t j = 0; j < nt; j++) {
        if (cr->at) {
            S->rows[j] = cr->at[rows_ok[j0 + j]];
            continue;
        }
        if (cr->rows32) {
            S->rows[j] = cr->rows32 + rows_ok[j0 + j] * c;
            continue;
        }
        coded_decode(cr, rows_ok[j0 + j], J->r, J->dr, S->tile + j * c);
        S->rows[j] = S->tile + j * c;
    }
}

/* head hh's softmax denominator: the allowed rows' sum l of exp(s - m) (m their running max), plus exp(sink_hh - m)
   where the call has sinks (DeepSeek-V4: a per-head logit that joins the sum and takes no row) */
static inline float mqa_total(const mqa_job *J, int64_t hh, float m, float l) {
    return J->sinks ? l + expf(J->sinks[hh] - m) : l;
}

/* item it: by tiles, one tile of one query for one group of heads (its partial kept in J->parts); by heads, one
   query and a group of heads over all its tiles, folded as they come and normalised */
static void mqa_item(const mqa_job *J, int64_t it, const mqa_scratch *S) {
    const int64_t h = J->h, r = J->r, hg = J->hg, tt = it / J->groups;
    int64_t qi = it / J->splits, t0 = 0;
    if (J->first) { /* the query whose tiles hold item `it`'s tile */
        qi = 0;
        while (J->first[qi + 1] <= tt) qi++;
        t0 = tt - J->first[qi];
    }
    const int64_t row = mqa_out_row(J, qi);
    if (row < 0) return; /* a pad slot: nothing read, nothing written */
    const int64_t h0 = J->first ? (it % J->groups) * MQA_HG : (it % J->splits) * hg;
    const int64_t h1 = h0 + hg < h ? h0 + hg : h, nh = h1 - h0;
    const mqa_query q = {J->q_lat + J->q_index[qi] * J->ql_tok, J->q_pe + J->q_index[qi] * J->qp_tok, J->ql_head,
                         J->qp_head, r, J->dr, J->scale};
    float *o = J->out + row * h * r, *mx = S->part + hg * (r + 2), *sum = mx + hg;
    const int64_t *rows_ok = J->first ? J->allowed + qi * J->l : S->ok;
    const int64_t n_ok = J->first ? J->n_all[qi]
                                  : mqa_allowed(J->mask + qi * J->l, J->slots + (qi / J->nq) * J->l, J->l, S->ok);
    if (n_ok == 0) { /* no allowed row: NaN, or with sinks all weight on the sink (zeros) */
        for (int64_t k = h0 * r; k < h1 * r; k++) o[k] = J->sinks ? 0.0f : NAN;
        return;
    }
    for (int64_t j0 = J->first ? t0 * MQA_TILE : 0; j0 < n_ok; j0 += MQA_TILE) {
        const int64_t nt = j0 + MQA_TILE < n_ok ? MQA_TILE : n_ok - j0;
        mqa_load_tile(J, S, rows_ok, j0, nt);
        if (J->first) { /* this tile's partial for heads h0 .. h1, kept: [h, r] outputs, [h] maxes, [h] sums */
            float *pt = J->parts + tt * h * (r + 2);
            mqa_tile_partial(&q, S->rows, nt, h0, h1, S->s, pt + h0 * r, pt + h * r + h0, pt + h * (r + 1) + h0);
            return;
        }
        float *m_t = S->part + nh * r, *l_t = m_t + nh;
        mqa_tile_partial(&q, S->rows, nt, h0, h1, S->s, S->part, m_t, l_t);
        for (int64_t i = 0; i < nh; i++)
            mqa_fold(o + (h0 + i) * r, S->part + i * r, r, j0 == 0, &mx[i], &sum[i], m_t[i], l_t[i]);
    }
    for (int64_t i = 0; i < nh; i++) {
        const float l = mqa_total(J, h0 + i, mx[i], sum[i]);
        for (int64_t k = 0; k < r; k++) o[(h0 + i) * r + k] /= l;
    }
}

/* by tiles: query qh / h's head qh % h folds its tiles' partials in order */
static void mqa_fold_tiles(const mqa_job *J, int64_t qh) {
    const int64_t h = J->h, r = J->r, qi = qh / h, hh = qh % h, t1 = J->first[qi + 1], row = mqa_out_row(J, qi);
    if (row < 0) return;
    float *o = J->out + row * h * r + hh * r, m = 0.0f, sum = 0.0f;
    if (J->first[qi] == t1) { /* no allowed row (no tile, no item above): as mqa_item */
        for (int64_t k = 0; k < r; k++) o[k] = J->sinks ? 0.0f : NAN;
        return;
    }
    for (int64_t t = J->first[qi]; t < t1; t++) {
        const float *pt = J->parts + t * h * (r + 2);
        mqa_fold(o, pt + hh * r, r, t == J->first[qi], &m, &sum, pt[h * r + hh], pt[h * (r + 1) + hh]);
    }
    const float l = mqa_total(J, hh, m, sum);
    for (int64_t k = 0; k < r; k++) o[k] /= l;
}

/* by tiles (fewer queries than threads, partials within MQA_PARTS_BYTES): each query's allowed rows' slots
   compacted once (allowed [queries, l], counts n_all, first [queries + 1] tiles); *tiles their total, or 0 where the
   call goes by heads. Returns 0, -4 out of memory. */
static int mqa_by_tiles(const uint8_t *mask, const int64_t *slots, int64_t queries, int64_t nq, int64_t l, int64_t h,
                        int64_t r, int threads, int64_t **first, int64_t **allowed, int64_t **n_all, int64_t *tiles) {
    *first = *allowed = *n_all = NULL, *tiles = 0;
    if (queries >= threads) return 0;
    int64_t *f = (int64_t *)malloc(sizeof(int64_t) * (size_t)(queries + 1));
    int64_t *a = (int64_t *)malloc(sizeof(int64_t) * (size_t)(queries * l) + 1);
    int64_t *n = (int64_t *)malloc(sizeof(int64_t) * (size_t)queries);
    if (!f || !a || !n) {
        free(f), free(a), free(n);
        return -4;
    }
    int64_t t = 0;
    for (int64_t qi = 0; qi < queries; qi++) {
        n[qi] = mqa_allowed(mask + qi * l, slots + (qi / nq) * l, l, a + qi * l);
        f[qi] = t;
        t += (n[qi] + MQA_TILE - 1) / MQA_TILE;
    }
    f[queries] = t;
    if (t < 2 || t * h * (r + 2) * (int64_t)sizeof(float) > MQA_PARTS_BYTES) {
        free(f), free(a), free(n);
        return 0;
    }
    *first = f, *allowed = a, *n_all = n, *tiles = t;
    return 0;
}

static int latent_mqa_rows(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                           int64_t qp_head, const int64_t *q_index, const coded_rows *cr, const int64_t *slots,
                           const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                           float scale, const float *sinks, int at_index, float *out, int threads) {
    const int64_t c = r + dr, queries = b * nq;
    if (queries <= 0 || h <= 0) return 0;
    int64_t *first, *allowed, *n_all, tiles;
    if (mqa_by_tiles(mask, slots, queries, nq, l, h, r, threads, &first, &allowed, &n_all, &tiles) != 0) return -4;
    float *parts = first ? (float *)malloc(sizeof(float) * (size_t)(tiles * h * (r + 2))) : NULL;
    int64_t splits = first || queries >= threads ? 1 : (threads + queries - 1) / queries;
    if (splits > h) splits = h;
    const int64_t groups = (h + MQA_HG - 1) / MQA_HG, hg = first ? MQA_HG : (h + splits - 1) / splits;
    const int64_t items = first ? tiles * groups : queries * splits;
    /* part k of `threads` takes items lo[k] .. lo[k + 1]: by tiles of equal cost, else of equal count */
    int64_t *lo = (int64_t *)malloc(sizeof(int64_t) * (size_t)(threads + 1));
    if (!lo || (first && !parts)) {
        free(first), free(allowed), free(n_all), free(parts), free(lo);
        return -4;
    }
    if (first)
        mqa_shares(first, n_all, queries, groups, h, threads, lo);
    else
        for (int64_t k = 0; k <= threads; k++) lo[k] = items * k / threads;
    const mqa_job J = {q_lat, q_pe, ql_tok, ql_head, qp_tok, qp_head, q_index, cr, slots, mask, nq, l, h, r, dr,
                       scale, out, first, allowed, n_all, parts, splits, groups, hg, sinks, at_index};
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        const mqa_scratch S = {
            (int64_t *)malloc(sizeof(int64_t) * (size_t)l + 1),
            (float *)malloc(sizeof(float) * (size_t)(cr->rows32 || cr->at ? 1 : MQA_TILE * c) + 1),
            (const float **)malloc(sizeof(float *) * MQA_TILE),
            (float *)malloc(sizeof(float) * (size_t)(hg * MQA_TILE) + 1),
            (float *)malloc(sizeof(float) * (size_t)(hg * (r + 2) + 2 * hg) + 1),
        };
        const int fits = S.ok && S.tile && S.rows && S.s && S.part;
        if (!fits) {
#pragma omp atomic write
            rc = -4;
        }
#pragma omp for schedule(static, 1)
        for (int64_t share = 0; share < threads; share++)
            for (int64_t it = lo[share]; fits && it < lo[share + 1]; it++) mqa_item(&J, it, &S);
        if (first) {
#pragma omp for schedule(static)
            for (int64_t qh = 0; qh < queries * h; qh++) mqa_fold_tiles(&J, qh);
        }
        free(S.ok);
        free(S.tile);
        free((void *)S.rows);
        free(S.s);
        free(S.part);
    }
    free(first);
    free(allowed);
    free(n_all);
    free(parts);
    free(lo);
    return rc;
}

int mls_latent_mqa(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                   int64_t qp_head, const int64_t *q_index, const float *cache, const int64_t *slots,
                   const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                   float scale, float *out, int threads) {
    const coded_rows cr = {cache, NULL, NULL, NULL, 0, 0, 0, NULL};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, NULL, 0, out, threads);
}

int mls_latent_mqa8(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                    int64_t qp_head, const int64_t *q_index, const uint8_t *codes, const float *scales,
                    const float *kept, int fp8, int64_t block, const int64_t *slots, const uint8_t *mask, int64_t b,
                    int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr, float scale, float *out, int threads) {
    if (block <= 0 || r % block) return -1;
    if (fp8 && !e4m3_ready) e4m3_init();
    const coded_rows cr = {NULL, codes, scales, kept, fp8, 0, block, NULL};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, NULL, 0, out, threads);
}

/* mls_latent_mqa over rows kept in 16 bits (rows16.c): rows [S, r + dr] float16 (half 1) or bfloat16 (half 2),
   read where they lie (half the fp32 rows' bytes) and widened a tile at a time: over the same widened rows equal
   to mls_latent_mqa bit for bit. */
int mls_latent_mqa16(const float *q_lat, int64_t ql_tok, int64_t ql_head, const float *q_pe, int64_t qp_tok,
                     int64_t qp_head, const int64_t *q_index, const uint16_t *rows, int half, const int64_t *slots,
                     const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t r, int64_t dr,
                     float scale, float *out, int threads) {
    if (half != HALF_F16 && half != HALF_BF16) return -1;
    const coded_rows cr = {NULL, (const uint8_t *)rows, NULL, NULL, 0, half, 0, NULL};
    return latent_mqa_rows(q_lat, ql_tok, ql_head, q_pe, qp_tok, qp_head, q_index, &cr, slots, mask, b, nq, l, h, r,
                           dr, scale, NULL, 0, out, threads);
}

/* DeepSeek-V4's attention (models/deepseek_v4/attention.py): every head's query q [d] against one shared K=V row
   per key (the rows are the values too, all d of them: r = d, no separate rope part) with a per-head sink logit in
   the softmax's sum, so out = sum_j exp(s_j - m) row_j / (sum_j exp(s_j - m) + exp(sink - m)); a query with no
   allowed row gives zeros (all weight on its sink), as the torch form's padded rows. Query (b, i) reads row
   q_index[b, i] of q [T, h, d] and writes the same row of out [T, h, d]; a negative q_index is a pad slot of the
   step's [B, Q] layout (nothing read, nothing written), so the step's rows need no padded copy either way. Same
   driver, tiles and threads as mls_latent_mqa (a head's result does not depend on them). */
int mls_sink_mqa(const float *q, int64_t q_tok, int64_t q_head, const int64_t *q_index, const float *rows,
                 const int64_t *slots, const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t d,
                 float scale, const float *sinks, float *out, int threads) {
    if (!sinks) return -1;
    const coded_rows cr = {rows, NULL, NULL, NULL, 0, 0, 0, NULL};
    return latent_mqa_rows(q, q_tok, q_head, q, q_tok, 0, q_index, &cr, slots, mask, b, nq, l, h, d, 0, scale, sinks,
                           1, out, threads);
}

/* mls_sink_mqa over keys read where they lie: key j of sequence b is row part_row[b, j] = (p, row) of the
   [rows[p], d] fp32 matrix at bases[p] (DeepSeek-V4's ring cache, the step's K=V rows, the paged pool, the rows
   the step closed, a zero row: step_keys.py LayerKeys.direct), where mls_gather_rows first copied every key into
   [B, K, d] (at a 1K-token decode ~0.1 ms a layer, a 2-core AMX Xeon). The same rows in the same order, so the
   same bits. -> 0, mls_sink_mqa's codes, -2 a part outside [0, n_parts), -3 a row outside its part (nothing
   read), -4 memory. */
int mls_sink_mqa_parts(const float *q, int64_t q_tok, int64_t q_head, const int64_t *q_index,
                       const float *const *bases, const int64_t *rows, int64_t n_parts, const int64_t *part_row,
                       const uint8_t *mask, int64_t b, int64_t nq, int64_t l, int64_t h, int64_t d, float scale,
                       const float *sinks, float *out, int threads) {
    if (!sinks) return -1;
    const int64_t n = b * l;
    const float **at = (const float **)malloc(sizeof(float *) * (size_t)n + 1);
    int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)n + 1);
    int rc = at && slots ? 0 : -4;
    for (int64_t i = 0; !rc && i < n; i++) {
        const int64_t p = part_row[2 * i], r = part_row[2 * i + 1];
        if (p < 0 || p >= n_parts) rc = -2;
        else if (r < 0 || r >= rows[p]) rc = -3;
        else at[i] = bases[p] + r * d, slots[i] = i;
    }
    if (!rc) {
        const coded_rows cr = {NULL, NULL, NULL, NULL, 0, 0, 0, at};
        rc = latent_mqa_rows(q, q_tok, q_head, q, q_tok, 0, q_index, &cr, slots, mask, b, nq, l, h, d, 0, scale, sinks,
                             1, out, threads);
    }
    free((void *)at);
    free(slots);
    return rc;
}

/* ---------------------------------------------------------------- the DSA indexer of a decode step
   DeepSeek Sparse Attention's lightning indexer for T tokens of one query each (models/indexer.py is the
   reference; attention/backends/torch_index.py the per-op scoring and top-k).
     Hi index heads, Di index_head_dim, dr the rope slice at the head of each row ([rope | pass])
     q     [T, Hi, Di]  wq_b(c_q), its first dr values roped (rotated in place by the caller's rope_slice)
     key   [T, Di]      LayerNorm(wk(xn)) with weight and bias, first dr roped: index_keys[slots[t]]
     w     [T, Hi]      weights_proj(xn) * Hi^-0.5 * Di^-0.5 (two fp32 products, as the per-op path's)
     keys  [S, Di]      the layer's index-key cache; kv_slots [T, L] / mask [T, L] the step's key axis
   score(t, j) = sum_h w[t, h] ReLU(q[t, h] . keys[kv_slots[t, j]]) over the allowed positions j, and the top
   K (the caller's min(index_topk, L)): the K best allowed positions in position order, or, when a request has
   at most K allowed positions, every one of them followed by disallowed positions marked invalid (what the
   per-op path's top-k over -inf scores keeps: a position it never attends).
   Ties at the K-th score: the earlier positions are kept (torch's topk leaves the choice unspecified; with
   fp32 scores summed over >= 8 heads exact ties do not occur in practice).
   bf16 scores (the route's index_scoring "bf16", a lossy choice: config/index_scores.py): q and every key rounded
   to bf16 (to nearest even) before the dot products, which are summed in fp32, as are the weighted ReLUs.
   On AVX512-BF16 the products run as vdpbf16ps over pairs of values (index_scores_pairs: half the instructions
   of the fp32 fmas, each product exact in fp32, bf16 subnormals read as zero), elsewhere as the fp32 path over
   the rounded values (index_key's round16): the same selection up to fp32 summation order. */

/* the K-th largest of a[0..n) (1 <= K <= n); reorders a. Hoare partitions around a median of three. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        const float p = x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: [lo, j] >= p, [i, hi] <= p, between them == p */
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                const float tmp = a[i];
                a[i++] = a[j];
                a[j--] = tmp;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return a[want];
    }
    return a[lo];
}

/* x [Di] -> y: torch's LayerNorm (mean, biased variance, (x - mean) rstd * weight + bias) up to the rounding of its
   sums (torch accumulates the moments in another order) */
static void layer_norm_row(const float *x, int64_t d, const float *w, const float *b, float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t i = 0; i < d; i++) mean += x[i];
    mean /= (float)d;
    for (int64_t i = 0; i < d; i++) var += (x[i] - mean) * (x[i] - mean);
    var /= (float)d;
    const float rstd = 1.0f / sqrtf(var + eps), shift = -rstd * mean;
    for (int64_t i = 0; i < d; i++) y[i] = (x[i] * rstd + shift) * w[i] + b[i];
}

/* k [T, Di] (wk's output rows) -> normed and roped into keys[slots[t]]; q [T, Hi, Di] roped in place;
   w [T, Hi] scaled by Hi^-0.5 then Di^-0.5. cos / sin [T, dr / 2]. */
static void index_keys_write(float *k, float *q, float *w, int64_t t, int64_t hi, int64_t di, int64_t dr,
                             const float *nw, const float *nb, float eps, float w_scale, float d_scale,
                             const float *cos, const float *sin, int interleaved, float *keys, const int64_t *slots) {
    for (int64_t tok = 0; tok < t; tok++) {
        const float *ci = cos + tok * (dr / 2), *si = sin + tok * (dr / 2);
        float *row = keys + slots[tok] * di;
        layer_norm_row(k + tok * di, di, nw, nb, eps, row);
        rope_slice(row, dr, ci, si, interleaved);
        for (int64_t h = 0; h < hi; h++) {
            rope_slice(q + (tok * hi + h) * di, dr, ci, si, interleaved);
            w[tok * hi + h] = (w[tok * hi + h] * w_scale) * d_scale;
        }
    }
}

/* The top-k over keys kept as FP8 e4m3 codes with one fp32 scale per key (kv_cache_dtype; codes8 [S, Di] e4m3fn
   bit patterns, scales8 [S]) when codes8 is not NULL (keys then unused): each key is decoded where it lies,
   value = E4M3[code] * scale (one rounding, as the torch dequantizer), into a per-position buffer and scored as
   an fp32 key is: the result equals the fp32 path's over the dequantized keys. */
static int index_topk(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const float *keys,
                      const uint8_t *codes8, const float *scales8, int half, const int64_t *kv_slots,
                      const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index, uint8_t *sel_valid, int bf16,
                      int threads);

int mls_index_topk(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const float *keys,
                   const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index,
                   uint8_t *sel_valid, int bf16, int threads) {
    if (bf16 && di > 1024) return -3; /* the rounded key's stack buffer */
    return index_topk(q, w, t, hi, di, keys, NULL, NULL, 0, kv_slots, mask, l, k, sel_index, sel_valid, bf16,
                      threads);
}

int mls_index_topk8(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const uint8_t *codes,
                    const float *scales, const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k,
                    int64_t *sel_index, uint8_t *sel_valid, int bf16, int threads) {
    if (di > 1024) return -3; /* the decoded key's stack buffer */
    if (!e4m3_ready) e4m3_init();
    return index_topk(q, w, t, hi, di, NULL, codes, scales, 0, kv_slots, mask, l, k, sel_index, sel_valid, bf16,
                      threads);
}

/* The top-k over keys kept in 16 bits (rows16.c; keys16 [S, Di], half HALF_F16 / HALF_BF16), each widened where it
   lies: the result equals the fp32 path's over the widened keys. */
int mls_index_topk16(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const uint16_t *keys16,
                     int half, const int64_t *kv_slots, const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index,
                     uint8_t *sel_valid, int bf16, int threads) {
    if (di > 1024) return -3; /* the decoded key's stack buffer */
    if (half != HALF_F16 && half != HALF_BF16) return -2;
    return index_topk(q, w, t, hi, di, NULL, (const uint8_t *)keys16, NULL, half, kv_slots, mask, l, k, sel_index,
                      sel_valid, bf16, threads);
}

/* Where a layer's index keys lie: fp32 rows (keys), or codes8 with half (16-bit rows, rows16.c) or with scales8
   (FP8 e4m3 codes and a scale per key); round16: bf16 scores without AVX512-BF16, each key rounded to bf16 as
   it is read (index_key) */
typedef struct {
    const float *keys;
    const uint8_t *codes8;
    const float *scales8;
    int half;
    int round16;
    int64_t di;
} index_keys_t;

/* whether index_key writes into its buffer (an 8 / 16-bit cache's decoded key, or a rounded one) */
static inline int index_key_buffered(const index_keys_t *kc) { return kc->codes8 || kc->round16; }

/* x [n] rounded to bf16 (to nearest even, as torch's cast) and widened back: y [n] (y may be x) */
static inline void round_bf16(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

/* the key at slot `slot` as fp32: the cache's row itself, or (8 / 16-bit caches, round16) decoded or rounded into
   buf [Di] */
static inline const float *index_key(const index_keys_t *kc, int64_t slot, float *buf) {
    const int64_t di = kc->di;
    const float *key = buf;
    if (!kc->codes8)
        key = kc->keys + slot * di;
    else if (kc->half)
        row16_decode((const uint16_t *)kc->codes8 + slot * di, kc->half, di, buf);
    else
        e4m3_scaled(kc->codes8 + slot * di, kc->scales8[slot], di, buf);
    if (kc->round16) round_bf16(key, di, buf);
    return kc->round16 ? buf : key;
}

/* s[a] = score of the key at slot sl[pos[a]], a < n_ok, for one token (qt [Hi, Di], wt [Hi]): row by row, each
   key against MQA_HS heads at a time (mqa_scores), the weighted ReLUs summed in head order */
static void index_scores_rows(const index_keys_t *kc, const float *qt, const float *wt, int64_t hi,
                              const int64_t *sl, const int64_t *pos, int64_t n_ok, float *s, int threads) {
    const int64_t di = kc->di;
#pragma omp parallel for num_threads(threads) schedule(static) if (n_ok >= 512)
    for (int64_t a = 0; a < n_ok; a++) {
        float decoded[index_key_buffered(kc) ? di : 1];
        const float *key = index_key(kc, sl[pos[a]], decoded);
        float hs[MQA_HS], sum = 0.0f;
        for (int64_t hb = 0; hb < hi; hb += MQA_HS) {
            const int n = hi - hb < MQA_HS ? (int)(hi - hb) : MQA_HS;
            mqa_scores(&key, 1, qt + hb * di, di, qt + hb * di, di, di, 0, n, hs, 1);
            for (int i = 0; i < n; i++) sum += wt[hb + i] * (hs[i] < 0.0f ? 0.0f : hs[i]); /* NaN stays NaN */
        }
        s[a] = sum;
    }
}

#ifdef MLS_AVX512
/* The scores of nk keys at a time (index_keys_per_pass), with the heads along the vector lanes: qt [Di, hp] is the token's
   queries transposed (hp = Hi rounded up to 16, the padding heads' queries and weights zero), and for each d one
   broadcast of each key's d-th value times the row qt[d] accumulates every head's dot product at once: no
   per-(key, head) horizontal sum (the row scorer spent ~600 cycles per key of 32 heads x 128 on those sums and on
   loading the queries once per fma; this is ~2 fmas per 16 multiply-adds, the fma bound).
   Each head's dot product is one fma chain over d (a different summation order from mqa_scores': scores agree to
   fp32 rounding, not bit for bit; the selection is held to torch's in tests/kernels/test_decode_layer_sparse.py).
   score = sum_h w[h] ReLU(dot_h), summed in the lanes then across them. kr: the nk keys in fp32 (the cache's rows,
   or rows of the 8 / 16-bit caches decoded by index_key); n <= nk of them are scored into s[0 .. n). */
#define INDEX_KEYS 8 /* keys per pass at most: 8 up to 32 heads (16 accumulators), 4 above (index_keys_per_pass) */
#define INDEX_LANES 4 /* hp <= 64 */
/* keys per pass of the lane scorers for hp heads: as many as keep the accumulators (keys x hp / 16) within 16 of
   the 32 vector registers (8 keys for up to 32 heads: one query row's loads serve 8 keys' fmas; 4 keys took a
   16K-key top-k of 32 heads x 128 0.9-1.6 ms, 8 keys 0.72-0.87, alternated on a 2-core AMD EPYC) */
static inline int64_t index_keys_per_pass(int64_t hp) { return hp <= 32 ? 8 : 4; }

/* s[j] = sum_h w[h] ReLU(acc[j][h]), j < n: each key's head sums (c groups of 16 lanes) weighted, then across lanes.
   ReLU as max(0, x): vmaxps returns its second operand where either is NaN, so a NaN head sum stays NaN (torch's
   relu), where max(x, 0) would make it 0 and hide a NaN key or query from the selection */
static inline __attribute__((always_inline)) void weighted_relu_sums(__m512 acc[INDEX_KEYS][INDEX_LANES],
                                                                     const float *wpad, int64_t n, float *s,
                                                                     const int c) {
    for (int j = 0; j < n; j++) {
        __m512 sum = _mm512_setzero_ps();
        for (int h = 0; h < c; h++)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(wpad + 16 * h), _mm512_max_ps(_mm512_setzero_ps(), acc[j][h]), sum);
        s[j] = _mm512_reduce_add_ps(sum);
    }
}

static inline __attribute__((always_inline)) void lanes_c(const float *qt, const float *wpad, int64_t hp, int64_t di,
                                                          const float *const kr[INDEX_KEYS], int64_t n, float *s,
                                                          const int c, const int nk) {
    __m512 acc[INDEX_KEYS][INDEX_LANES];
    for (int j = 0; j < nk; j++)
        for (int h = 0; h < c; h++) acc[j][h] = _mm512_setzero_ps();
    for (int64_t d = 0; d < di; d++) {
        const float *row = qt + d * hp;
        for (int h = 0; h < c; h++) {
            const __m512 qv = _mm512_loadu_ps(row + 16 * h);
            for (int j = 0; j < nk; j++) acc[j][h] = _mm512_fmadd_ps(_mm512_set1_ps(kr[j][d]), qv, acc[j][h]);
        }
    }
    weighted_relu_sums(acc, wpad, n, s, c);
}

/* c = hp / 16 and nk constants at each call, so the accumulators stay in registers (with c known only at run time
   they lived in memory: a 16K-key top-k of 32 heads x 128 took 1.9-2.1 ms instead of 0.9-1.3 on a 2-core AMD EPYC) */
static void index_scores_lanes(const float *qt, const float *wpad, int64_t hp, int64_t di,
                               const float *const kr[INDEX_KEYS], int64_t n, float *s) {
    switch (hp / 16) {
    case 1: lanes_c(qt, wpad, hp, di, kr, n, s, 1, index_keys_per_pass(16)); break;
    case 2: lanes_c(qt, wpad, hp, di, kr, n, s, 2, index_keys_per_pass(32)); break;
    case 3: lanes_c(qt, wpad, hp, di, kr, n, s, 3, index_keys_per_pass(48)); break;
    default: lanes_c(qt, wpad, hp, di, kr, n, s, 4, index_keys_per_pass(64)); break;
    }
}

/* index_scores_rows' s, nk keys per pass with the heads along the lanes. qtr [Di * hp + hp]: room for the
   token's queries transposed and its weights (zero beyond Hi) */
static void index_scores_by_lanes(const index_keys_t *kc, const float *qt, const float *wt, int64_t hi, int64_t hp,
                                  float *qtr, const int64_t *sl, const int64_t *pos, int64_t n_ok, float *s,
                                  int threads) {
    const int64_t di = kc->di, nk = index_keys_per_pass(hp), blocks = (n_ok + nk - 1) / nk;
    float *wpad = qtr + di * hp;
    for (int64_t h = 0; h < hi; h++) {
        wpad[h] = wt[h];
        for (int64_t d = 0; d < di; d++) qtr[d * hp + h] = qt[h * di + d];
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (n_ok >= 512)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t a0 = b * nk, n = n_ok - a0 < nk ? n_ok - a0 : nk;
        const int buffered = index_key_buffered(kc);
        float buf[buffered ? nk * di : 1];
        const float *kr[INDEX_KEYS];
        for (int j = 0; j < nk; j++) /* a short block repeats its last key (not stored) */
            kr[j] = j < n ? index_key(kc, sl[pos[a0 + j]], buf + (buffered ? j * di : 0)) : kr[n - 1];
        index_scores_lanes(qtr, wpad, hp, di, kr, n, s + a0);
    }
}
#endif

#ifdef MLS_BF16_DOT
/* index_scores_lanes in bf16: qp [Di / 2, hp] the token's queries as bf16 pairs (q[h, 2p] in the low half,
   q[h, 2p + 1] in the high, the padding heads zero), kp the nk keys as bf16 pairs [Di / 2]; per pair one broadcast
   of each key's pair times the row qp[p] (vdpbf16ps: every head's two products added to its fp32 sum at once, half
   the instructions of the fp32 fmas). c = hp / 16 a constant at each call (index_scores_pairs' switch), so the
   accumulators stay in registers. */
static inline __attribute__((always_inline)) void pairs_lanes(const uint32_t *qp, const float *wpad, int64_t hp,
                                                              int64_t di, const uint32_t *const kp[INDEX_KEYS],
                                                              int64_t n, float *s, const int c, const int nk) {
    __m512 acc[INDEX_KEYS][INDEX_LANES];
    for (int j = 0; j < nk; j++)
        for (int h = 0; h < c; h++) acc[j][h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < di / 2; p++) {
        const uint32_t *row = qp + p * hp;
        for (int h = 0; h < c; h++) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(row + 16 * h);
            for (int j = 0; j < nk; j++)
                acc[j][h] = _mm512_dpbf16_ps(acc[j][h], (__m512bh)_mm512_set1_epi32((int)kp[j][p]), qv);
        }
    }
    weighted_relu_sums(acc, wpad, n, s, c);
}

static void index_scores_pairs(const uint32_t *qp, const float *wpad, int64_t hp, int64_t di,
                               const uint32_t *const kp[INDEX_KEYS], int64_t n, float *s) {
    switch (hp / 16) {
    case 1: pairs_lanes(qp, wpad, hp, di, kp, n, s, 1, index_keys_per_pass(16)); break;
    case 2: pairs_lanes(qp, wpad, hp, di, kp, n, s, 2, index_keys_per_pass(32)); break;
    case 3: pairs_lanes(qp, wpad, hp, di, kp, n, s, 3, index_keys_per_pass(48)); break;
    default: pairs_lanes(qp, wpad, hp, di, kp, n, s, 4, index_keys_per_pass(64)); break;
    }
}

/* the key at slot `slot` as bf16 pairs [Di / 2]: a bf16 cache's row itself, else the fp32 key (index_key: the row,
   or an 8 / 16-bit one decoded into fbuf) rounded to nearest even into hbuf by vcvtne2ps2bf16 (fp32 subnormals
   read as zero, as vdpbf16ps reads bf16 ones). Di a multiple of 32. */
static inline const uint32_t *index_key_pairs(const index_keys_t *kc, int64_t slot, float *fbuf, uint16_t *hbuf) {
    const int64_t di = kc->di;
    if (kc->codes8 && kc->half == HALF_BF16) return (const uint32_t *)((const uint16_t *)kc->codes8 + slot * di);
    const float *key = index_key(kc, slot, fbuf);
    for (int64_t i = 0; i < di; i += 32) {
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(key + i + 16), _mm512_loadu_ps(key + i));
        _mm512_storeu_si512(hbuf + i, (__m512i)h);
    }
    return (const uint32_t *)hbuf;
}

/* index_scores_by_lanes in bf16 (kc->round16 0: the keys are rounded here). qtr [Di / 2 * hp] room for the token's
   query pairs, wpad [hp] for its weights. */
static void index_scores_by_pairs(const index_keys_t *kc, const float *qt, const float *wt, int64_t hi, int64_t hp,
                                  uint32_t *qtr, float *wpad, const int64_t *sl, const int64_t *pos, int64_t n_ok,
                                  float *s, int threads) {
    const int64_t di = kc->di, nk = index_keys_per_pass(hp), blocks = (n_ok + nk - 1) / nk;
    for (int64_t h = 0; h < hi; h++) {
        wpad[h] = wt[h];
        for (int64_t p = 0; p < di / 2; p++)
            qtr[p * hp + h] = (uint32_t)f32_to_bf16(qt[h * di + 2 * p]) |
                              (uint32_t)f32_to_bf16(qt[h * di + 2 * p + 1]) << 16;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (n_ok >= 512)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t a0 = b * nk, n = n_ok - a0 < nk ? n_ok - a0 : nk;
        float fbuf[kc->codes8 ? di : 1];
        uint16_t hbuf[nk * di];
        const uint32_t *kp[INDEX_KEYS];
        for (int j = 0; j < nk; j++) /* a short block repeats its last key (not stored) */
            kp[j] = j < n ? index_key_pairs(kc, sl[pos[a0 + j]], fbuf, hbuf + j * di) : kp[n - 1];
        index_scores_pairs(qtr, wpad, hp, di, kp, n, s + a0);
    }
}
#endif

/* idx / val [K]: the K best of the n_ok scored positions (s [n_ok], positions pos) in position order; ties at the
   K-th score keep the earliest. tmp [n_ok]: scratch. */
static void select_top_k(const float *s, float *tmp, const int64_t *pos, int64_t n_ok, int64_t k, int64_t *idx,
                         uint8_t *val) {
    memcpy(tmp, s, sizeof(float) * (size_t)n_ok);
    const float thr = kth_largest(tmp, n_ok, k);
    int64_t above = 0, c = 0;
    for (int64_t a = 0; a < n_ok; a++) above += s[a] > thr;
    int64_t ties = k - above; /* positions scoring exactly thr that fit: the earliest */
    for (int64_t a = 0; a < n_ok; a++) {
        const int take = s[a] > thr || (s[a] == thr && ties > 0);
        if (take) {
            ties -= s[a] == thr;
            idx[c] = pos[a], val[c++] = 1;
        }
    }
}

/* how a token's scores run: the bf16 pairs (AVX512-BF16), the fp32 lanes (AVX-512, up to 64 heads), or rows */
enum { SCORE_ROWS, SCORE_LANES, SCORE_PAIRS };

/* a call's scratch: the token's transposed queries (fp32 lanes or bf16 pairs) and its padded weights, the scores
   and the allowed positions; and without AVX512-BF16, bf16 scores' rounded queries (qround [Hi Di]) */
typedef struct {
    float *qtr, *wpad, *s, *qround;
    int64_t *pos;
} index_scratch_t;

static int index_scratch(int how, int bf16, int64_t hi, int64_t hp, int64_t di, int64_t l, index_scratch_t *sc) {
    const size_t tr = how == SCORE_ROWS ? 0 : (size_t)(di * hp + hp); /* the pairs take half of di * hp */
    sc->qtr = tr ? (float *)calloc(tr, sizeof(float)) : NULL;
    sc->wpad = sc->qtr ? sc->qtr + di * hp : NULL;
    sc->qround = bf16 && how != SCORE_PAIRS ? (float *)malloc(sizeof(float) * (size_t)(hi * di)) : NULL;
    sc->s = (float *)malloc(sizeof(float) * (size_t)(2 * l) + 1);
    sc->pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)l + 1);
    return (tr && !sc->qtr) || (bf16 && how != SCORE_PAIRS && !sc->qround) || !sc->s || !sc->pos ? -4 : 0;
}

static void index_scratch_free(index_scratch_t *sc) {
    free(sc->qtr);
    free(sc->qround);
    free(sc->s);
    free(sc->pos);
}

/* s [n_ok]: one token's scores of the allowed positions pos, by the chosen way */
static void index_scores(int how, const index_keys_t *kc, const float *qt, const float *wt, int64_t hi, int64_t hp,
                         index_scratch_t *sc, const int64_t *sl, int64_t n_ok, int threads) {
#ifdef MLS_BF16_DOT
    if (how == SCORE_PAIRS) {
        index_scores_by_pairs(kc, qt, wt, hi, hp, (uint32_t *)sc->qtr, sc->wpad, sl, sc->pos, n_ok, sc->s, threads);
        return;
    }
#endif
    if (kc->round16) { /* bf16 scores on the fp32 kernels: the query rounded here, each key as index_key reads it */
        round_bf16(qt, hi * kc->di, sc->qround);
        qt = sc->qround;
    }
#ifdef MLS_AVX512
    if (how == SCORE_LANES) {
        index_scores_by_lanes(kc, qt, wt, hi, hp, sc->qtr, sl, sc->pos, n_ok, sc->s, threads);
        return;
    }
#endif
    index_scores_rows(kc, qt, wt, hi, sl, sc->pos, n_ok, sc->s, threads);
}

static int index_topk(const float *q, const float *w, int64_t t, int64_t hi, int64_t di, const float *keys,
                      const uint8_t *codes8, const float *scales8, int half, const int64_t *kv_slots,
                      const uint8_t *mask, int64_t l, int64_t k, int64_t *sel_index, uint8_t *sel_valid, int bf16,
                      int threads) {
    if (k <= 0 || k > l) return -2;
    const int64_t hp = (hi + 15) / 16 * 16; /* up to 64 heads: the lane scorers */
    int how = SCORE_ROWS;
#ifdef MLS_AVX512
    if (hp <= 16 * INDEX_LANES) how = SCORE_LANES;
#endif
#ifdef MLS_BF16_DOT
    if (bf16 && how == SCORE_LANES && di % 32 == 0) how = SCORE_PAIRS;
#endif
    const index_keys_t kc = {keys, codes8, scales8, half, bf16 && how != SCORE_PAIRS, di};
    index_scratch_t sc;
    if (index_scratch(how, bf16, hi, hp, di, l, &sc)) {
        index_scratch_free(&sc);
        return -4;
    }
    for (int64_t tok = 0; tok < t; tok++) {
        const uint8_t *m = mask + tok * l;
        const int64_t *sl = kv_slots + tok * l;
        int64_t *idx = sel_index + tok * k;
        uint8_t *val = sel_valid + tok * k;
        int64_t n_ok = 0;
        for (int64_t j = 0; j < l; j++)
            if (m[j]) sc.pos[n_ok++] = j;
        if (n_ok <= k) { /* every allowed position, then disallowed ones (never attended) up to K */
            int64_t c = 0;
            for (int64_t a = 0; a < n_ok; a++) idx[c] = sc.pos[a], val[c++] = 1;
            for (int64_t j = 0; j < l && c < k; j++)
                if (!m[j]) idx[c] = j, val[c++] = 0;
            continue;
        }
        index_scores(how, &kc, q + tok * hi * di, w + tok * hi, hi, hp, &sc, sl, n_ok, threads);
        for (int64_t a = 0; a < n_ok; a++) /* a NaN score ranks first, as torch's topk ranks it: the selection stays */
            if (sc.s[a] != sc.s[a]) sc.s[a] = INFINITY; /* K positions in range, the NaN reaches the output and its check */
        select_top_k(sc.s, sc.s + l, sc.pos, n_ok, k, idx, val);
    }
    index_scratch_free(&sc);
    return 0;
}

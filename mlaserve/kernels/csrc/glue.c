/* ---------------------------------------------------------------- decode-step glue
   Small per-layer operations that torch composes from several ops (each ~3-10 us of dispatch at one token):
   RMSNorm, and the latent row of a step (kv_a_layernorm, rope, cache write) with the query heads' rope; and the
   step's greedy pick with its NaN check (mls_argmax_rows). */

/* 1 / sqrt(mean(x^2) + eps): torch's fp32 rms_norm computes the same (pow, mean, add, rsqrt), summing the
   squares in another order (fp32 rounding). */
static float rms_inv(const float *x, int64_t d, float eps) {
    int64_t i = 0;
    float ss = 0.0f;
#ifdef MLS_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    ss = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < d; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)d + eps);
}

/* y = (x * inv) * w elementwise, in that order (torch: x * rsqrt(...), then * weight). */
static void scale_rows(const float *x, float inv, const float *w, int64_t d, float *y) {
    for (int64_t i = 0; i < d; i++) y[i] = (x[i] * inv) * w[i];
}

/* x [T, ldx] rows of d values -> y [T, ldy]: RMSNorm with weight w [d]. */
int mls_rms_norm(const float *x, int64_t t, int64_t d, int64_t ldx, const float *w, float eps, float *y,
                 int64_t ldy, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) scale_rows(x + i * ldx, rms_inv(x + i * ldx, d, eps), w, d, y + i * ldy);
    return 0;
}

/* Rotate one rope slice of dr values in place: pairs (x1_i, x2_i) = (x[2i], x[2i+1]) when interleaved, else
   (x[i], x[i + dr/2]); the result is [x1 cos - x2 sin | x2 cos + x1 sin] (de-interleaved), exactly the
   products and differences of models/layers.py apply_rope, so bit-identical to it. */
static void rope_slice(float *x, int64_t dr, const float *cos, const float *sin, int interleaved) {
    float tmp[MAX_ROPE];
    const int64_t half = dr / 2, step = interleaved ? 2 : 1, off = interleaved ? 1 : half;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i * step], x2 = x[i * step + off];
        tmp[i] = x1 * cos[i] - x2 * sin[i];
        tmp[half + i] = x2 * cos[i] + x1 * sin[i];
    }
    memcpy(x, tmp, sizeof(float) * (size_t)dr);
}

/* One step's latent rows and query rope, for T tokens:
     kv    [T, ldkv]  kv_a_proj_with_mqa's output rows [c_kv (r) | k_pe (dr)] (read only)
     q     [T, H, ldh] query heads, q_pe at column dn of each head: rotated in place
     cos, sin [T, dr/2]
   cache[slots[t]] (rows of ldc = r + dr, n_slots of them) = [rmsnorm(c_kv) * w | rope(k_pe)]. */
int mls_latent_rope_write(const float *kv, int64_t t, int64_t ldkv, int64_t r, int64_t dr, const float *w,
                          float eps, float *q, int64_t h, int64_t ldh, int64_t dn, const float *cos,
                          const float *sin, int interleaved, float *cache, int64_t n_slots,
                          const int64_t *slots, int threads) {
    if (dr > MAX_ROPE || dr % 2) return -2;
    for (int64_t i = 0; i < t; i++)
        if (slots[i] < 0 || slots[i] >= n_slots) return -5;
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) {
        const float *src = kv + i * ldkv, *ci = cos + i * (dr / 2), *si = sin + i * (dr / 2);
        float *row = cache + slots[i] * (r + dr);
        scale_rows(src, rms_inv(src, r, eps), w, r, row);
        memcpy(row + r, src + r, sizeof(float) * (size_t)dr);
        rope_slice(row + r, dr, ci, si, interleaved);
        for (int64_t hh = 0; hh < h; hh++) rope_slice(q + (i * h + hh) * ldh + dn, dr, ci, si, interleaved);
    }
    return 0;
}

/* row v's largest value and whether all of its n values are finite (*bad = 0), 8 lanes at a time: the maximum of
   finite values is exact in any order, so the lanes give the scalar loop's value (NaN fails the compare, so
   |v| <= FLT_MAX is false for NaN and Inf) */
static float row_max(const float *v, int64_t n, int *bad) {
    int64_t j = 0;
    float m = -FLT_MAX;
    int b = 0;
#ifdef MLS_SIMD
    if (n >= 8) {
        const __m256 big = _mm256_set1_ps(FLT_MAX), sign = _mm256_set1_ps(-0.0f);
        __m256 mv = _mm256_set1_ps(-FLT_MAX), ok = _mm256_cmp_ps(big, big, _CMP_EQ_OQ);
        for (; j + 8 <= n; j += 8) {
            const __m256 x = _mm256_loadu_ps(v + j);
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_andnot_ps(sign, x), big, _CMP_LE_OQ));
            mv = _mm256_max_ps(mv, x);
        }
        b = _mm256_movemask_ps(ok) != 0xFF;
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; j < n; j++) {
        b |= !(fabsf(v[j]) <= FLT_MAX);
        m = v[j] > m ? v[j] : m;
    }
    *bad = b;
    return m;
}

/* x [rows, n] (row i at x + i * ld) -> idx[i] = the first index of row i's largest value (torch.argmax's choice),
   finite[i] = 1 iff every value of row i is finite (idx[i] = 0 where not). One pass per row for both: a batch-1
   step's greedy token and the check that fails a request with NaN / Inf logits, which took torch a sum, an isfinite,
   an argmax and their copies out (the sum 85 us and the isfinite 62 at that point of a step, their code cold after
   the weights went through the caches; 12-layer Q4_K_M model, 2-core AMD EPYC). The rows are shared out over the
   threads: a 16-request step's 16 rows of 32,768 took 1.3 ms of a 52 ms step on one thread in a scalar loop, now 0.1
   ms (2-core AMX Xeon, 2 threads). */
int mls_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *idx, uint8_t *finite, int threads) {
    if (rows < 0 || n < 1) return -2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 2)
    for (int64_t i = 0; i < rows; i++) {
        const float *v = x + i * ld;
        int bad;
        const float m = row_max(v, n, &bad);
        int64_t at = 0;
        while (!bad && v[at] != m) at++; /* finite: m is some v[j], the first such j */
        idx[i] = bad ? 0 : at;
        finite[i] = (uint8_t)!bad;
    }
    return 0;
}

/* DeepSeek-V4's rope (models/deepseek_v4/rope.py rotate_trailing), in place: x [T, R, W] (R rows per token, e.g.
   heads), the trailing d values of each row as d / 2 interleaved pairs (x1, x2) = (x[W-d+2i], x[W-d+2i+1]) ->
   (x1 cos - x2 s, x2 cos + x1 s) with cos, sin [T, d / 2] and s = sign * sin (sign -1: the de-rotation). The
   reference's fp32 products and differences in its order (no fused multiply-add: -ffp-contract=off), so the same
   bits as rotate_trailing. 0, -1 d odd or above W. */
/* one row's trailing pairs (p [2 half]) rotated by cos, sign * sin [half] in place */
static void rope_pairs_row(float *p, const float *c, const float *s, int64_t half, float sign) {
    for (int64_t j = 0; j < half; j++) {
        const float x1 = p[2 * j], x2 = p[2 * j + 1], sj = sign * s[j];
        p[2 * j] = x1 * c[j] - x2 * sj;
        p[2 * j + 1] = x2 * c[j] + x1 * sj;
    }
}

int mls_rope_pairs(float *x, int64_t t, int64_t rows, int64_t w, int64_t d, const float *cos, const float *sin,
                   float sign, int threads) {
    if (d % 2 || d > w) return -1;
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (t * rows >= 256)
    for (int64_t i = 0; i < t * rows; i++)
        rope_pairs_row(x + i * w + (w - d), cos + (i / rows) * half, sin + (i / rows) * half, half, sign);
    return 0;
}

/* DeepSeek-V4's query heads and K=V rows of a step in place (models/deepseek_v4/attention.py): each row of w values
   of x [T, rows, w] RMS-normalised, x * inv without a weight (the query heads' unweighted norm), (x * inv) * g
   with one (the K=V row's kv_norm: mls_rms_norm's operations), then its trailing d values rotated as interleaved
   pairs by its token's cos, sin [T, d / 2] (mls_rope_pairs' operations). One call where torch composed ~8 ops
   and two more calls (the norm, the rope) for the query and two for the K=V row. -> 0, -1 d odd or wider than w. */
int mls_norm_rope_pairs(float *x, int64_t t, int64_t rows, int64_t w, const float *g, float eps, int64_t d,
                        const float *cos, const float *sin, int threads) {
    if (d % 2 || d > w) return -1;
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (t * rows >= 256)
    for (int64_t i = 0; i < t * rows; i++) {
        float *p = x + i * w;
        const float inv = rms_inv(p, w, eps);
        if (g)
            scale_rows(p, inv, g, w, p);
        else
            for (int64_t j = 0; j < w; j++) p[j] *= inv;
        rope_pairs_row(p + (w - d), cos + (i / rows) * half, sin + (i / rows) * half, half, 1.0f);
    }
    return 0;
}

/* Rows gathered from several tensors in one pass (DeepSeek-V4's keys of a step: models/deepseek_v4/attention.py):
   out[i] = row part_row[i][1] of part part_row[i][0], each part a [rows[p], d] fp32 matrix at bases[p] (the ring
   cache, the step's K=V rows, the paged pool, the rows the step closed, a zero row), read where they lie. The torch
   form gathers the rings, concatenates the parts, then gathers again (three copies of a ring row); here one.
   -> 0, -1 a part outside [0, n_parts), -2 a row outside its part (nothing is read from outside a part). */
int mls_gather_rows(const float *const *bases, const int64_t *rows, int64_t n_parts, const int64_t *part_row,
                    int64_t n, int64_t d, float *out, int threads) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = part_row[2 * i], r = part_row[2 * i + 1];
        if (p < 0 || p >= n_parts) return -1;
        if (r < 0 || r >= rows[p]) return -2;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= 65536)
    for (int64_t i = 0; i < n; i++)
        memcpy(out + i * d, bases[part_row[2 * i]] + part_row[2 * i + 1] * d, sizeof(float) * (size_t)d);
    return 0;
}

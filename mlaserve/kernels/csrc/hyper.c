/* ---------------------------------------------------------------- mHC: a hyper-connection's mixing weights
   DeepSeek-V4's and GLM-5.3-Flash's residual is N streams (models/deepseek_v4/hyper.py, whose notation this is);
   before each sublayer one HyperConnection turns the streams of every token into its mixing weights and the
   sublayer's input. At one token torch composes that from ~20 ops and a 20-iteration Sinkhorn loop (~0.3 ms a
   call on a 2-core AMX Xeon, 2 threads; 8 calls per step of a 4-layer model); here it is one call, the same
   operations per token in fp32:
     h [S, N, D]          the streams (read only)
     f = h_t / sqrt(mean(h_t^2) + eps_norm)     over the token's N*D values (unweighted RMSNorm)
     a = f fn^T           fn [(2+N)N, N*D]: a_pre [N], a_post [N], a_comb [N, N]
     pre  = sigmoid(a_pre scale_0 + base_pre) + eps
     post = 2 sigmoid(a_post scale_1 + base_post)                                 -> post [S, N]
     comb = softmax_row(a_comb scale_2 + base_comb) + eps, then Sinkhorn: columns, then (iters - 1) times rows
            and columns, each divided by (its sum + eps)                          -> comb [S, N, N]
     x = sum_j pre_j h_t,j                                                         -> x [S, D]
   The sums of N values run in index order, as the torch path's (its numpy Sinkhorn is bit for bit the torch
   reference's); the squares' sum and the dot products in another order than BLAS (fp32 rounding). */
#define HC_MAX 16 /* streams */

static inline float hc_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* c [n, n] row-major: softmax of each row, + eps, then the Sinkhorn iterations (hyper.py sinkhorn_reference) */
static void hc_comb(float *c, int64_t n, int iters, float eps) {
    for (int64_t i = 0; i < n; i++) {
        float *row = c + i * n, mx = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        for (int64_t j = 0; j < n; j++) sum += (row[j] = expf(row[j] - mx));
        for (int64_t j = 0; j < n; j++) row[j] = row[j] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) /* rows, from the second pass on */
            for (int64_t i = 0; i < n; i++) {
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) sum += c[i * n + j];
                for (int64_t j = 0; j < n; j++) c[i * n + j] /= sum + eps;
            }
        for (int64_t j = 0; j < n; j++) { /* columns */
            float sum = 0.0f;
            for (int64_t i = 0; i < n; i++) sum += c[i * n + j];
            for (int64_t i = 0; i < n; i++) c[i * n + j] /= sum + eps;
        }
    }
}

/* one token's weights and sublayer input from its mixing dot products a [(2+N)N]: post [N], comb [N, N], x [D] (the
   weighted sum of the streams in lanes over the values, each value's sum over j in index order) */
static void hc_token(const float *a, const float *ht, int64_t n, int64_t d, const float *base, const float *scale,
                     float eps, int iters, float *post, float *comb, float *x) {
    float pre[HC_MAX];
    for (int64_t j = 0; j < n; j++) {
        pre[j] = hc_sigmoid(a[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0f * hc_sigmoid(a[n + j] * scale[1] + base[n + j]);
    }
    for (int64_t i = 0; i < n * n; i++) comb[i] = a[2 * n + i] * scale[2] + base[2 * n + i];
    hc_comb(comb, n, iters, eps);
    for (int64_t k = 0; k < d; k++) x[k] = pre[0] * ht[k];
    for (int64_t j = 1; j < n; j++)
        for (int64_t k = 0; k < d; k++) x[k] += pre[j] * ht[j * d + k];
}

#define HC_CHUNK 64 /* tokens whose normed streams are held at once (64 N D floats) */

/* -> 0, -1 bad shape (n above HC_MAX, no Sinkhorn pass), -4 out of memory. The mixing dot products of a chunk of
   tokens are shared out over the threads as (token, row) items, so one token's 24 rows of fn (4 streams of 1024:
   393 KB read per call) stream through both threads at decode instead of one. */
int mls_hc_pre(const float *h, int64_t s, int64_t n, int64_t d, const float *fn, const float *base,
               const float *scale, float eps, float norm_eps, int iters, float *post, float *comb, float *x,
               int threads) {
    if (n < 1 || n > HC_MAX || iters < 1) return -1;
    const int64_t nd = n * d, m = (2 + n) * n, chunk = s < HC_CHUNK ? s : HC_CHUNK;
    float *f = (float *)malloc(sizeof(float) * (size_t)(chunk * nd + chunk * m + 1)), *a = f + chunk * nd;
    if (!f) return -4;
#pragma omp parallel num_threads(threads)
    for (int64_t t0 = 0; t0 < s; t0 += chunk) {
        const int64_t tc = s - t0 < chunk ? s - t0 : chunk;
        const float *hc = h + t0 * nd;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tc; t++) {
            const float inv = rms_inv(hc + t * nd, nd, norm_eps);
            for (int64_t k = 0; k < nd; k++) f[t * nd + k] = hc[t * nd + k] * inv;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < tc * m; it++) a[it] = dot(fn + (it % m) * nd, f + (it / m) * nd, nd);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tc; t++)
            hc_token(a + t * m, hc + t * nd, n, d, base, scale, eps, iters, post + (t0 + t) * n,
                     comb + (t0 + t) * n * n, x + (t0 + t) * d);
    }
    free(f);
    return 0;
}
#undef HC_CHUNK
/* The new streams after a sublayer (hyper.py expand): out[t, k] = post[t, k] y[t] + sum_j comb[t, j, k] h[t, j] for
   h [S, N, D], post [S, N], comb [S, N, N], y [S, D] -> out [S, N, D] (a new tensor). The sum over j in index order,
   then the product added, in fp32 (torch's matmul may sum in another order: fp32 rounding). At one token torch ran
   ~8 ops (the broadcast product, the batched matmul, the add). -> 0, -1 bad shape. */
int mls_hc_post(const float *h, int64_t s, int64_t n, int64_t d, const float *post, const float *comb, const float *y,
                float *out, int threads) {
    if (n < 1 || n > HC_MAX) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (s * n * d >= 65536)
    for (int64_t it = 0; it < s * n; it++) {
        const int64_t t = it / n, k = it % n;
        const float *ht = h + t * n * d, *yt = y + t * d, *c = comb + t * n * n, p = post[t * n + k];
        float *o = out + it * d; /* the same sums as a loop over j per value, in lanes over the values */
        for (int64_t i = 0; i < d; i++) o[i] = c[k] * ht[i];
        for (int64_t j = 1; j < n; j++) {
            const float cj = c[j * n + k], *hj = ht + j * d;
            for (int64_t i = 0; i < d; i++) o[i] += cj * hj[i];
        }
        for (int64_t i = 0; i < d; i++) o[i] = p * yt[i] + o[i];
    }
    return 0;
}
#undef HC_MAX

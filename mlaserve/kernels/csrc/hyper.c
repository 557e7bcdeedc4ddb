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

/* -> 0, -1 bad shape (n above HC_MAX, no Sinkhorn pass), -4 out of memory */
int mls_hc_pre(const float *h, int64_t s, int64_t n, int64_t d, const float *fn, const float *base,
               const float *scale, float eps, float norm_eps, int iters, float *post, float *comb, float *x,
               int threads) {
    if (n < 1 || n > HC_MAX || iters < 1) return -1;
    const int64_t nd = n * d, m = (2 + n) * n;
    int rc = 0;
#pragma omp parallel num_threads(threads) if (s >= 8)
    {
        float *f = (float *)malloc(sizeof(float) * (size_t)nd);
        if (!f) {
#pragma omp atomic write
            rc = -4;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < s; t++) {
            if (!f) continue;
            const float *ht = h + t * nd;
            const float inv = rms_inv(ht, nd, norm_eps);
            for (int64_t k = 0; k < nd; k++) f[k] = ht[k] * inv;
            float a[(2 + HC_MAX) * HC_MAX], pre[HC_MAX];
            for (int64_t i = 0; i < m; i++) a[i] = dot(fn + i * nd, f, nd);
            for (int64_t j = 0; j < n; j++) {
                pre[j] = hc_sigmoid(a[j] * scale[0] + base[j]) + eps;
                post[t * n + j] = 2.0f * hc_sigmoid(a[n + j] * scale[1] + base[n + j]);
            }
            float *c = comb + t * n * n;
            for (int64_t i = 0; i < n * n; i++) c[i] = a[2 * n + i] * scale[2] + base[2 * n + i];
            hc_comb(c, n, iters, eps);
            float *xt = x + t * d;
            for (int64_t k = 0; k < d; k++) {
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) sum += pre[j] * ht[j * d + k];
                xt[k] = sum;
            }
        }
        free(f);
    }
    return rc;
}
#undef HC_MAX

/* Routed experts of a decode step with few tokens, pair by pair (moe/route.c explains the arithmetic's bound). */

static inline float row_dot(row_fn fn, fused_fn fused, const uint8_t *w, const float *x, int64_t k, float *buf) {
    if (fused) {
        float y;
        fused(w, x, k, 1, k, &y, 1);
        return y;
    }
    fn(w, buf, k);
    return dot(buf, x, k);
}

/* Row r of expert e's gate rows then up rows (r < inter: gate row r; else up row r - inter): the two stacks of
   a layer lie where the file keeps them (GGUF ffn_gate_exps, ffn_up_exps), each expert at e * expert_stride. */
static inline const uint8_t *gate_up_row(const uint8_t *gate, const uint8_t *up, int64_t e, int64_t expert_stride,
                                         int64_t row_bytes, int64_t inter, int64_t r) {
    return r < inter ? gate + e * expert_stride + r * row_bytes : up + e * expert_stride + (r - inter) * row_bytes;
}

/* Routed experts for the (token, expert) pairs of a few tokens, unsorted: pair p = t * kk + j uses
   expert idx[p] with weight wt[p]. gate [E, I] and up [E, I] rows of gu_row_bytes (expert e at
   e * gu_expert_stride of each), down [E, D] rows of dn_row_bytes. out [T, D] = sum_j wt[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
   gate and up clamped at limit first (DeepSeek-V4's SwiGLU; INFINITY: no clamp, the same values as silu_mul).
   One parallel region: pairs x rows of gate_up, then silu * up, then output rows. */
int mls_moe_experts(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                    const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                    const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt, int64_t kk,
                    float limit, float *out, int threads) {
    row_fn fn_gu = ggml_row(type_gu), fn_dn = ggml_row(type_dn);
    if (!fn_gu || !fn_dn) return -1;
    if (d > MAX_K || inter > MAX_K) return -2;
    fused_fn fz_gu = fused_row(type_gu), fz_dn = fused_row(type_dn);
    const int64_t pairs = t * kk, n_gu = 2 * inter;
    float *gu = (float *)malloc(sizeof(float) * (size_t)(pairs * n_gu) + 1);
    float *h = (float *)malloc(sizeof(float) * (size_t)(pairs * inter) + 1);
    if (!gu || !h) {
        free(gu);
        free(h);
        return -4;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(d > inter ? d : inter));
        const int64_t runs = (n_gu + ROW_RUN - 1) / ROW_RUN;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * runs; it++) {
            const int64_t p = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_gu ? r0 + ROW_RUN : n_gu;
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *row = gate_up_row(gate, up, idx[p], gu_expert_stride, gu_row_bytes, inter, r);
                gu[p * n_gu + r] = row_dot(fn_gu, fz_gu, row, x + (p / kk) * d, d, buf);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * inter; it++) {
            const int64_t p = it / inter, i = it % inter;
            h[it] = silu_mul_clamped(gu[p * n_gu + i], gu[p * n_gu + inter + i], limit);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * d; it++) {
            const int64_t tok = it / d, r = it % d;
            float acc = 0.0f;
            for (int64_t j = 0; j < kk; j++) {
                const int64_t p = tok * kk + j;
                const uint8_t *row = down + idx[p] * dn_expert_stride + r * dn_row_bytes;
                acc += wt[p] * row_dot(fn_dn, fz_dn, row, h + p * inter, inter, buf);
            }
            out[it] = acc;
        }
        free(buf);
    }
    free(gu);
    free(h);
    return 0;
}

/* mls_moe_experts with int8 activations: x quantized before gate_up, h before down (each for its type). */
int mls_moe_experts_q8(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                       const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                       const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx, const float *wt,
                       int64_t kk, float limit, float *out, int threads) {
    q8rows_fn fn_gu = q8rows(type_gu), fn_dn = q8rows(type_dn);
    if (!fn_gu || !fn_dn) return -1;
    if (!act_fits(type_gu, d) || !act_fits(type_dn, inter)) return -2;
    const int64_t pairs = t * kk, n_gu = 2 * inter, runs = (n_gu + ROW_RUN - 1) / ROW_RUN;
    int8_t *xq = (int8_t *)malloc((size_t)(t * d) + 1), *hq = (int8_t *)malloc((size_t)(pairs * inter) + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(t * d / 32) + 1);
    float *hd = (float *)malloc(sizeof(float) * (size_t)(pairs * inter / 32) + 1);
    float *gu = (float *)malloc(sizeof(float) * (size_t)(pairs * n_gu) + 1);
    float *h = (float *)malloc(sizeof(float) * (size_t)(pairs * inter) + 1);
    int rc = 0;
    if (!xq || !hq || !xd || !hd || !gu || !h) {
        rc = -4;
        goto done;
    }
    quantize_act(type_gu, x, t, d, d, xq, xd);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * runs; it++) {
            const int64_t p = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n_gu ? r0 + ROW_RUN : n_gu;
            const int64_t tok = p / kk;
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *row = gate_up_row(gate, up, idx[p], gu_expert_stride, gu_row_bytes, inter, r);
                gu[p * n_gu + r] = q8dot(fn_gu, row, xq + tok * d, xd + tok * (d / 32), d);
            }
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * inter; it++) {
            const int64_t p = it / inter, i = it % inter;
            h[it] = silu_mul_clamped(gu[p * n_gu + i], gu[p * n_gu + inter + i], limit);
        }
#pragma omp single
        quantize_act(type_dn, h, pairs, inter, inter, hq, hd);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * d; it++) {
            const int64_t tok = it / d, r = it % d;
            float acc = 0.0f;
            for (int64_t j = 0; j < kk; j++) {
                const int64_t p = tok * kk + j;
                const uint8_t *row = down + idx[p] * dn_expert_stride + r * dn_row_bytes;
                acc += wt[p] * q8dot(fn_dn, row, hq + p * inter, hd + p * (inter / 32), inter);
            }
            out[it] = acc;
        }
    }
done:
    free(xq);
    free(hq);
    free(xd);
    free(hd);
    free(gu);
    free(h);
    return rc;
}

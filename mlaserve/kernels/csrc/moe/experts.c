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

/* mls_moe_experts with int16 activations (x86/int16_prefill.c: the 32-value block types qw_type takes, Q8_0 among
   them): x and h quantized per 32 values to int16 codes, each pair's gate and up rows and its down rows in runs of
   up to QW_R weight rows on qw_run, the rows read in place (the grouped int16 products' kernel and arithmetic, so a
   row's product has the bits it has there at one activation row), the outputs summed over a token's pairs in j
   order as above. The holders' settings give these to a type at every row count (int16_prefill.takes_rest), so
   this is the pair-by-pair form of the grouped products a larger step takes. 0, -1 a type without them (or a
   build without AVX512-VNNI), -2 D or I not a multiple of 32, -4 out of memory. */
int mls_moe_experts16(int type_gu, int type_dn, const float *x, int64_t t, int64_t d, int64_t inter,
                      const uint8_t *gate, const uint8_t *up, int64_t gu_expert_stride, int64_t gu_row_bytes,
                      const uint8_t *down, int64_t dn_expert_stride, int64_t dn_row_bytes, const int64_t *idx,
                      const float *wt, int64_t kk, float limit, float *out, int threads) {
#ifdef MLS_INT16
    if (!qw_type(type_gu) || !qw_type(type_dn)) return -1;
    if (d % 32 || inter % 32) return -2;
    const int64_t pairs = t * kk, n_gu = 2 * inter, half_runs = (inter + QW_R - 1) / QW_R;
    const int64_t dn_runs = (d + QW_R - 1) / QW_R;
    int16_t *xc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(t * d) + 64);
    int16_t *hc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(pairs * inter) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(t * d / 32) + 64);
    float *hd = (float *)malloc(sizeof(float) * (size_t)(pairs * inter / 32) + 64);
    float *gu = (float *)malloc(sizeof(float) * (size_t)(pairs * n_gu) + 64);
    float *y = (float *)malloc(sizeof(float) * (size_t)(pairs * d) + 64);
    int rc = 0;
    if (!xc || !hc || !xd || !hd || !gu || !y) {
        rc = -4;
        goto done;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < t; i++) qw_quantize_rows(x + i * d, 1, d, d, xc + i * d, xd + i * (d / 32));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * 2 * half_runs; it++) { /* (pair, gate or up, a run of QW_R rows) */
            const int64_t p = it / (2 * half_runs), up_half = it % (2 * half_runs) / half_runs;
            const int64_t r0 = it % half_runs * QW_R, nr = inter - r0 < QW_R ? inter - r0 : QW_R, tok = p / kk;
            const uint8_t *row0 = (up_half ? up : gate) + idx[p] * gu_expert_stride + r0 * gu_row_bytes;
            qw_run(type_gu, row0, gu_row_bytes, nr, xc + tok * d, xd + tok * (d / 32), 1, d,
                   gu + p * n_gu + up_half * inter + r0, n_gu, NULL);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) { /* h = silu(gate) * up in gu's gate half, then its int16 codes */
            float *h = gu + p * n_gu;
            for (int64_t i = 0; i < inter; i++) h[i] = silu_mul_clamped(h[i], h[inter + i], limit);
            qw_quantize_rows(h, 1, inter, inter, hc + p * inter, hd + p * (inter / 32));
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pairs * dn_runs; it++) {
            const int64_t p = it / dn_runs, r0 = it % dn_runs * QW_R, nr = d - r0 < QW_R ? d - r0 : QW_R;
            qw_run(type_dn, down + idx[p] * dn_expert_stride + r0 * dn_row_bytes, dn_row_bytes, nr, hc + p * inter,
                   hd + p * (inter / 32), 1, inter, y + p * d + r0, d, NULL);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * d; it++) {
            const int64_t tok = it / d, r = it % d;
            float acc = 0.0f;
            for (int64_t j = 0; j < kk; j++) acc += wt[tok * kk + j] * y[(tok * kk + j) * d + r];
            out[it] = acc;
        }
    }
done:
    free(xc);
    free(hc);
    free(xd);
    free(hd);
    free(gu);
    free(y);
    return rc;
#else
    (void)type_gu, (void)type_dn, (void)x, (void)t, (void)d, (void)inter, (void)gate, (void)up, (void)gu_expert_stride;
    (void)gu_row_bytes, (void)down, (void)dn_expert_stride, (void)dn_row_bytes, (void)idx, (void)wt, (void)kk;
    (void)limit, (void)out, (void)threads;
    return -1;
#endif
}

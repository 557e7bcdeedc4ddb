/* ---------------------------------------------------------------- a decoder layer's decode step in one call
   A whole decoder layer for a step of T requests with one query each (pure decode, dense absorbed attention),
   every weight in ggml blocks: input RMSNorm; q_a, its norm and q_b (or q_proj); kv_a_proj; the latent row, its
   norm and rope, and the query rope (mls_latent_rope_write); q_nope W_UK per head (attn_k_b); the latent MQA
   (mls_latent_mqa); o_lat W_UV^T per head (attn_v_b); o_proj and the residual; the post-attention norm; the
   MLP (mls_moe_block, or a dense SwiGLU) and the residual. Every weight is in ggml blocks or F32 rows (type 0).
   The same operations as the per-op native path in the same order (each product's rows, the norms, the rope,
   the attention kernel), so the result equals it up to where that path leaves C: torch's silu (the dense
   SwiGLU), BLAS for F32 rows (another summation order), and the MoE block's own differences (moe/block.c).
   One call instead of ~20 native calls and ~60 tensor ops per layer. */

static int lin_apply(const mls_lin_t *L, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int int8,
                     int threads) {
    if (int8 && q8rows((int)L->type))
        return mls_gemm_q8((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, y, ldy, threads);
    return mls_gemm((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, 0, 1, 1, 1, L->n, y, ldy, threads);
}

/* rows of x [t, d] -> y: RMSNorm, exactly mls_rms_norm's per-row operations (y may be x) */
static void norm_rows(const float *x, int64_t t, int64_t d, const float *w, double eps, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (t >= 8)
    for (int64_t i = 0; i < t; i++) scale_rows(x + i * d, rms_inv(x + i * d, d, (float)eps), w, d, y + i * d);
}

/* y[tok, hh, i] (ldy per token, row length n per head) = head hh's ggml matrix rows (n of k values) . x[tok, hh]:
   the per-head products of GGUFHeads (absorb / expand), each row with the same operations as its grouped GEMV */
static int per_head(int64_t type, const uint8_t *w, int64_t head_stride, int64_t row_bytes, int64_t h, int64_t n,
                    int64_t k, const float *x, int64_t ldx, int64_t x_head, int64_t t, float *y, int64_t ldy,
                    int int8, int threads) {
    if (int8 && q8rows((int)type)) { /* as GGUFHeads with int8: the rows gathered head by head, one grouped call */
        float *xs = (float *)malloc(sizeof(float) * (size_t)(h * t * k + h * t * n) + 1);
        int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * h + 1));
        int rc = xs && ids ? 0 : -4;
        if (!rc) {
            float *ys = xs + h * t * k;
            for (int64_t hh = 0; hh < h; hh++) {
                ids[hh] = hh;
                ids[h + hh] = hh * t;
                for (int64_t tok = 0; tok < t; tok++)
                    memcpy(xs + (hh * t + tok) * k, x + tok * ldx + hh * x_head, sizeof(float) * (size_t)k);
            }
            ids[2 * h] = h * t;
            rc = mls_grouped_gemm_q8((int)type, xs, k, w, n, row_bytes, head_stride, ids, ids + h, h, ys, threads);
            for (int64_t hh = 0; !rc && hh < h; hh++)
                for (int64_t tok = 0; tok < t; tok++)
                    memcpy(y + tok * ldy + hh * n, ys + (hh * t + tok) * n, sizeof(float) * (size_t)n);
        }
        free(xs);
        free(ids);
        return rc;
    }
    const lin_kernel kern = lin_rows(type, row_bytes);
    const int64_t runs = (n + ROW_RUN - 1) / ROW_RUN;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < h * runs; it++) {
            const int64_t hh = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
            for (int64_t i = r0; i < r1; i++)
                lin_row(kern, w + hh * head_stride + i * row_bytes, x + hh * x_head, ldx, t, k, y + hh * n + i, ldy, buf);
        }
        free(buf);
    }
    return 0;
}

/* x [T, D] -> out [T, D] (out may not be x), the layer's cache [n_slots, r + dr] written at the step's slots.
   Returns 0, or the first refusal of a part (-1 type, -2 sizes, -3 router, -4 memory, -5 slot). */
int mls_decode_layer(const mls_layer_t *ly, const mls_decode_step_t *st, const float *x, float *out, float *cache,
                     int threads) {
    const int64_t t = st->t, d = ly->d, h = ly->h, dn = ly->dn, dr = ly->dr, dv = ly->dv, r = ly->r;
    const int64_t lq = h * (dn + dr), ql = ly->q_lora, inter = ly->mlp_inter;
    const int i8 = (int)ly->int8;
    if ((ql && !lin_for(ly->q_a.type).fn) || !lin_for(ly->q_b.type).fn || !lin_for(ly->kv_a.type).fn ||
        !lin_for(ly->o_proj.type).fn || !lin_for(ly->type_k).fn || !lin_for(ly->type_v).fn)
        return -1;
    /* the buffers below are sized from the layer's dimensions: every weight must agree with them */
    if ((ql && (ly->q_a.k != d || ly->q_a.n != ql)) || ly->q_b.k != (ql ? ql : d) || ly->q_b.n != lq ||
        ly->kv_a.k != d || ly->kv_a.n != r + dr || ly->o_proj.k != h * dv || ly->o_proj.n != d ||
        (ly->moe && ly->moe->d != d) ||
        (!ly->moe && (ly->mlp_gate.k != d || ly->mlp_gate.n != inter || ly->mlp_up.k != d || ly->mlp_up.n != inter ||
                      ly->mlp_down.k != inter || ly->mlp_down.n != d)))
        return -2;
    if (!ly->moe && (!lin_for(ly->mlp_gate.type).fn || !lin_for(ly->mlp_up.type).fn || !lin_for(ly->mlp_down.type).fn))
        return -1;
    const size_t nf = (size_t)(t * d + t * ql + t * lq + t * (r + dr) + 2 * t * h * r + t * h * dv + t * d +
                               t * 2 * inter + t * inter);
    float *mem = (float *)malloc(sizeof(float) * nf + 64);
    if (!mem) return -4;
    float *xn = mem, *cq = xn + t * d, *q = cq + t * ql, *kv = q + t * lq, *q_lat = kv + t * (r + dr);
    float *o_lat = q_lat + t * h * r, *o = o_lat + t * h * r, *a = o + t * h * dv, *gu = a + t * d;
    float *hh = gu + t * 2 * inter;
    int rc = 0;
    norm_rows(x, t, d, ly->norm_in, ly->eps_in, xn, threads);
    if (ql) {
        if ((rc = lin_apply(&ly->q_a, xn, t, d, cq, ql, i8, threads))) goto done;
        norm_rows(cq, t, ql, ly->norm_q, ly->eps_q, cq, threads);
        if ((rc = lin_apply(&ly->q_b, cq, t, ql, q, lq, i8, threads))) goto done;
    } else if ((rc = lin_apply(&ly->q_b, xn, t, d, q, lq, i8, threads)))
        goto done;
    if ((rc = lin_apply(&ly->kv_a, xn, t, d, kv, r + dr, i8, threads))) goto done;
    rc = mls_latent_rope_write(kv, t, r + dr, r, dr, ly->norm_kv, (float)ly->eps_kv, q, h, dn + dr, dn, st->cos,
                               st->sin, (int)ly->interleaved, cache, st->n_slots, st->slots, threads);
    if (rc) goto done;
    rc = per_head(ly->type_k, ly->k_b, ly->k_head_stride, ly->k_row_bytes, h, r, dn, q, lq, dn + dr, t, q_lat, h * r,
                  i8, threads);
    if (rc) goto done;
    rc = mls_latent_mqa(q_lat, h * r, r, q + dn, lq, dn + dr, st->q_index, cache, st->kv_slots, st->mask, t, 1, st->l,
                        h, r, dr, (float)ly->scale, o_lat, threads);
    if (rc) goto done;
    rc = per_head(ly->type_v, ly->v_b, ly->v_head_stride, ly->v_row_bytes, h, dv, r, o_lat, h * r, r, t, o, h * dv, i8,
                  threads);
    if (rc) goto done;
    if ((rc = lin_apply(&ly->o_proj, o, t, h * dv, a, d, i8, threads))) goto done;
    for (int64_t i = 0; i < t * d; i++) out[i] = x[i] + a[i];
    norm_rows(out, t, d, ly->norm_post, ly->eps_post, xn, threads);
    if (ly->moe) {
        if ((rc = mls_moe_block(ly->moe, xn, t, a, 0, 0, threads))) goto done;
    } else {
        if ((rc = lin_apply(&ly->mlp_gate, xn, t, d, gu, 2 * inter, i8, threads))) goto done;
        if ((rc = lin_apply(&ly->mlp_up, xn, t, d, gu + inter, 2 * inter, i8, threads))) goto done;
        for (int64_t tok = 0; tok < t; tok++)
            for (int64_t i = 0; i < inter; i++)
                hh[tok * inter + i] = silu_mul(gu[tok * 2 * inter + i], gu[tok * 2 * inter + inter + i]);
        if ((rc = lin_apply(&ly->mlp_down, hh, t, inter, a, d, i8, threads))) goto done;
    }
    for (int64_t i = 0; i < t * d; i++) out[i] += a[i];
done:
    free(mem);
    return rc;
}

/* ---------------------------------------------------------------- a decoder layer's decode step in one call
   A whole decoder layer for a step of T requests with one query each (pure decode, absorbed attention),
   every weight in ggml blocks: input RMSNorm; q_a, its norm and q_b (or q_proj); kv_a_proj; the latent row, its
   norm and rope, and the query rope (mls_latent_rope_write); on a sparse (DSA) route the indexer: a full layer's
   query from c_q, its key written to the index-key cache row, its head weights, and when the step selects
   (st->topk) the scores over the request's index keys and their top K (indexer.c), which the shared layers after
   it reuse (st->sel_index / sel_valid carry it between layers); q_nope W_UK per head (attn_k_b); the latent MQA
   (mls_latent_mqa) over every row of the request, or over the K selected rows only; o_lat W_UV^T per head
   (attn_v_b); o_proj and the residual; the post-attention norm; the MLP (mls_moe_block, or a dense SwiGLU) and
   the residual. Every weight is in ggml blocks or F32 rows (type 0).
   The same operations as the per-op native path in the same order (each product's rows, the norms, the rope,
   the attention kernel), so the result equals it up to where that path leaves C: torch's silu (the dense
   SwiGLU), BLAS for F32 rows (another summation order), the MoE block's own differences (moe/block.c), and on
   sparse steps torch's LayerNorm and score GEMMs (indexer.c) and the order in which the selected rows are summed.
   One call instead of ~20 native calls and ~60 tensor ops per layer (~35 more on a sparse step).
   The states (mls_rows_t) are fp32 rows, 8-bit codes or 16-bit rows (kv_cache_dtype): over 8-bit (16-bit) ones
   the step's latent rows and index keys are computed into a buffer of T rows by the same code and quantized
   (rounded) into the cache (rows8.c / rows16.c, the per-op path's write: QuantizedRows.index_copy_ of the same
   rows), and the attention and the top-k read the codes where they lie (mls_latent_mqa8 / mls_latent_mqa16,
   mls_index_topk8 / mls_index_topk16), as the per-op native path does. */

typedef int (*reduce_fn)(float *a, int64_t n); /* mls_layer_t.reduce (tensor parallel) */

static int lin_apply(const mls_lin_t *L, const float *x, int64_t m, int64_t ldx, float *y, int64_t ldy, int int8,
                     int threads) {
    if (q8rows_in((int)L->type, int8))
        return mls_gemm_q8((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, y, ldy, threads);
    if (qw_in((int)L->type, int8)) /* int16 activations (x86/int16_prefill.c), as GGUFLinear's */
        return mls_int16_gemm((int)L->type, x, m, L->k, ldx, L->w, L->n, L->row_bytes, y, ldy, threads);
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
    const int q8 = q8rows_in((int)type, int8) != 0, q16 = qw_in((int)type, int8);
    if (q8 || q16) { /* as GGUFHeads with int8 or int16: the rows gathered head by head, one grouped call */
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
            rc = q8 ? mls_grouped_gemm_q8((int)type, xs, k, w, n, row_bytes, head_stride, ids, ids + h, h, ys, threads)
                    : mls_int16_grouped((int)type, xs, k, w, n, row_bytes, head_stride, ids, ids + h, h, ys, n, threads);
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

/* A full indexer layer's part of a sparse step: its query, key (written to index_keys) and weights, and when the
   step selects, the top K into st->sel_index / sel_valid. cq [T, q_lora] the normed query latent, xn [T, D]. */
static int indexer_step(const mls_layer_t *ly, const mls_decode_step_t *st, const float *xn, const float *cq,
                        const mls_rows_t *index_keys, int i8, int threads) {
    const int64_t t = st->t, hi = ly->idx_h, di = ly->idx_d;
    const int eight = !index_keys->rows; /* 8-bit or 16-bit keys: computed into `fresh`, then stored */
    /* qi, the keys' rows, weights, and over 8-bit keys the step's T key rows and their slots 0..T-1 */
    const size_t nf = ((size_t)(t * hi * di + t * di + t * hi + (eight ? t * di : 0)) + 1) & ~(size_t)1;
    float *qi = (float *)malloc(sizeof(float) * nf + sizeof(int64_t) * (size_t)(eight ? t : 0) + 1);
    if (!qi) return -4;
    float *kk = qi + t * hi * di, *wt = kk + t * di, *fresh = wt + t * hi;
    int64_t *own = (int64_t *)(qi + nf); /* 8-byte aligned: nf is even */
    for (int64_t tok = 0; eight && tok < t; tok++) own[tok] = tok;
    int rc = lin_apply(&ly->idx_q_b, cq, t, ly->q_lora, qi, hi * di, i8, threads);
    if (!rc) rc = lin_apply(&ly->idx_k, xn, t, ly->d, kk, di, i8, threads);
    if (!rc) rc = lin_apply(&ly->idx_w, xn, t, ly->d, wt, hi, i8, threads);
    if (!rc) {
        index_keys_write(kk, qi, wt, t, hi, di, ly->dr, ly->idx_norm_w, ly->idx_norm_b, (float)ly->idx_eps,
                         (float)ly->idx_w_scale, (float)ly->idx_d_scale, st->cos, st->sin, (int)ly->idx_interleaved,
                         eight ? fresh : index_keys->rows, eight ? own : st->slots);
        if (eight && index_keys->half)
            rc = rows16_write(fresh, t, di, di, (int)index_keys->half, (uint16_t *)index_keys->codes, st->slots,
                              st->n_slots);
        else if (eight)
            rc = rows8_write(fresh, t, di, di, di, index_keys, st->slots, st->n_slots);
    }
    if (!rc && st->topk && index_keys->half)
        rc = mls_index_topk16(qi, wt, t, hi, di, (const uint16_t *)index_keys->codes, (int)index_keys->half,
                              st->kv_slots, st->mask, st->l, st->topk, st->sel_index, st->sel_valid,
                              (int)st->index_bf16, threads);
    else if (!rc && st->topk)
        rc = eight ? mls_index_topk8(qi, wt, t, hi, di, index_keys->codes, index_keys->scales, st->kv_slots,
                                     st->mask, st->l, st->topk, st->sel_index, st->sel_valid, (int)st->index_bf16,
                                     threads)
                   : mls_index_topk(qi, wt, t, hi, di, index_keys->rows, st->kv_slots, st->mask, st->l, st->topk,
                                    st->sel_index, st->sel_valid, (int)st->index_bf16, threads);
    free(qi);
    return rc;
}

/* the latent MQA over the rows at slots [T, L] of the layer's cache, fp32 rows, 8-bit codes or 16-bit rows */
static int cache_mqa(const mls_layer_t *ly, const mls_decode_step_t *st, const float *q_lat, const float *q,
                     const mls_rows_t *cache, const int64_t *slots, const uint8_t *mask, int64_t l, float *o_lat,
                     int threads) {
    const int64_t h = ly->h, r = ly->r, dr = ly->dr, lq = h * (ly->dn + dr);
    if (cache->rows)
        return mls_latent_mqa(q_lat, h * r, r, q + ly->dn, lq, ly->dn + dr, st->q_index, cache->rows, slots, mask,
                              st->t, 1, l, h, r, dr, (float)ly->scale, o_lat, threads);
    if (cache->half)
        return mls_latent_mqa16(q_lat, h * r, r, q + ly->dn, lq, ly->dn + dr, st->q_index,
                                (const uint16_t *)cache->codes, (int)cache->half, slots, mask, st->t, 1, l, h, r, dr,
                                (float)ly->scale, o_lat, threads);
    return mls_latent_mqa8(q_lat, h * r, r, q + ly->dn, lq, ly->dn + dr, st->q_index, cache->codes, cache->scales,
                           cache->kept, (int)cache->fp8, cache->block, slots, mask, st->t, 1, l, h, r, dr,
                           (float)ly->scale, o_lat, threads);
}

/* The latent MQA over each request's K selected rows (st->sel_index / sel_valid): their cache slots gathered. */
static int sparse_mqa(const mls_layer_t *ly, const mls_decode_step_t *st, const float *q_lat, const float *q,
                      const mls_rows_t *cache, float *o_lat, int threads) {
    const int64_t t = st->t, k = st->topk;
    int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)(t * k) + 1);
    if (!slots) return -4;
    for (int64_t tok = 0; tok < t; tok++)
        for (int64_t i = 0; i < k; i++) slots[tok * k + i] = st->kv_slots[tok * st->l + st->sel_index[tok * k + i]];
    const int rc = cache_mqa(ly, st, q_lat, q, cache, slots, st->sel_valid, k, o_lat, threads);
    free(slots);
    return rc;
}

/* x [T, D] -> out [T, D] (out may not be x), the layer's cache [n_slots, r + dr] written at the step's slots, and
   on a sparse step a full indexer layer's index_keys [n_slots, Di] too (0 otherwise).
   Returns 0, or the first refusal of a part (-1 type, -2 sizes, -3 router, -4 memory, -5 slot, -6 a sparse step
   the layer's indexer cannot run: no key cache, no query latent, or a shared layer with no selection before it;
   or a state it cannot read: 8-bit rows whose block does not divide r, 8-bit index keys not one e4m3 block of at
   most 1024 values). */
int mls_decode_layer(const mls_layer_t *ly, const mls_decode_step_t *st, const float *x, float *out,
                     const mls_rows_t *cache, const mls_rows_t *index_keys, int threads) {
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
    const int64_t role = st->sparse ? ly->idx_role : 0; /* a dense route runs no indexer */
    if (role == 1 && (!lin_for(ly->idx_q_b.type).fn || !lin_for(ly->idx_k.type).fn || !lin_for(ly->idx_w.type).fn))
        return -1;
    if (role == 1 && (ly->idx_q_b.k != ql || ly->idx_q_b.n != ly->idx_h * ly->idx_d || ly->idx_k.k != d ||
                      ly->idx_k.n != ly->idx_d || ly->idx_w.k != d || ly->idx_w.n != ly->idx_h))
        return -2;
    if ((role == 1 && (!index_keys || !ql)) || (st->topk && (role == 0 || !st->sel_index || !st->sel_valid)))
        return -6;
    if (!cache->rows && !cache->half && (cache->block <= 0 || r % cache->block || (dr && !cache->kept))) return -6;
    if (!cache->rows && cache->half && cache->half != HALF_F16 && cache->half != HALF_BF16) return -6;
    if (role == 1 && !index_keys->rows && !index_keys->half &&
        (!index_keys->fp8 || index_keys->block != ly->idx_d || ly->idx_d > 1024))
        return -6;
    if (role == 1 && index_keys->half && (ly->idx_d > 1024 || (index_keys->half != HALF_F16 && index_keys->half != HALF_BF16)))
        return -6;
    if (!ly->moe && (!lin_for(ly->mlp_gate.type).fn || !lin_for(ly->mlp_up.type).fn || !lin_for(ly->mlp_down.type).fn))
        return -1;
    const int eight = !cache->rows; /* 8/16-bit rows: the step's T rows go to `fresh` (slots `own`), then stored */
    const size_t nf = (size_t)(t * d + t * ql + t * lq + t * (r + dr) + 2 * t * h * r + t * h * dv + t * d +
                               t * 2 * inter + t * inter + (eight ? t * (r + dr) : 0));
    const size_t nf8 = (nf + 1) & ~(size_t)1; /* `own` starts 8-byte aligned */
    float *mem = (float *)malloc(sizeof(float) * nf8 + sizeof(int64_t) * (size_t)(eight ? t : 0) + 64);
    if (!mem) return -4;
    float *xn = mem, *cq = xn + t * d, *q = cq + t * ql, *kv = q + t * lq, *q_lat = kv + t * (r + dr);
    float *o_lat = q_lat + t * h * r, *o = o_lat + t * h * r, *a = o + t * h * dv, *gu = a + t * d;
    float *hh = gu + t * 2 * inter, *fresh = hh + t * inter;
    int64_t *own = (int64_t *)(mem + nf8);
    for (int64_t tok = 0; eight && tok < t; tok++) own[tok] = tok;
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
                               st->sin, (int)ly->interleaved, eight ? fresh : cache->rows, eight ? t : st->n_slots,
                               eight ? own : st->slots, threads);
    if (!rc && eight && cache->half)
        rc = rows16_write(fresh, t, r + dr, r + dr, (int)cache->half, (uint16_t *)cache->codes, st->slots, st->n_slots);
    else if (!rc && eight)
        rc = rows8_write(fresh, t, r + dr, r + dr, r, cache, st->slots, st->n_slots);
    if (rc) goto done;
    if (role == 1 && (rc = indexer_step(ly, st, xn, cq, index_keys, i8, threads))) goto done;
    rc = per_head(ly->type_k, ly->k_b, ly->k_head_stride, ly->k_row_bytes, h, r, dn, q, lq, dn + dr, t, q_lat, h * r,
                  i8, threads);
    if (rc) goto done;
    if (st->topk) /* a sparse step that selects: the K rows of the last full layer's top-k */
        rc = sparse_mqa(ly, st, q_lat, q, cache, o_lat, threads);
    else
        rc = cache_mqa(ly, st, q_lat, q, cache, st->kv_slots, st->mask, st->l, o_lat, threads);
    if (rc) goto done;
    rc = per_head(ly->type_v, ly->v_b, ly->v_head_stride, ly->v_row_bytes, h, dv, r, o_lat, h * r, r, t, o, h * dv, i8,
                  threads);
    if (rc) goto done;
    if ((rc = lin_apply(&ly->o_proj, o, t, h * dv, a, d, i8, threads))) goto done;
    if (ly->reduce && ((reduce_fn)ly->reduce)(a, t * d)) { rc = -7; goto done; } /* tensor parallel: the ranks' sum */
    for (int64_t i = 0; i < t * d; i++) out[i] = x[i] + a[i];
    norm_rows(out, t, d, ly->norm_post, ly->eps_post, xn, threads);
    if (ly->moe) {
        if ((rc = mls_moe_block(ly->moe, xn, t, 0, a, 0, 0, threads))) goto done;
    } else {
        if ((rc = lin_apply(&ly->mlp_gate, xn, t, d, gu, 2 * inter, i8, threads))) goto done;
        if ((rc = lin_apply(&ly->mlp_up, xn, t, d, gu + inter, 2 * inter, i8, threads))) goto done;
        for (int64_t tok = 0; tok < t; tok++)
            for (int64_t i = 0; i < inter; i++)
                hh[tok * inter + i] = silu_mul(gu[tok * 2 * inter + i], gu[tok * 2 * inter + inter + i]);
        if ((rc = lin_apply(&ly->mlp_down, hh, t, inter, a, d, i8, threads))) goto done;
    }
    if (ly->reduce && ((reduce_fn)ly->reduce)(a, t * d)) { rc = -7; goto done; }
    for (int64_t i = 0; i < t * d; i++) out[i] += a[i];
done:
    free(mem);
    return rc;
}

/* n decoder layers of one pure decode step in one call: layer i (layers[i]) over its states (caches[i],
   index_keys[i] or 0), each layer's output the next one's input; x [T, D] -> out [T, D] (out may not be x).
   Exactly mls_decode_layer called n times in order (the same code on the same values, so the same bits), without
   returning to the caller between layers: per layer that saves the caller's glue (a ctypes call and its checks),
   which on a batch-1 step runs cold after each layer's weights went through the caches. Returns 0, or the first
   refusal (mls_decode_layer's codes, -4 for the ping-pong buffer) with *failed the layer that refused. */
int mls_decode_layers(const mls_layer_t *const *layers, int64_t n, const mls_decode_step_t *st, const float *x,
                      float *out, const mls_rows_t *const *caches, const mls_rows_t *const *index_keys,
                      int64_t *failed, int threads) {
    const int64_t td = st->t * (n > 0 ? layers[0]->d : 0);
    float *tmp = n > 1 ? (float *)malloc(sizeof(float) * (size_t)td + 1) : 0;
    if (n > 1 && !tmp) return -4;
    int rc = 0;
    const float *in = x;
    for (int64_t i = 0; i < n && !rc; i++) {
        if (layers[i]->d != layers[0]->d) { rc = -2; *failed = i; break; }
        float *dst = (n - 1 - i) % 2 ? tmp : out; /* the last layer writes out */
        rc = mls_decode_layer(layers[i], st, in, dst, caches[i], index_keys ? index_keys[i] : 0, threads);
        if (rc) *failed = i;
        in = dst;
    }
    free(tmp);
    return rc;
}

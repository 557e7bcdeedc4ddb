/* ---------------------------------------------------------------- the MoE block at decode, in one call
   A decode step's whole MoE block with ggml-block weights (GGUFExperts and a GGUFLinear shared expert): the
   gate's logits (fp32 weights), the router (mls_moe_route), the routed experts grouped by expert (an active
   expert's rows are read once for all of its pairs), the shared expert, and the sum, in one parallel region,
   instead of ~10 native calls and ~30 tensor ops. For the same routing the routed part is exactly what
   mls_moe_experts computes (each row's products do not depend on how many activation rows share them, and
   the weighted sum runs over j in the same order) and the shared part exactly what three mls_gemm calls give;
   the gate's logits (dot order) and the shared SwiGLU's silu (expf) round differently from torch's. Routed
   experts of a type whose scales lie apart (INT4: b->gu_scale / dn_scale) take that type's decode-and-dot
   (types.c fused_scaled), each row with its scales, exactly as mls_grouped_gemm runs them. */

/* a thread's scratch in the block: the row kernels' buffer, the int16 panel (qw_run), and on the tiles the int8
   products' unpacked weight rows and sums (W, acc: x86/amx.c amx_item), the tile shapes the thread has loaded (cfg)
   and the int16 products' (qa) */
typedef struct {
    float *buf;
    void *panel;
    void *a2; /* the AVX2 panels' (moe_ways a8*) */
#ifdef MLS_AMX
    char *mem8;
    amx_rows_t W;
    amx_cfg_t cfg, qa;
#endif
} moe_scratch;

#ifdef MLS_AMX
/* nr weight rows at w (call c) times the m activation rows packed at xg into y (the first row's, the weight rows'
   first output) */
static void moe_tile_rows(moe_scratch *s, const amx_call_t *c, const uint8_t *w, int64_t nr, const int32_t *xg,
                          int64_t m, float *y) {
    amx_tiles_use(&s->cfg, &c->cfg);
    amx_item(c, &s->W, (float *)s->mem8, w, 0, nr, xg, (m + AMX_ROWS - 1) / AMX_ROWS, m, y);
}
#endif

/* gate_up item it (< groups * runs) of a routed group's rgu-row runs, runs per group */
static void moe_gate_up_routed(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, int64_t it,
                               int64_t runs, int64_t rgu, moe_scratch *s) {
    float *buf = s->buf;
    void *panel = s->panel;
    const int64_t d = b->d, inter = b->inter, g = b->group, n_gu = 2 * inter;
    const int64_t *start = m->start, *act = m->act;
    float *gu = m->gu;
    const int64_t a = it / runs, r0 = (it % runs) * rgu, r1 = r0 + rgu < n_gu ? r0 + rgu : n_gu;
    const int64_t p0 = start[a], rows = start[a + 1] - p0;
#ifdef MLS_AMX
    const int tiles8 = w->t8gu && m->pk[a] >= 0;
#else
    const int tiles8 = 0;
#endif
    const int whole = w->q16gu || (w->r16gu && rows16_in((int)b->type_gu, rows)) || tiles8; /* one call per part */
    for (int64_t s0 = r0, s1; whole && s0 < r1; s0 = s1) { /* the run's rows in gate, then in up */
        s1 = s0 < inter && r1 > inter ? inter : r1;
        const uint8_t *row0 = gate_up_row(b->gate, b->up, act[a], b->gu_expert_stride, b->gu_row_bytes, inter, s0);
#ifdef MLS_AMX
        if (tiles8) {
            moe_tile_rows(s, &m->c8gu, row0, s1 - s0, m->p8gu + m->pk[a] / 16 * m->c8gu.per_group, rows,
                          gu + p0 * n_gu + s0);
            continue;
        }
#endif
#ifdef MLS_INT16_TILES
        if (w->q16gu && m->ra_h && m->pa[a] >= 0 && s1 - s0 == QW_R) {
            amx_tiles_use(&s->cfg, &s->qa);
            qa_rows((int)b->type_gu, row0, b->gu_row_bytes, m->ra_h + m->pa[a] / 16 * (d / 32) * 128,
                    m->ra_l + m->pa[a] / 16 * (d / 32) * 128, m->ra_d + m->pa[a] / 16 * (d / 32) * 16, rows, d,
                    gu + p0 * n_gu + s0, n_gu);
        } else
#endif
        if (w->q16gu)
            qw_run((int)b->type_gu, row0, b->gu_row_bytes, s1 - s0, m->xs16 + p0 * d, m->xs16d + p0 * (d / 32), rows,
                   d, gu + p0 * n_gu + s0, n_gu, panel);
        else
            rows16_run((int)b->type_gu, row0, b->gu_row_bytes, s1 - s0, m->xsq + p0 * d, m->xsd + p0 * (d / 32), rows,
                       d, gu + p0 * n_gu + s0, n_gu);
    }
    const int two = !whole && w->two_gu && rows >= 2;
    if (two)
        q4_0_pairs_run(b->gate + act[a] * b->gu_expert_stride, b->up + act[a] * b->gu_expert_stride, inter,
                       b->gu_row_bytes, r0, r1, m->xp2 + m->off2[a] * (d / 32) * 512,
                       m->dt2 + m->off2[a] * (d / 32) * 16, rows, d, gu + p0 * n_gu, n_gu);
    for (int64_t r = r0; !whole && !two && r < r1; r++) {
        const uint8_t *row = gate_up_row(b->gate, b->up, act[a], b->gu_expert_stride, b->gu_row_bytes, inter, r);
        if (w->qgu)
            w->qgu(row, m->xsq + p0 * d, m->xsd + p0 * (d / 32), rows, d, gu + p0 * n_gu + r, n_gu);
        else if (w->fgu)
            w->fgu(row, b->gu_scale + act[a] * b->gu_scale_stride + r * (d / g), g, m->xs + p0 * d, d, rows, d,
                   gu + p0 * n_gu + r, n_gu);
        else
            lin_row(w->kgu, row, m->xs + p0 * d, d, rows, d, gu + p0 * n_gu + r, n_gu, buf);
    }
}

/* gate_up item it of the shared expert's rsg-row runs (its first rows r0 = it * rsg in gate, then up) */
static void moe_gate_up_shared(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, const float *x,
                               int64_t t, int64_t it, int64_t rsg, moe_scratch *s) {
    float *buf = s->buf;
    void *panel = s->panel;
    const int64_t d = b->d, si = b->shared_inter, n_sgu = 2 * si;
    float *sgu = m->sgu;
    const int64_t r0 = it * rsg, r1 = r0 + rsg < n_sgu ? r0 + rsg : n_sgu;
    for (int64_t s0 = r0, s1; s0 < r1; s0 = s1) { /* the run's rows in gate, then in up */
        s1 = s0 < si && r1 > si ? si : r1;
        const int up = s0 >= si;
        const uint8_t *row0 = up ? b->su + (s0 - si) * b->su_row_bytes : b->sg + s0 * b->sg_row_bytes;
        const int64_t rb = up ? b->su_row_bytes : b->sg_row_bytes, type = up ? b->type_su : b->type_sg;
#ifdef MLS_AMX
        if (up ? w->t8su : w->t8sg) {
            moe_tile_rows(s, up ? &m->c8su : &m->c8sg, row0, s1 - s0, up ? m->p8su : m->p8sg, t, sgu + s0);
            continue;
        }
#endif
#ifdef MLS_A2_ITEMS
        if (up ? w->a8su : w->a8sg) {
            a2_item((int)type, row0, rb, s1 - s0, up ? m->xuq : m->xq, up ? m->xud : m->xd, up ? m->xpsu : m->xpsg, t,
                    d, sgu + s0, n_sgu, s->a2);
            continue;
        }
#endif
#ifdef MLS_INT16_TILES
        if ((up ? w->q16su : w->q16sg) && m->xa_h && qa_takes((int)type, t) && s1 - s0 == QW_R) {
            amx_tiles_use(&s->cfg, &s->qa);
            qa_rows((int)type, row0, rb, m->xa_h, m->xa_l, m->xa_d, t, d, sgu + s0, n_sgu);
        } else
#endif
        if (up ? w->q16su : w->q16sg)
            qw_run((int)type, row0, rb, s1 - s0, m->x16, m->x16d, t, d, sgu + s0, n_sgu, panel);
        else if ((up ? w->r16su : w->r16sg) && rows16_in((int)type, t))
            rows16_run((int)type, row0, rb, s1 - s0, up ? m->xuq : m->xq, up ? m->xud : m->xd, t, d, sgu + s0, n_sgu);
    }
    if (w->two_sg && r0 < si) /* the run's gate rows, then its up rows */
        q4_0_pairs_run(b->sg, b->sg, si, b->sg_row_bytes, r0, r1 < si ? r1 : si, m->xp2 + m->o_sg * 512,
                       m->dt2 + m->o_sg * 16, t, d, sgu, n_sgu);
    if (w->two_su && r1 > si)
        q4_0_pairs_run(b->su, b->su, si, b->su_row_bytes, (r0 > si ? r0 : si) - si, r1 - si, m->xp2 + m->o_su * 512,
                       m->dt2 + m->o_su * 16, t, d, sgu + si, n_sgu);
    for (int64_t r = r0; r < r1; r++) {
        const int up = r >= si;
        if (up ? w->q16su || (w->r16su && rows16_in((int)b->type_su, t)) || w->two_su || w->t8su || w->a8su
               : w->q16sg || (w->r16sg && rows16_in((int)b->type_sg, t)) || w->two_sg || w->t8sg || w->a8sg)
            continue;
        const uint8_t *row = up ? b->su + (r - si) * b->su_row_bytes : b->sg + r * b->sg_row_bytes;
        const q8rows_fn q8 = up ? w->qsu : w->qsg;
        if (q8)
            q8(row, up ? m->xuq : m->xq, up ? m->xud : m->xd, t, d, sgu + r, n_sgu);
        else
            lin_row(up ? w->ksu : w->ksg, row, x, d, t, d, sgu + r, n_sgu, buf);
    }
}

/* gate_up item it of a routed group's rgu-row runs (runs per group), then of the shared expert's rsg-row runs */
static void moe_gate_up_item(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, const float *x,
                             int64_t t, int64_t it, int64_t runs, int64_t rgu, int64_t rsg, moe_scratch *s) {
    if (it < m->groups * runs)
        moe_gate_up_routed(b, w, m, it, runs, rgu, s);
    else
        moe_gate_up_shared(b, w, m, x, t, it - m->groups * runs, rsg, s);
}

/* down item it (< groups * druns) of a routed group's rdn-row runs (druns per group): the weight rows r0 .. r1 */
static void moe_down_routed(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, int64_t a, int64_t r0,
                            int64_t r1, moe_scratch *s) {
    float *buf = s->buf;
    void *panel = s->panel;
    const int64_t d = b->d, inter = b->inter, g = b->group;
    const int64_t p0 = m->start[a], rows = m->start[a + 1] - p0, ex = m->act[a];
    const uint8_t *we = b->down + ex * b->dn_expert_stride;
    float *ys = m->ys + p0 * d;
#ifdef MLS_AMX
    const int tiles8 = w->t8dn && m->pk[a] >= 0;
    if (tiles8)
        moe_tile_rows(s, &m->c8dn, we + r0 * b->dn_row_bytes, r1 - r0, m->p8dn + m->pk[a] / 16 * m->c8dn.per_group,
                      rows, ys + r0);
#else
    const int tiles8 = 0;
#endif
    const int whole = w->q16dn || (w->r16dn && rows16_in((int)b->type_dn, rows)) || tiles8;
    const int two = !whole && w->two_dn && rows >= 2;
    if (two)
        q4_0_pairs_run(we, we, d, b->dn_row_bytes, r0, r1, m->xp2 + (m->o_dn + m->off2[a] * (inter / 32)) * 512,
                       m->dt2 + (m->o_dn + m->off2[a] * (inter / 32)) * 16, rows, inter, ys, d);
#ifdef MLS_INT16_TILES
    if (w->q16dn && m->rh_h && m->pa[a] >= 0 && r1 - r0 == QW_R) {
        amx_tiles_use(&s->cfg, &s->qa);
        qa_rows((int)b->type_dn, we + r0 * b->dn_row_bytes, b->dn_row_bytes,
                m->rh_h + m->pa[a] / 16 * (inter / 32) * 128, m->rh_l + m->pa[a] / 16 * (inter / 32) * 128,
                m->rh_d + m->pa[a] / 16 * (inter / 32) * 16, rows, inter, ys + r0, d);
    } else
#endif
    if (w->q16dn)
        qw_run((int)b->type_dn, we + r0 * b->dn_row_bytes, b->dn_row_bytes, r1 - r0, m->h16 + p0 * inter,
               m->h16d + p0 * (inter / 32), rows, inter, ys + r0, d, panel);
    else if (whole && !tiles8)
        rows16_run((int)b->type_dn, we + r0 * b->dn_row_bytes, b->dn_row_bytes, r1 - r0, m->hq + p0 * inter,
                   m->hd + p0 * (inter / 32), rows, inter, ys + r0, d);
    for (int64_t r = r0; !whole && !two && r < r1; r++) {
        const uint8_t *row = we + r * b->dn_row_bytes;
        if (w->qdn)
            w->qdn(row, m->hq + p0 * inter, m->hd + p0 * (inter / 32), rows, inter, ys + r, d);
        else if (w->fdn)
            w->fdn(row, b->dn_scale + ex * b->dn_scale_stride + r * (inter / g), g, m->h + p0 * inter, inter, rows,
                   inter, ys + r, d);
        else
            lin_row(w->kdn, row, m->h + p0 * inter, inter, rows, inter, ys + r, d, buf);
    }
}

/* down item of the shared expert: its weight rows r0 .. r1 */
static void moe_down_shared(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, int64_t t, int64_t r0,
                            int64_t r1, moe_scratch *s) {
    float *buf = s->buf;
    void *panel = s->panel;
    const int64_t d = b->d, si = b->shared_inter;
    const int whole = w->q16sd || (w->r16sd && rows16_in((int)b->type_sd, t)) || w->t8sd || w->a8sd;
    const int two = !whole && w->two_sd;
#ifdef MLS_AMX
    if (w->t8sd) moe_tile_rows(s, &m->c8sd, b->sd + r0 * b->sd_row_bytes, r1 - r0, m->p8sd, t, m->ysh + r0);
#endif
#ifdef MLS_A2_ITEMS
    if (w->a8sd)
        a2_item((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, r1 - r0, m->shq, m->shd, m->xpsd, t,
                si, m->ysh + r0, d, s->a2);
#endif
    if (two)
        q4_0_pairs_run(b->sd, b->sd, d, b->sd_row_bytes, r0, r1, m->xp2 + m->o_sd * 512, m->dt2 + m->o_sd * 16, t, si,
                       m->ysh, d);
#ifdef MLS_INT16_TILES
    if (w->q16sd && m->sa_h && r1 - r0 == QW_R) {
        amx_tiles_use(&s->cfg, &s->qa);
        qa_rows((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, m->sa_h, m->sa_l, m->sa_d, t, si,
                m->ysh + r0, d);
    } else
#endif
    if (w->q16sd)
        qw_run((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, r1 - r0, m->sh16, m->sh16d, t, si,
               m->ysh + r0, d, panel);
    else if (whole && !w->t8sd && !w->a8sd)
        rows16_run((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, r1 - r0, m->shq, m->shd, t, si,
                   m->ysh + r0, d);
    for (int64_t r = r0; !whole && !two && r < r1; r++) {
        const uint8_t *row = b->sd + r * b->sd_row_bytes;
        if (w->qsd)
            w->qsd(row, m->shq, m->shd, t, si, m->ysh + r, d);
        else
            lin_row(w->ksd, row, m->sh, si, t, si, m->ysh + r, d, buf);
    }
}

/* down item it of a routed group's rdn-row runs (druns per group), then of the shared expert's */
static void moe_down_item(const mls_moe_block_t *b, const moe_ways *w, const moe_bufs *m, int64_t t, int64_t it,
                          int64_t druns, int64_t rdn, moe_scratch *s) {
    const int64_t d = b->d, a = it / druns, r0 = (it % druns) * rdn, r1 = r0 + rdn < d ? r0 + rdn : d;
    if (a < m->groups)
        moe_down_routed(b, w, m, a, r0, r1, s);
    else
        moe_down_shared(b, w, m, t, r0, r1, s);
}

/* this thread's scratch for a call of t tokens (kmax: the longest row of values); 0, or -4 when memory runs out (what
   was allocated stays for moe_scratch_free) */
static int moe_scratch_init(moe_scratch *s, const moe_ways *w, const moe_bufs *m, int64_t t, int64_t kmax) {
    memset(s, 0, sizeof *s);
    s->buf = (float *)malloc(sizeof(float) * (size_t)kmax);
    /* qw_run's panel, for runs of more than QW_FEW rows: a group has at most t rows (a token takes an expert once) */
    const int panels = w->any16 && t > QW_FEW;
    s->panel = panels ? aligned_alloc(64, qw_panel_bytes(kmax)) : 0;
    int oom = !s->buf || (panels && !s->panel);
#ifdef MLS_A2_ITEMS
    /* the AVX2 panels' (a2_item): the most any panel type takes at kmax values (a signed type's, with its rows) */
    const int a8 = w->a8sg || w->a8su || w->a8sd;
    s->a2 = a8 ? aligned_alloc(32, a2_panel_bytes(MLS_IQ4_XS, kmax)) : 0;
    oom |= a8 && !s->a2;
#endif
#ifdef MLS_AMX
    /* the int8 tiles' items: a group or the shared rows have at most t rows, ceil(t / 16) packs */
    const amx_call_t c8[5] = {m->c8gu, m->c8dn, m->c8sg, m->c8su, m->c8sd};
    const int t8[5] = {w->t8gu, w->t8dn, w->t8sg, w->t8su, w->t8sd};
    amx_call_t used[5];
    int nused = 0;
    for (int i = 0; i < 5; i++)
        if (t8[i]) used[nused++] = c8[i];
    s->mem8 = nused ? amx_thread_alloc(used, nused, (t + AMX_ROWS - 1) / AMX_ROWS, &s->W) : 0;
    oom |= nused && !s->mem8;
#else
    (void)m;
#endif
#ifdef MLS_INT16_TILES
    s->qa = qa_shapes(); /* int16 products of 4+ rows on the tiles (qa_rows) */
#endif
    return oom ? -4 : 0;
}

/* the tiles released where this thread loaded them, its buffers freed */
static void moe_scratch_free(moe_scratch *s) {
#ifdef MLS_AMX
    if (s->cfg.palette) _tile_release();
    free(s->mem8);
#endif
    free(s->buf);
    free(s->panel);
    free(s->a2);
}

/* The phases between the products, each run by every thread of the block's team (their loops shared out, their
   one-thread steps in `omp single`): */

/* the pairs' inputs xs (x's rows in expert order) and the gate_up inputs' int16 / int8 codes */
static void moe_inputs(const mls_moe_block_t *b, const moe_ways *w, const float *x, int64_t t, const moe_bufs *m) {
    const int64_t d = b->d, kk = b->kk, pairs = t * kk;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs; q++) memcpy(m->xs + q * d, x + (m->order[q] / kk) * d, sizeof(float) * (size_t)d);
    if (w->q16gu || w->q16sg || w->q16su) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs + t; i++) {
            if (i < pairs && w->q16gu)
                qw_quantize_rows(m->xs + i * d, 1, d, d, m->xs16 + i * d, m->xs16d + i * (d / 32));
            if (i >= pairs && (w->q16sg || w->q16su))
                qw_quantize_rows(x + (i - pairs) * d, 1, d, d, m->x16 + (i - pairs) * d, m->x16d + (i - pairs) * (d / 32));
        }
    }
#ifdef MLS_INT16_TILES
    const int64_t all[2] = {0, t}, first = 0; /* the shared expert's rows: one group */
    if (m->xa_h) qa_pack_groups(m->x16, m->x16d, all, &first, 1, d, m->xa_h, m->xa_l, m->xa_d);
    if (m->pa) {
#pragma omp single
        tile_offsets(m->start, m->groups, QA_MIN_ROWS, m->pa);
    }
    if (m->ra_h) qa_pack_groups(m->xs16, m->xs16d, m->start, m->pa, m->groups, d, m->ra_h, m->ra_l, m->ra_d);
#endif
    if (w->any8) {
#pragma omp single
        {
            moe_quantize_inputs(b, w, x, t, m);
#ifdef MLS_AMX
            if (m->pk) tile_offsets(m->start, m->groups, m->pk_rows, m->pk);
            if (w->anyt8) moe_tile_pack(w, t, m, 0);
#endif
        }
    }
}

/* h = silu(gate) * up of every pair and of the shared expert, then the down inputs' int16 / int8 codes */
static void moe_hidden(const mls_moe_block_t *b, const moe_ways *w, int64_t t, const moe_bufs *m) {
    const int64_t inter = b->inter, si = b->shared_inter, pairs = t * b->kk, n_gu = 2 * inter, n_sgu = 2 * si;
    const float limit = (float)b->limit; /* INFINITY: the plain SwiGLU, bit for bit */
#pragma omp for schedule(static)
    for (int64_t it = 0; it < pairs * inter + t * si; it++) {
        if (it < pairs * inter) {
            const int64_t q = it / inter, i = it % inter;
            m->h[it] = silu_mul_clamped(m->gu[q * n_gu + i], m->gu[q * n_gu + inter + i], limit);
        } else {
            const int64_t j = it - pairs * inter, tok = j / si, i = j % si;
            m->sh[j] = silu_mul_clamped(m->sgu[tok * n_sgu + i], m->sgu[tok * n_sgu + si + i], limit);
        }
    }
    if (w->q16dn || w->q16sd) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs + t; i++) {
            if (i < pairs && w->q16dn)
                qw_quantize_rows(m->h + i * inter, 1, inter, inter, m->h16 + i * inter, m->h16d + i * (inter / 32));
            if (i >= pairs && w->q16sd)
                qw_quantize_rows(m->sh + (i - pairs) * si, 1, si, si, m->sh16 + (i - pairs) * si,
                                 m->sh16d + (i - pairs) * (si / 32));
        }
    }
#ifdef MLS_INT16_TILES
    const int64_t all[2] = {0, t}, first = 0; /* the shared expert's rows: one group */
    if (m->sa_h) qa_pack_groups(m->sh16, m->sh16d, all, &first, 1, si, m->sa_h, m->sa_l, m->sa_d);
    if (m->rh_h) qa_pack_groups(m->h16, m->h16d, m->start, m->pa, m->groups, inter, m->rh_h, m->rh_l, m->rh_d);
#endif
    if (w->qdn || w->qsd) {
#pragma omp single
        {
            moe_quantize_hidden(b, w, t, m);
#ifdef MLS_AMX
            if (w->anyt8) moe_tile_pack(w, t, m, 1);
#endif
        }
    }
}

/* out = each token's routed outputs weighted in its pairs' order, plus the shared expert's */
static void moe_sum(const mls_moe_block_t *b, int64_t t, const moe_bufs *m, float *out) {
    const int64_t d = b->d, kk = b->kk;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < t * d; it++) {
        const int64_t tok = it / d, r = it % d;
        float acc = 0.0f;
        for (int64_t j = 0; j < kk; j++) acc += m->wt[tok * kk + j] * m->ys[m->pos[tok * kk + j] * d + r];
        out[it] = b->shared_inter ? acc + m->ysh[it] : acc;
    }
}

/* The products' items (it = 0 .. n - 1) of a call of `tokens` tokens shared out over the team. One token (batch-1
   decode): static, each thread one contiguous range of the items, so it reads its rows as one stream (the prefetch
   runs on from row to row); dynamic chunks of 4 items (32 rows) broke each thread's stream every 36 KB (2048-wide
   Q4_K rows) and took 1.25 ms more of a 12-13 ms batch-1 step of the ds-real Q4_K_M file (gate_up 3.6 -> 2.8 ms,
   down 2.7 -> 2.3 ms over its 3 MoE layers; 2-core AMD EPYC, 2 threads). More tokens: guided, each chunk the items
   left over the threads, down to one, so each thread still reads long runs first while the last items go to
   whichever thread is free: a 16-request step's groups have 1-6 pairs each and its shared expert runs on the tiles,
   so the items' costs differ, and the two threads' pace differs too (a 16-request step of ds-real Q4_K_M 75.3-76.6
   -> 73.0-75.3 ms, of the standard Q4_K_M 44.4-46.2 -> 43.0-45.2, glm-real Q4_K_M and ds-real Q8_0 level; alternated
   pairs, the AMX Xeon, 2 threads). The same bits either way: an item's result does not depend on the thread that
   makes it. */
#define MOE_ITEMS(tokens, n, item)                                                                                   \
    do {                                                                                                             \
        const int64_t n_items_ = (n);                                                                                \
        if ((tokens) == 1) {                                                                                         \
            _Pragma("omp for schedule(static)") for (int64_t it = 0; it < n_items_; it++) item;                      \
        } else {                                                                                                     \
            _Pragma("omp for schedule(guided)") for (int64_t it = 0; it < n_items_; it++) item;                      \
        }                                                                                                            \
    } while (0)

/* x [T, D] (the post-attention norm's output, contiguous) -> out [T, D]; topk_w / topk_idx [T, kk] (may be 0)
   receive the routing. Returns mls_moe_route's -3 for router settings it refuses, -1 for a weight type without
   a decoder, -2 for rows longer than MAX_K, -4 when memory cannot be allocated. */
int mls_moe_block(const mls_moe_block_t *b, const float *x, int64_t t, const int64_t *ids, float *out, float *topk_w,
                  int64_t *topk_idx, int threads) {
    const int64_t d = b->d, e = b->e, kk = b->kk, inter = b->inter, si = b->shared_inter;
    const int64_t pairs = t * kk, n_gu = 2 * inter, n_sgu = 2 * si;
    const int64_t kmax = d > inter ? (d > si ? d : si) : (inter > si ? inter : si);
    moe_ways w;
    int rc = moe_ways_of(b, t, &w);
    if (rc != 0) return rc;
    moe_bufs m;
    if (moe_bufs_alloc(b, &w, t, &m) != 0) return -4;
    int oom = 0;
#pragma omp parallel num_threads(threads)
    {
        moe_scratch s;
        if (moe_scratch_init(&s, &w, &m, t, kmax)) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * e; it++) m.logits[it] = dot(b->gate_w + (it % e) * d, x + (it / e) * d, d);
#pragma omp single
        rc = moe_route_pairs(b, t, ids, &m);
        if (rc == 0 && !oom) { /* oom: set before the logits' barrier, so every thread reads the same */
            moe_inputs(b, &w, x, t, &m);
            /* gate_up: items of ROW_RUN rows of an active expert (all of its pairs), then of the shared expert
               (MOE_ITEMS: static at one token, guided at more). */
            const int64_t rgu = w.q16gu || w.r16gu || w.t8gu ? QW_R : ROW_RUN;
            const int64_t rsg =
                w.q16sg || w.q16su || w.r16sg || w.r16su || w.t8sg || w.t8su || w.a8sg || w.a8su ? QW_R : ROW_RUN;
            const int64_t runs = (n_gu + rgu - 1) / rgu, sruns = (n_sgu + rsg - 1) / rsg;
            MOE_ITEMS(t, m.groups * runs + sruns, moe_gate_up_item(b, &w, &m, x, t, it, runs, rgu, rsg, &s));
            moe_hidden(b, &w, t, &m);
            const int64_t rdn = w.q16dn || w.q16sd || w.r16dn || w.r16sd || w.t8dn || w.t8sd || w.a8sd ? QW_R : ROW_RUN;
            const int64_t druns = (d + rdn - 1) / rdn;
            const int64_t sdruns = si ? druns : 0;
            MOE_ITEMS(t, m.groups * druns + sdruns, moe_down_item(b, &w, &m, t, it, druns, rdn, &s));
            moe_sum(b, t, &m, out);
        }
        moe_scratch_free(&s);
    }
    if (oom) rc = -4;
    if (rc == 0 && topk_w) memcpy(topk_w, m.wt, sizeof(float) * (size_t)pairs);
    if (rc == 0 && topk_idx) memcpy(topk_idx, m.idx, sizeof(int64_t) * (size_t)pairs);
    moe_bufs_free(&m);
    return rc;
}

/* ------------------------------------------------ the MoE block at decode: what a call decides and prepares
   Before the block's products (moe/block.c): how each of its five projections runs (moe_ways, from the types and the
   activation setting), the call's buffers (moe_bufs), the routing and the pairs sorted by expert, and the inputs'
   int8 / int16 codes and their packs for the pair kernels and the tiles. */

/* How each of the block's five projections (routed gate_up and down, shared gate, up and down) runs its products,
   decided once per call from the types and the activation setting, as the per-op path decides them (GGUFExperts'
   grouped products, the shared GGUFLinears) */
typedef struct {
    lin_kernel kgu, kdn, ksg, ksu, ksd; /* float activations: the types' row kernels */
    scaled_fused_fn fgu, fdn;           /* routed types whose scales lie apart (INT4): their decode-and-dot */
    /* int8 activations: each projection whose type has int8 kernels under the block's setting (q8rows_in), on its
       own; each quantizes its input in its type's form (shared gate and up each their own copy of x) */
    q8rows_fn qgu, qdn, qsg, qsu, qsd;
    /* int16 activations (x86/int16_prefill.c) where the setting gives them to the type (qw_in): runs of 16 rows of
       one part, the inputs' codes made once for every type */
    int q16gu, q16dn, q16sg, q16su, q16sd;
    /* int8 projections of a type whose one-row products take 16 weight rows side by side (rows16_q8k, the row
       kernels' bits): runs of 16 rows, taken so where the run's group (or the step) has one row, and for Q4_K /
       Q5_K at 2-3 (AVX-512) or 2-7 (AVX2) (rows16_q8k_rows: the rows share each weight row's unpacking) */
    int r16gu, r16dn, r16sg, r16su, r16sd;
    /* Q4_0 projections whose groups (or the shared expert) have 2+ rows: two activation rows per vector over pairs
       of weight rows (int8.c q4_0_pairs_run, the row kernel's bits), the activations packed as pairs once */
    int two_gu, two_dn, two_sg, two_su, two_sd;
    /* int8 projections of a type the AMX-INT8 tiles take (x86/amx.c amx_item, the VNNI row kernels' bits): the
       shared expert's where the step has amx_min_rows tokens, a routed group's where it has that many pairs; each
       16-row run's weight rows unpacked once for all of its activation rows, where the row kernels take them 4 at a
       time (a 16-token step's shared expert read its rows at ~2.5 GB/s of Q4_K on the AMX Xeon) */
    int t8gu, t8dn, t8sg, t8su, t8sd;
    /* the shared expert's int8 projections of a panel type at 8+ tokens where the build has the AVX2 panels
       (x86/avx2_panels.c a2_item: each 8-row panel unpacked once for every token, the row kernels' bits; the row
       kernels take 4 tokens a pass and unpack each row 4 times at 16 tokens: its Q4_K 512 x 1024 alone 0.123 ->
       0.089 ms at 16 rows, 2 threads, the AVX2 EPYC); 0 in other builds */
    int a8sg, a8su, a8sd;
    int any8, any16, any2, anyt8;
} moe_ways;

/* the ways of a call of t tokens; 0, or mls_moe_block's refusals (-1, -2, -3) */
static int moe_ways_of(const mls_moe_block_t *b, int64_t t, moe_ways *w) {
    const int64_t d = b->d, e = b->e, kk = b->kk, inter = b->inter, si = b->shared_inter, g = b->group;
    w->kgu = lin_rows(b->type_gu, b->gu_row_bytes), w->kdn = lin_rows(b->type_dn, b->dn_row_bytes);
    /* without a shared expert its kernels are never called: F32 rows stand in so the check below passes */
    w->ksg = lin_rows(si ? b->type_sg : MLS_F32, b->sg_row_bytes);
    w->ksu = lin_rows(si ? b->type_su : MLS_F32, b->su_row_bytes);
    w->ksd = lin_rows(si ? b->type_sd : MLS_F32, b->sd_row_bytes);
    w->fgu = b->gu_scale ? type_of((int)b->type_gu)->fused_scaled : 0;
    w->fdn = b->dn_scale ? type_of((int)b->type_dn)->fused_scaled : 0;
    if ((!w->kgu.fn && !w->fgu) || (!w->kdn.fn && !w->fdn) || !w->ksg.fn || !w->ksu.fn || !w->ksd.fn) return -1;
    if (d > MAX_K || inter > MAX_K || si > MAX_K) return -2;
    if ((w->fgu || w->fdn) && (g < 32 || g % 32 || d % g || inter % g)) return -2;
    if (e < 1 || e > 1024 || kk < 1 || kk > e) return -3;
    const int64_t i8 = b->int8;
    w->qgu = q8rows_in((int)b->type_gu, i8), w->qdn = q8rows_in((int)b->type_dn, i8);
    w->qsg = si ? q8rows_in((int)b->type_sg, i8) : 0, w->qsu = si ? q8rows_in((int)b->type_su, i8) : 0;
    w->qsd = si ? q8rows_in((int)b->type_sd, i8) : 0;
    if ((w->qgu && !act_fits((int)b->type_gu, d)) || (w->qdn && !act_fits((int)b->type_dn, inter)) ||
        (w->qsg && !act_fits((int)b->type_sg, d)) || (w->qsu && !act_fits((int)b->type_su, d)) ||
        (w->qsd && !act_fits((int)b->type_sd, si)))
        return -2;
    w->any8 = w->qgu || w->qdn || w->qsg || w->qsu || w->qsd;
    w->q16gu = !w->fgu && qw_in((int)b->type_gu, i8), w->q16dn = !w->fdn && qw_in((int)b->type_dn, i8);
    w->q16sg = si && qw_in((int)b->type_sg, i8), w->q16su = si && qw_in((int)b->type_su, i8);
    w->q16sd = si && qw_in((int)b->type_sd, i8);
    w->any16 = w->q16gu || w->q16dn || w->q16sg || w->q16su || w->q16sd;
    w->r16gu = w->qgu && rows16_takes((int)b->type_gu), w->r16dn = w->qdn && rows16_takes((int)b->type_dn);
    w->r16sg = w->qsg && rows16_takes((int)b->type_sg), w->r16su = w->qsu && rows16_takes((int)b->type_su);
    w->r16sd = w->qsd && rows16_takes((int)b->type_sd);
    w->two_gu = w->qgu && Q4_0_PAIRS((int)b->type_gu, t), w->two_dn = w->qdn && Q4_0_PAIRS((int)b->type_dn, t);
    w->two_sg = w->qsg && Q4_0_PAIRS((int)b->type_sg, t), w->two_su = w->qsu && Q4_0_PAIRS((int)b->type_su, t);
    w->two_sd = w->qsd && Q4_0_PAIRS((int)b->type_sd, t);
    w->any2 = w->two_gu || w->two_dn || w->two_sg || w->two_su || w->two_sd;
#ifdef MLS_AMX
    /* a group has at most t pairs (a token takes an expert once): groups of amx_min_rows need t that large */
    w->t8gu = w->qgu && amx_takes((int)b->type_gu, t), w->t8dn = w->qdn && amx_takes((int)b->type_dn, t);
    w->t8sg = w->qsg && amx_takes((int)b->type_sg, t), w->t8su = w->qsu && amx_takes((int)b->type_su, t);
    w->t8sd = w->qsd && amx_takes((int)b->type_sd, t);
#else
    w->t8gu = w->t8dn = w->t8sg = w->t8su = w->t8sd = 0;
#endif
    w->anyt8 = w->t8gu || w->t8dn || w->t8sg || w->t8su || w->t8sd;
#ifdef MLS_A2_ITEMS
    w->a8sg = w->qsg && int8_panels_min_rows((int)b->type_sg) && t >= int8_panels_min_rows((int)b->type_sg);
    w->a8su = w->qsu && int8_panels_min_rows((int)b->type_su) && t >= int8_panels_min_rows((int)b->type_su);
    w->a8sd = w->qsd && int8_panels_min_rows((int)b->type_sd) && t >= int8_panels_min_rows((int)b->type_sd);
#else
    w->a8sg = w->a8su = w->a8sd = 0;
#endif
    return 0;
}

/* A call's buffers (three allocations: floats and ints, the int16 codes, the packed pairs) and the routing the
   call makes: the active experts act[0 .. groups), their pairs start[a] .. start[a + 1) in xs, pair q's token
   order[q] / kk, pair p's place pos[p] */
typedef struct {
    char *mem, *mem16;
    int64_t *idx, *count, *start, *act, *order, *pos, groups;
    /* logits, routing weights, xs (pairs sorted by expert), gate_up outputs, h, down outputs, and the shared
       expert's three */
    float *logits, *wt, *xs, *gu, *h, *ys, *sgu, *sh, *ysh;
    /* int8 codes and scales of xs, h, x (for the shared gate), the shared h and x (for the shared up) */
    float *xsd, *hd, *xd, *shd, *xud;
    int8_t *xsq, *hq, *xq, *shq, *xuq;
    /* int16 codes and scales: xs, x (shared gate and up), h, the shared h (rows of whole 32-value blocks) */
    float *xs16d, *x16d, *h16d, *sh16d;
    int16_t *xs16, *x16, *h16, *sh16;
    /* the packed pairs: routed groups' chunks of 16 rows (at most one partial chunk per group), the shared rows';
       in chunk-blocks: routed gate/up input (d) at 0, routed down input (inter) at o_dn, shared x for gate at
       o_sg, for up at o_su, shared h at o_sd; off2[a] group a's chunk offset */
    int8_t *xp2;
    float *dt2;
    int64_t *off2, o_dn, o_sg, o_su, o_sd;
    /* the shared expert's int16 inputs (x; its h) packed for the int16 tile products (x86/amx_int16.c qa_pack), where
       its gate or up (down) takes them: the bytes' halves and the scales, one allocation each side */
    int32_t *xa_h, *xa_l, *sa_h, *sa_l;
    float *xa_d, *sa_d;
    /* the shared projections on the AVX2 panels (moe_ways a8*): their inputs' code sums by pairs (a2_sums16, Q6_K's
       term), one allocation */
    int32_t *xpa, *xpsg, *xpsu, *xpsd;
    /* the same for the routed groups of QA_MIN_ROWS pairs or more (xs for gate / up, h for down): group a's first
       packed row pa[a] (-1: its rows stay on qw_run), groups padded to 16 rows; room for the most such groups */
    int64_t *pa;
    int32_t *ra_h, *ra_l, *rh_h, *rh_l;
    float *ra_d, *rh_d;
#ifdef MLS_AMX
    /* the int8 products on the tiles (moe_ways t8*): each projection's call, its inputs' packs (x86/amx.c amx_pack,
       one allocation p8): the shared gate's and up's (x, each in its type's codes), the shared down's (the shared
       h), the routed groups' gate_up (xs) and down (h) inputs; pk[a] routed group a's first packed row
       (tile_offsets: its first pack pk[a] / 16; -1: its rows stay on the row kernels) */
    amx_call_t c8gu, c8dn, c8sg, c8su, c8sd;
    int32_t *p8, *p8sg, *p8su, *p8sd, *p8gu, *p8dn;
    int64_t *pk, pk_rows;
#endif
} moe_bufs;

static void moe_bufs_free(moe_bufs *m) {
    free(m->mem), free(m->mem16), free(m->xp2), free(m->dt2), free(m->off2), free(m->xa_h), free(m->sa_h);
    free(m->pa), free(m->ra_h), free(m->rh_h), free(m->xpa);
#ifdef MLS_AMX
    free(m->p8), free(m->pk);
#endif
}

#ifdef MLS_AMX
/* the int8 tile products' calls and packs (m->c8*, p8*, pk); 0, or -4 out of memory */
static int moe_tiles_alloc(const mls_moe_block_t *b, const moe_ways *w, int64_t t, moe_bufs *m) {
    const int64_t d = b->d, inter = b->inter, si = b->shared_inter, pairs = t * b->kk;
    if (w->t8gu) m->c8gu = amx_call_of((int)b->type_gu, d, b->gu_row_bytes, 2 * inter);
    if (w->t8dn) m->c8dn = amx_call_of((int)b->type_dn, inter, b->dn_row_bytes, d);
    if (w->t8sg) m->c8sg = amx_call_of((int)b->type_sg, d, b->sg_row_bytes, 2 * si);
    if (w->t8su) m->c8su = amx_call_of((int)b->type_su, d, b->su_row_bytes, 2 * si);
    if (w->t8sd) m->c8sd = amx_call_of((int)b->type_sd, si, b->sd_row_bytes, d);
    /* packs: the shared rows' ceil(t / 16); routed groups of pk_rows pairs or more, at most pairs / pk_rows of them,
       each ceil(rows / 16) <= rows / pk_rows packs (pk_rows <= 16) */
    const int64_t sp = (t + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t mgu = w->t8gu ? amx_min_rows((int)b->type_gu) : 0, mdn = w->t8dn ? amx_min_rows((int)b->type_dn) : 0;
    m->pk_rows = mgu > mdn ? mgu : mdn; /* a group on the tiles has as many as both projections' types ask */
    const int64_t rp = m->pk_rows ? pairs / m->pk_rows + 1 : 0;
    const size_t n_sg = w->t8sg ? (size_t)sp * m->c8sg.per_group : 0, n_su = w->t8su ? (size_t)sp * m->c8su.per_group : 0;
    const size_t n_sd = w->t8sd ? (size_t)sp * m->c8sd.per_group : 0, n_gu = w->t8gu ? (size_t)rp * m->c8gu.per_group : 0;
    const size_t n_dn = w->t8dn ? (size_t)rp * m->c8dn.per_group : 0, n8 = n_sg + n_su + n_sd + n_gu + n_dn;
    m->p8 = (int32_t *)aligned_alloc(64, (n8 * sizeof(int32_t) + 63) / 64 * 64);
    m->pk = w->t8gu || w->t8dn ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(b->e + 1)) : 0;
    if (!m->p8 || ((w->t8gu || w->t8dn) && !m->pk)) return -4;
    m->p8sg = m->p8, m->p8su = m->p8sg + n_sg, m->p8sd = m->p8su + n_su, m->p8gu = m->p8sd + n_sd, m->p8dn = m->p8gu + n_gu;
    return 0;
}
#endif

/* 0, or -4 when memory cannot be allocated (nothing left allocated) */
static int moe_bufs_alloc(const mls_moe_block_t *b, const moe_ways *w, int64_t t, moe_bufs *m) {
    const int64_t d = b->d, e = b->e, inter = b->inter, si = b->shared_inter, pairs = t * b->kk;
    const int64_t n_gu = 2 * inter, n_sgu = 2 * si;
    memset(m, 0, sizeof(*m));
    const size_t nf = (size_t)(t * e + pairs + pairs * d + pairs * n_gu + pairs * inter + pairs * d + t * n_sgu +
                               t * si + t * d);
    const size_t ni = (size_t)(pairs + e + (e + 1) + e + pairs + pairs);
    const size_t nq = w->any8 ? (size_t)(pairs * d + pairs * inter + t * d + t * si + t * d) : 0;
    m->mem = (char *)malloc(sizeof(float) * nf + sizeof(int64_t) * ni + nq * (1 + sizeof(float)) + 64);
    const size_t n16 = w->any16 ? (size_t)(pairs * d + t * d + pairs * inter + t * si) : 0;
    m->mem16 = w->any16 ? (char *)malloc(n16 / 32 * sizeof(float) + n16 * sizeof(int16_t) + 64) : 0;
    const int64_t rchunks = (pairs < e ? pairs : e) + pairs / 16 + 1, schunks = (t + 15) / 16;
    const size_t n2 = w->any2 ? (size_t)(rchunks * (d + inter) + schunks * (2 * d + si)) / 32 : 0; /* chunk-blocks */
    m->xp2 = w->any2 ? (int8_t *)aligned_alloc(64, n2 * 8 * 64) : 0;
    m->dt2 = w->any2 ? (float *)malloc(sizeof(float) * n2 * 16) : 0;
    m->off2 = w->any2 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(e + 1)) : 0;
    const int tiles_x = (w->q16sg && qa_takes((int)b->type_sg, t)) || (w->q16su && qa_takes((int)b->type_su, t));
    const int tiles_h = w->q16sd && qa_takes((int)b->type_sd, t);
    /* a group has at most t pairs (a token takes an expert once): groups of QA_MIN_ROWS need t that large */
    const int tiles_gu = w->q16gu && qa_takes((int)b->type_gu, t), tiles_dn = w->q16dn && qa_takes((int)b->type_dn, t);
    const int64_t most_packed = pairs + 15 * (pairs / QA_MIN_ROWS); /* that many groups at most, each padded */
    m->pa = tiles_gu || tiles_dn ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(e + 1)) : 0;
    const int any_a8 = w->a8sg || w->a8su || w->a8sd;
    m->xpa = any_a8 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(t * (2 * d + si) / 32) + 1) : 0;
    if (!m->mem || (any_a8 && !m->xpa) || (w->any16 && !m->mem16) || (w->any2 && (!m->xp2 || !m->dt2 || !m->off2)) ||
        (tiles_x && qa_alloc(t, d, &m->xa_h, &m->xa_l, &m->xa_d)) ||
        (tiles_h && qa_alloc(t, si, &m->sa_h, &m->sa_l, &m->sa_d)) || ((tiles_gu || tiles_dn) && !m->pa) ||
        (tiles_gu && qa_alloc(most_packed, d, &m->ra_h, &m->ra_l, &m->ra_d)) ||
        (tiles_dn && qa_alloc(most_packed, inter, &m->rh_h, &m->rh_l, &m->rh_d))
#ifdef MLS_AMX
        || (w->anyt8 && moe_tiles_alloc(b, w, t, m))
#endif
    ) {
        moe_bufs_free(m);
        return -4;
    }
    m->idx = (int64_t *)m->mem, m->count = m->idx + pairs, m->start = m->count + e, m->act = m->start + e + 1;
    m->order = m->act + e, m->pos = m->order + pairs;
    m->logits = (float *)(m->pos + pairs), m->wt = m->logits + t * e, m->xs = m->wt + pairs, m->gu = m->xs + pairs * d;
    m->h = m->gu + pairs * n_gu, m->ys = m->h + pairs * inter, m->sgu = m->ys + pairs * d, m->sh = m->sgu + t * n_sgu;
    m->ysh = m->sh + t * si;
    m->xsd = m->ysh + t * d, m->hd = m->xsd + pairs * d / 32, m->xd = m->hd + pairs * inter / 32;
    m->shd = m->xd + t * d / 32, m->xud = m->shd + t * si / 32;
    m->xsq = (int8_t *)(m->xud + t * d / 32), m->hq = m->xsq + pairs * d, m->xq = m->hq + pairs * inter;
    m->shq = m->xq + t * d, m->xuq = m->shq + t * si;
    m->xs16d = (float *)m->mem16, m->x16d = m->xs16d + pairs * d / 32, m->h16d = m->x16d + t * d / 32;
    m->sh16d = m->h16d + pairs * inter / 32;
    m->xs16 = (int16_t *)(m->sh16d + t * si / 32), m->x16 = m->xs16 + pairs * d, m->h16 = m->x16 + t * d;
    m->sh16 = m->h16 + pairs * inter;
    m->o_dn = rchunks * d / 32, m->o_sg = m->o_dn + rchunks * inter / 32, m->o_su = m->o_sg + schunks * d / 32;
    m->o_sd = m->o_su + schunks * d / 32;
    m->xpsg = m->xpa, m->xpsu = any_a8 ? m->xpsg + t * d / 32 : 0, m->xpsd = any_a8 ? m->xpsu + t * d / 32 : 0;
    return 0;
}

/* The router over the logits, then the pairs sorted by expert (stable: token order within an expert; a counting
   sort) into m's routing; one thread. mls_moe_route's return. */
static int moe_route_pairs(const mls_moe_block_t *b, int64_t t, const int64_t *ids, moe_bufs *m) {
    const int64_t e = b->e, pairs = t * b->kk;
    int64_t *idx = m->idx, *count = m->count, *start = m->start, *act = m->act, groups = 0;
    const int rc = b->tid2eid ? moe_route_hashed(m->logits, t, e, (int)b->scoring, b->tid2eid, b->vocab, ids, b->kk,
                                                 (int)b->norm, (float)b->scale, m->wt, idx)
                              : mls_moe_route(m->logits, t, e, b->bias, (int)b->scoring, (int)b->method, b->n_group,
                                              b->topk_group, b->kk, (int)b->norm, (float)b->scale, m->wt, idx);
    if (rc != 0) return rc;
    memset(count, 0, sizeof(int64_t) * (size_t)e);
    for (int64_t p = 0; p < pairs; p++) count[idx[p]]++;
    int64_t s = 0;
    for (int64_t ex = 0; ex < e; ex++)
        if (count[ex]) {
            act[groups] = ex;
            start[groups++] = s;
            s += count[ex];
        }
    start[groups] = s;
    memset(count, 0, sizeof(int64_t) * (size_t)e); /* now: pairs placed per group */
    for (int64_t p = 0; p < pairs; p++) {
        int64_t a = 0;
        while (act[a] != idx[p]) a++;
        const int64_t q = start[a] + count[a]++;
        m->order[q] = p;
        m->pos[p] = q;
    }
    m->groups = groups;
    return 0;
}

/* where `on`: the AVX2 panels' code sums by pairs (a2_sums16_row) of t rows of k int8 codes into xp [t, k / 32] */
static void moe_panel_sums(int on, const int8_t *xq, int64_t t, int64_t k, int32_t *xp) {
#ifdef MLS_A2_ITEMS
    for (int64_t i = 0; on && i < t; i++) a2_sums16_row(xq + i * k, k, xp + i * (k / 32));
#else
    (void)on, (void)xq, (void)t, (void)k, (void)xp;
#endif
}

/* the int8 codes of the gate_up inputs (xs for the routed gate_up, x for the shared gate and up) and their pairs'
   packs (groups of one row take none); one thread */
static void moe_quantize_inputs(const mls_moe_block_t *b, const moe_ways *w, const float *x, int64_t t,
                                const moe_bufs *m) {
    const int64_t d = b->d, pairs = t * b->kk;
    if (w->qgu) quantize_act((int)b->type_gu, m->xs, pairs, d, d, m->xsq, m->xsd);
    if (w->qsg) quantize_act((int)b->type_sg, x, t, d, d, m->xq, m->xd);
    if (w->qsu) quantize_act((int)b->type_su, x, t, d, d, m->xuq, m->xud);
    moe_panel_sums(w->a8sg && b->type_sg == MLS_Q6_K, m->xq, t, d, m->xpsg);
    moe_panel_sums(w->a8su && b->type_su == MLS_Q6_K, m->xuq, t, d, m->xpsu);
    if (w->any2) { /* each group's chunk offset (groups of one row take none), then the packs */
        m->off2[0] = 0;
        for (int64_t a = 0; a < m->groups; a++) {
            const int64_t rows = m->start[a + 1] - m->start[a];
            m->off2[a + 1] = m->off2[a] + (rows >= 2 ? (rows + 15) / 16 : 0);
        }
    }
    if (w->two_gu) q4_0_pairs_pack_groups(m->xsq, m->xsd, d, m->start, m->groups, m->off2, m->xp2, m->dt2);
    if (w->two_sg) q4_0_pairs_pack(m->xq, m->xd, t, d, m->xp2 + m->o_sg * 512, m->dt2 + m->o_sg * 16);
    if (w->two_su) q4_0_pairs_pack(m->xuq, m->xud, t, d, m->xp2 + m->o_su * 512, m->dt2 + m->o_su * 16);
}

/* the int8 codes of the down inputs (h, the shared h) and their pairs' packs; one thread */
static void moe_quantize_hidden(const mls_moe_block_t *b, const moe_ways *w, int64_t t, const moe_bufs *m) {
    const int64_t inter = b->inter, si = b->shared_inter, pairs = t * b->kk;
    if (w->qdn) quantize_act((int)b->type_dn, m->h, pairs, inter, inter, m->hq, m->hd);
    if (w->qsd) quantize_act((int)b->type_sd, m->sh, t, si, si, m->shq, m->shd);
    moe_panel_sums(w->a8sd && b->type_sd == MLS_Q6_K, m->shq, t, si, m->xpsd);
    if (w->two_dn)
        q4_0_pairs_pack_groups(m->hq, m->hd, inter, m->start, m->groups, m->off2, m->xp2 + m->o_dn * 512,
                               m->dt2 + m->o_dn * 16);
    if (w->two_sd) q4_0_pairs_pack(m->shq, m->shd, t, si, m->xp2 + m->o_sd * 512, m->dt2 + m->o_sd * 16);
}

#ifdef MLS_AMX
/* the int8 tile products' inputs packed: the gate_up inputs (hidden 0) or the down inputs (hidden 1), the shared
   expert's rows and each routed group's on the tiles; one thread, after their codes are made */
static void moe_tile_pack(const moe_ways *w, int64_t t, const moe_bufs *m, int hidden) {
    const int64_t *start = m->start;
    if (!hidden && w->t8sg) amx_pack_rows(&m->c8sg, m->xq, m->xd, t, m->p8sg);
    if (!hidden && w->t8su) amx_pack_rows(&m->c8su, m->xuq, m->xud, t, m->p8su);
    if (hidden && w->t8sd) amx_pack_rows(&m->c8sd, m->shq, m->shd, t, m->p8sd);
    const amx_call_t *c = hidden ? &m->c8dn : &m->c8gu;
    if (!(hidden ? w->t8dn : w->t8gu)) return;
    for (int64_t a = 0; a < m->groups; a++) {
        if (m->pk[a] < 0) continue;
        const int64_t k = c->k, p0 = start[a];
        amx_pack_rows(c, (hidden ? m->hq : m->xsq) + p0 * k, (hidden ? m->hd : m->xsd) + p0 * (k / 32), start[a + 1] - p0,
                      (hidden ? m->p8dn : m->p8gu) + m->pk[a] / 16 * c->per_group);
    }
}
#endif

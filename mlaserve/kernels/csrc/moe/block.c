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

/* x [T, D] (the post-attention norm's output, contiguous) -> out [T, D]; topk_w / topk_idx [T, kk] (may be 0)
   receive the routing. Returns mls_moe_route's -3 for router settings it refuses, -1 for a weight type without
   a decoder, -2 for rows longer than MAX_K, -4 when memory cannot be allocated. */
int mls_moe_block(const mls_moe_block_t *b, const float *x, int64_t t, float *out, float *topk_w, int64_t *topk_idx,
                  int threads) {
    const int64_t d = b->d, e = b->e, kk = b->kk, inter = b->inter, si = b->shared_inter;
    const lin_kernel kgu = lin_rows(b->type_gu, b->gu_row_bytes), kdn = lin_rows(b->type_dn, b->dn_row_bytes);
    /* without a shared expert its kernels are never called: F32 rows stand in so the check below passes */
    const lin_kernel ksg = lin_rows(si ? b->type_sg : MLS_F32, b->sg_row_bytes),
                     ksu = lin_rows(si ? b->type_su : MLS_F32, b->su_row_bytes),
                     ksd = lin_rows(si ? b->type_sd : MLS_F32, b->sd_row_bytes);
    const scaled_fused_fn fgu = b->gu_scale ? type_of((int)b->type_gu)->fused_scaled : 0;
    const scaled_fused_fn fdn = b->dn_scale ? type_of((int)b->type_dn)->fused_scaled : 0;
    if ((!kgu.fn && !fgu) || (!kdn.fn && !fdn) || !ksg.fn || !ksu.fn || !ksd.fn) return -1;
    if (d > MAX_K || inter > MAX_K || si > MAX_K) return -2;
    const int64_t g = b->group;
    if ((fgu || fdn) && (g < 32 || g % 32 || d % g || inter % g)) return -2;
    if (e < 1 || e > 1024 || kk < 1 || kk > e) return -3;
    /* int8 activations where the per-op path takes them: each projection whose type has int8 kernels under the
       block's setting (q8rows_in), on its own, as GGUFExperts' grouped products and the shared GGUFLinears
       decide; each quantizes its input in its type's form (shared gate and up each their own copy of x) */
    const int64_t i8 = b->int8;
    const q8rows_fn qgu = q8rows_in((int)b->type_gu, i8), qdn = q8rows_in((int)b->type_dn, i8);
    const q8rows_fn qsg = si ? q8rows_in((int)b->type_sg, i8) : 0, qsu = si ? q8rows_in((int)b->type_su, i8) : 0;
    const q8rows_fn qsd = si ? q8rows_in((int)b->type_sd, i8) : 0;
    if ((qgu && !act_fits((int)b->type_gu, d)) || (qdn && !act_fits((int)b->type_dn, inter)) ||
        (qsg && !act_fits((int)b->type_sg, d)) || (qsu && !act_fits((int)b->type_su, d)) ||
        (qsd && !act_fits((int)b->type_sd, si)))
        return -2;
    const int any8 = qgu || qdn || qsg || qsu || qsd;
    /* int16 activations (x86/int16_prefill.c) for the projections whose type the setting gives them (qw_in), as the
       per-op path's grouped products: runs of 16 rows of one part, the inputs' codes made once for every type */
    const int q16gu = !fgu && qw_in((int)b->type_gu, i8), q16dn = !fdn && qw_in((int)b->type_dn, i8);
    const int q16sg = si && qw_in((int)b->type_sg, i8), q16su = si && qw_in((int)b->type_su, i8);
    const int q16sd = si && qw_in((int)b->type_sd, i8), any16 = q16gu || q16dn || q16sg || q16su || q16sd;
    /* int8 projections of a type whose one-row products take 16 weight rows side by side (rows16_q8k, the row
       kernels' bits): runs of 16 rows, taken so where the run's group (or the step) has one row */
    const int r16gu = qgu && rows16_takes((int)b->type_gu), r16dn = qdn && rows16_takes((int)b->type_dn);
    const int r16sg = qsg && rows16_takes((int)b->type_sg), r16su = qsu && rows16_takes((int)b->type_su);
    const int r16sd = qsd && rows16_takes((int)b->type_sd);
    /* Q4_0 projections whose groups (or the shared expert) have 2+ rows: two activation rows per vector over pairs of
       weight rows (int8.c q4_0_pairs_run, the row kernel's bits), the activations packed as pairs once here */
    const int two_gu = qgu && Q4_0_PAIRS((int)b->type_gu, t), two_dn = qdn && Q4_0_PAIRS((int)b->type_dn, t);
    const int two_sg = qsg && Q4_0_PAIRS((int)b->type_sg, t), two_su = qsu && Q4_0_PAIRS((int)b->type_su, t);
    const int two_sd = qsd && Q4_0_PAIRS((int)b->type_sd, t);
    const int64_t pairs = t * kk, n_gu = 2 * inter, n_sgu = 2 * si;
    /* one allocation: logits, weights, ids, per-expert counts / starts / ids, pair order and position,
       xs (pairs sorted by expert), gate_up outputs, h, down outputs, and the shared expert's three */
    const size_t nf = (size_t)(t * e + pairs + pairs * d + pairs * n_gu + pairs * inter + pairs * d + t * n_sgu +
                               t * si + t * d);
    const size_t ni = (size_t)(pairs + e + (e + 1) + e + pairs + pairs);
    /* int8 codes and scales of xs, h, x (for the shared gate), the shared h and x (for the shared up) (allocated
       only with int8) */
    const size_t nq = any8 ? (size_t)(pairs * d + pairs * inter + t * d + t * si + t * d) : 0;
    char *mem = (char *)malloc(sizeof(float) * nf + sizeof(int64_t) * ni + nq * (1 + sizeof(float)) + 64);
    if (!mem) return -4;
    int64_t *idx = (int64_t *)mem, *count = idx + pairs, *start = count + e, *act = start + e + 1;
    int64_t *order = act + e, *pos = order + pairs;
    float *logits = (float *)(pos + pairs), *wt = logits + t * e, *xs = wt + pairs, *gu = xs + pairs * d;
    float *h = gu + pairs * n_gu, *ys = h + pairs * inter, *sgu = ys + pairs * d, *sh = sgu + t * n_sgu;
    float *ysh = sh + t * si;
    float *xsd = ysh + t * d, *hd = xsd + pairs * d / 32, *xd = hd + pairs * inter / 32, *shd = xd + t * d / 32;
    float *xud = shd + t * si / 32;
    int8_t *xsq = (int8_t *)(xud + t * d / 32), *hq = xsq + pairs * d, *xq = hq + pairs * inter, *shq = xq + t * d;
    int8_t *xuq = shq + t * si;
    /* their scales and codes: xs, x (shared gate and up), h, the shared h (rows of whole 32-value blocks) */
    const size_t n16 = any16 ? (size_t)(pairs * d + t * d + pairs * inter + t * si) : 0;
    char *mem16 = any16 ? (char *)malloc(n16 / 32 * sizeof(float) + n16 * sizeof(int16_t) + 64) : 0;
    if (any16 && !mem16) {
        free(mem);
        return -4;
    }
    float *xs16d = (float *)mem16, *x16d = xs16d + pairs * d / 32, *h16d = x16d + t * d / 32;
    float *sh16d = h16d + pairs * inter / 32;
    int16_t *xs16 = (int16_t *)(sh16d + t * si / 32), *x16 = xs16 + pairs * d, *h16 = x16 + t * d;
    int16_t *sh16 = h16 + pairs * inter;
    const int64_t kmax = d > inter ? (d > si ? d : si) : (inter > si ? inter : si);
    /* the packed pairs: routed groups' chunks of 16 rows (at most one partial chunk per group), the shared rows' */
    const int64_t rchunks = (pairs < e ? pairs : e) + pairs / 16 + 1, schunks = (t + 15) / 16;
    const int any2 = two_gu || two_dn || two_sg || two_su || two_sd;
    const size_t n2 = any2 ? (size_t)(rchunks * (d + inter) + schunks * (2 * d + si)) / 32 : 0; /* chunk-blocks */
    int8_t *xp2 = any2 ? (int8_t *)aligned_alloc(64, n2 * 8 * 64) : 0;
    float *dt2 = any2 ? (float *)malloc(sizeof(float) * n2 * 16) : 0;
    int64_t *off2 = any2 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(e + 1)) : 0;
    if (any2 && (!xp2 || !dt2 || !off2)) {
        free(xp2), free(dt2), free(off2), free(mem), free(mem16);
        return -4;
    }
    /* in chunk-blocks: routed gate/up input (d), routed down input (inter), shared x for gate, for up, shared h */
    const int64_t o_dn = rchunks * d / 32, o_sg = o_dn + rchunks * inter / 32, o_su = o_sg + schunks * d / 32;
    const int64_t o_sd = o_su + schunks * d / 32;
    int64_t groups = 0;
    int rc = 0, oom = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)kmax);
        /* qw_run's panel, for runs of more than QW_FEW rows: a group has at most t rows (a token takes an expert once) */
        const int panels = any16 && t > QW_FEW;
        void *panel = panels ? aligned_alloc(64, qw_panel_bytes(kmax)) : 0;
        if (panels && !panel) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < t * e; it++) logits[it] = dot(b->gate_w + (it % e) * d, x + (it / e) * d, d);
#pragma omp single
        {
            rc = mls_moe_route(logits, t, e, b->bias, (int)b->scoring, (int)b->method, b->n_group, b->topk_group, kk,
                               (int)b->norm, (float)b->scale, wt, idx);
            if (rc == 0) { /* pairs sorted by expert (stable: token order within an expert), a counting sort */
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
                    order[q] = p;
                    pos[p] = q;
                }
            }
        }
        if (rc == 0 && !oom) { /* oom: set before the logits' barrier, so every thread reads the same */
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; q++) memcpy(xs + q * d, x + (order[q] / kk) * d, sizeof(float) * (size_t)d);
            if (q16gu || q16sg || q16su) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < pairs + t; i++) {
                    if (i < pairs && q16gu) qw_quantize_rows(xs + i * d, 1, d, d, xs16 + i * d, xs16d + i * (d / 32));
                    if (i >= pairs && (q16sg || q16su))
                        qw_quantize_rows(x + (i - pairs) * d, 1, d, d, x16 + (i - pairs) * d, x16d + (i - pairs) * (d / 32));
                }
            }
            if (any8) {
#pragma omp single
                {
                    if (qgu) quantize_act((int)b->type_gu, xs, pairs, d, d, xsq, xsd);
                    if (qsg) quantize_act((int)b->type_sg, x, t, d, d, xq, xd);
                    if (qsu) quantize_act((int)b->type_su, x, t, d, d, xuq, xud);
                    if (any2) { /* each group's chunk offset (groups of one row take none), then the packs */
                        off2[0] = 0;
                        for (int64_t a = 0; a < groups; a++) {
                            const int64_t m = start[a + 1] - start[a];
                            off2[a + 1] = off2[a] + (m >= 2 ? (m + 15) / 16 : 0);
                        }
                    }
                    if (two_gu) q4_0_pairs_pack_groups(xsq, xsd, d, start, groups, off2, xp2, dt2);
                    if (two_sg) q4_0_pairs_pack(xq, xd, t, d, xp2 + o_sg * 512, dt2 + o_sg * 16);
                    if (two_su) q4_0_pairs_pack(xuq, xud, t, d, xp2 + o_su * 512, dt2 + o_su * 16);
                }
            }
            /* gate_up: items of ROW_RUN rows of an active expert (all of its pairs), then of the shared expert.
               Scheduled static: each thread takes one contiguous range of the items, so it reads its rows as one
               stream (the prefetch runs on from row to row); dynamic chunks of 4 items (32 rows) broke each
               thread's stream every 36 KB (2048-wide Q4_K rows) and took 1.25 ms more of a 12-13 ms batch-1 step of the
               ds-real Q4_K_M file (gate_up 3.6 -> 2.8 ms, down 2.7 -> 2.3 ms over its 3 MoE layers; 2-core AMD EPYC,
               2 threads); a 16-request step was level (87 ms either way). The block serves decode steps (at most
               BLOCK_TOKENS tokens), where an item's cost is about the same everywhere. */
            const int64_t rgu = q16gu || r16gu ? QW_R : ROW_RUN, rsg = q16sg || q16su || r16sg || r16su ? QW_R : ROW_RUN;
            const int64_t runs = (n_gu + rgu - 1) / rgu, sruns = (n_sgu + rsg - 1) / rsg;
#pragma omp for schedule(static)
            for (int64_t it = 0; it < groups * runs + sruns; it++) {
                if (it < groups * runs) {
                    const int64_t a = it / runs, r0 = (it % runs) * rgu, r1 = r0 + rgu < n_gu ? r0 + rgu : n_gu;
                    const int64_t p0 = start[a], m = start[a + 1] - p0;
                    const int whole = q16gu || (r16gu && m == 1); /* the run in one call per part */
                    for (int64_t s0 = r0, s1; whole && s0 < r1; s0 = s1) { /* the run's rows in gate, then in up */
                        s1 = s0 < inter && r1 > inter ? inter : r1;
                        const uint8_t *row0 =
                            gate_up_row(b->gate, b->up, act[a], b->gu_expert_stride, b->gu_row_bytes, inter, s0);
                        if (q16gu)
                            qw_run((int)b->type_gu, row0, b->gu_row_bytes, s1 - s0, xs16 + p0 * d, xs16d + p0 * (d / 32), m,
                                   d, gu + p0 * n_gu + s0, n_gu, panel);
                        else
                            rows16_q8k((int)b->type_gu, row0, b->gu_row_bytes, s1 - s0, xsq + p0 * d, xsd + p0 * (d / 32), d,
                                       gu + p0 * n_gu + s0);
                    }
                    const int two = !whole && two_gu && m >= 2;
                    if (two)
                        q4_0_pairs_run(b->gate + act[a] * b->gu_expert_stride, b->up + act[a] * b->gu_expert_stride, inter,
                                       b->gu_row_bytes, r0, r1, xp2 + off2[a] * (d / 32) * 512, dt2 + off2[a] * (d / 32) * 16,
                                       m, d, gu + p0 * n_gu, n_gu);
                    for (int64_t r = r0; !whole && !two && r < r1; r++) {
                        const uint8_t *row =
                            gate_up_row(b->gate, b->up, act[a], b->gu_expert_stride, b->gu_row_bytes, inter, r);
                        if (qgu)
                            qgu(row, xsq + p0 * d, xsd + p0 * (d / 32), m, d, gu + p0 * n_gu + r, n_gu);
                        else if (fgu)
                            fgu(row, b->gu_scale + act[a] * b->gu_scale_stride + r * (d / g), g, xs + p0 * d, d, m, d,
                                gu + p0 * n_gu + r, n_gu);
                        else
                            lin_row(kgu, row, xs + p0 * d, d, m, d, gu + p0 * n_gu + r, n_gu, buf);
                    }
                } else {
                    const int64_t r0 = (it - groups * runs) * rsg, r1 = r0 + rsg < n_sgu ? r0 + rsg : n_sgu;
                    for (int64_t s0 = r0, s1; s0 < r1; s0 = s1) { /* the run's rows in gate, then in up */
                        s1 = s0 < si && r1 > si ? si : r1;
                        const int up = s0 >= si;
                        const uint8_t *row0 = up ? b->su + (s0 - si) * b->su_row_bytes : b->sg + s0 * b->sg_row_bytes;
                        const int64_t rb = up ? b->su_row_bytes : b->sg_row_bytes, type = up ? b->type_su : b->type_sg;
                        if (up ? q16su : q16sg)
                            qw_run((int)type, row0, rb, s1 - s0, x16, x16d, t, d, sgu + s0, n_sgu, panel);
                        else if (t == 1 && (up ? r16su : r16sg))
                            rows16_q8k((int)type, row0, rb, s1 - s0, up ? xuq : xq, up ? xud : xd, d, sgu + s0);
                    }
                    if (two_sg && r0 < si) /* the run's gate rows, then its up rows */
                        q4_0_pairs_run(b->sg, b->sg, si, b->sg_row_bytes, r0, r1 < si ? r1 : si, xp2 + o_sg * 512, dt2 + o_sg * 16,
                                       t, d, sgu, n_sgu);
                    if (two_su && r1 > si)
                        q4_0_pairs_run(b->su, b->su, si, b->su_row_bytes, (r0 > si ? r0 : si) - si, r1 - si, xp2 + o_su * 512,
                                       dt2 + o_su * 16, t, d, sgu + si, n_sgu);
                    for (int64_t r = r0; r < r1; r++) {
                        const int up = r >= si;
                        if (up ? q16su || (t == 1 && r16su) || two_su : q16sg || (t == 1 && r16sg) || two_sg) continue;
                        const uint8_t *row = up ? b->su + (r - si) * b->su_row_bytes : b->sg + r * b->sg_row_bytes;
                        const q8rows_fn q8 = up ? qsu : qsg;
                        if (q8)
                            q8(row, up ? xuq : xq, up ? xud : xd, t, d, sgu + r, n_sgu);
                        else
                            lin_row(up ? ksu : ksg, row, x, d, t, d, sgu + r, n_sgu, buf);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < pairs * inter + t * si; it++) {
                if (it < pairs * inter) {
                    const int64_t q = it / inter, i = it % inter;
                    h[it] = silu_mul(gu[q * n_gu + i], gu[q * n_gu + inter + i]);
                } else {
                    const int64_t j = it - pairs * inter, tok = j / si, i = j % si;
                    sh[j] = silu_mul(sgu[tok * n_sgu + i], sgu[tok * n_sgu + si + i]);
                }
            }
            if (q16dn || q16sd) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < pairs + t; i++) {
                    if (i < pairs && q16dn) qw_quantize_rows(h + i * inter, 1, inter, inter, h16 + i * inter, h16d + i * (inter / 32));
                    if (i >= pairs && q16sd)
                        qw_quantize_rows(sh + (i - pairs) * si, 1, si, si, sh16 + (i - pairs) * si, sh16d + (i - pairs) * (si / 32));
                }
            }
            if (qdn || qsd) {
#pragma omp single
                {
                    if (qdn) quantize_act((int)b->type_dn, h, pairs, inter, inter, hq, hd);
                    if (qsd) quantize_act((int)b->type_sd, sh, t, si, si, shq, shd);
                    if (two_dn) q4_0_pairs_pack_groups(hq, hd, inter, start, groups, off2, xp2 + o_dn * 512, dt2 + o_dn * 16);
                    if (two_sd) q4_0_pairs_pack(shq, shd, t, si, xp2 + o_sd * 512, dt2 + o_sd * 16);
                }
            }
            const int64_t rdn = q16dn || q16sd || r16dn || r16sd ? QW_R : ROW_RUN, druns = (d + rdn - 1) / rdn;
            const int64_t sdruns = si ? druns : 0;
#pragma omp for schedule(static) /* as gate_up's */
            for (int64_t it = 0; it < groups * druns + sdruns; it++) {
                const int64_t a = it / druns, r0 = (it % druns) * rdn, r1 = r0 + rdn < d ? r0 + rdn : d;
                if (a < groups) {
                    const int64_t p0 = start[a], m = start[a + 1] - p0;
                    const uint8_t *we = b->down + act[a] * b->dn_expert_stride;
                    const int whole = q16dn || (r16dn && m == 1), two = !whole && two_dn && m >= 2;
                    if (two)
                        q4_0_pairs_run(we, we, d, b->dn_row_bytes, r0, r1, xp2 + (o_dn + off2[a] * (inter / 32)) * 512,
                                       dt2 + (o_dn + off2[a] * (inter / 32)) * 16, m, inter, ys + p0 * d, d);
                    if (q16dn)
                        qw_run((int)b->type_dn, we + r0 * b->dn_row_bytes, b->dn_row_bytes, r1 - r0, h16 + p0 * inter,
                               h16d + p0 * (inter / 32), m, inter, ys + p0 * d + r0, d, panel);
                    else if (whole)
                        rows16_q8k((int)b->type_dn, we + r0 * b->dn_row_bytes, b->dn_row_bytes, r1 - r0, hq + p0 * inter,
                                   hd + p0 * (inter / 32), inter, ys + p0 * d + r0);
                    for (int64_t r = r0; !whole && !two && r < r1; r++) {
                        const uint8_t *row = we + r * b->dn_row_bytes;
                        if (qdn)
                            qdn(row, hq + p0 * inter, hd + p0 * (inter / 32), m, inter, ys + p0 * d + r, d);
                        else if (fdn)
                            fdn(row, b->dn_scale + act[a] * b->dn_scale_stride + r * (inter / g), g, h + p0 * inter,
                                inter, m, inter, ys + p0 * d + r, d);
                        else
                            lin_row(kdn, row, h + p0 * inter, inter, m, inter, ys + p0 * d + r, d, buf);
                    }
                } else {
                    const int whole = q16sd || (r16sd && t == 1), two = !whole && two_sd;
                    if (two)
                        q4_0_pairs_run(b->sd, b->sd, d, b->sd_row_bytes, r0, r1, xp2 + o_sd * 512, dt2 + o_sd * 16, t, si, ysh,
                                       d);
                    if (q16sd)
                        qw_run((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, r1 - r0, sh16, sh16d, t, si,
                               ysh + r0, d, panel);
                    else if (whole)
                        rows16_q8k((int)b->type_sd, b->sd + r0 * b->sd_row_bytes, b->sd_row_bytes, r1 - r0, shq, shd, si,
                                   ysh + r0);
                    for (int64_t r = r0; !whole && !two && r < r1; r++) {
                        const uint8_t *row = b->sd + r * b->sd_row_bytes;
                        if (qsd)
                            qsd(row, shq, shd, t, si, ysh + r, d);
                        else
                            lin_row(ksd, row, sh, si, t, si, ysh + r, d, buf);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < t * d; it++) {
                const int64_t tok = it / d, r = it % d;
                float acc = 0.0f;
                for (int64_t j = 0; j < kk; j++) acc += wt[tok * kk + j] * ys[pos[tok * kk + j] * d + r];
                out[it] = si ? acc + ysh[it] : acc;
            }
        }
        free(buf);
        free(panel);
    }
    if (oom) rc = -4;
    if (rc == 0 && topk_w) memcpy(topk_w, wt, sizeof(float) * (size_t)pairs);
    if (rc == 0 && topk_idx) memcpy(topk_idx, idx, sizeof(int64_t) * (size_t)pairs);
    free(mem);
    free(mem16);
    free(xp2);
    free(dt2);
    free(off2);
    return rc;
}

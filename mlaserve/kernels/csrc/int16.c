/* ------------------------------------------------------------ the int16 products' calls (x86/int16_prefill.c)
   A call's work list over its groups (one weight, or routed experts and heads: qw_grouped), each item on the VNNI
   kernels (qw_run) or, where the process has the AMX-INT8 tiles, on the tiles (x86/amx_int16.c); the
   decode steps' helpers (qw_in, qw_quantize_rows) and the C interface (mls_int16_*). */
#ifdef MLS_INT16
/* one call's work list: (group, chunk of QW_CHUNK rows, 16-row panel) items, first[a] group a's first item */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t n, row_bytes, expert_stride, k, panels, ldy;
    const int64_t *experts, *starts, *first;
    const int16_t *xc;
    const float *xd;
    float *y;
    int amx;                  /* items of QA_MIN_ROWS rows or more on the AMX-INT8 tiles (qa_pass) */
    const int64_t *pstart;    /* (amx) each group's first packed row, -1 where it stays on qw_run (tile_offsets) */
    const int32_t *xbh, *xbl; /* (amx) every 16 padded rows' high and low bytes, packed (qa_pack) */
    const float *xdt;         /* (amx) their scales, packed */
} qw_work;

/* item it: its group (*a, moved from the last item's), chunk and panel, on qw_run (mem: the thread's panel) */
static inline void qw_item(const qw_work *q, int64_t it, int64_t *a, void *mem) {
    while (q->first[*a + 1] <= it) (*a)++;
    while (q->first[*a] > it) (*a)--;
    const int64_t g = *a, k = q->k, c = (it - q->first[g]) / q->panels, r0 = (it - q->first[g]) % q->panels * QW_R;
    const int64_t p0 = q->starts[g] + c * QW_CHUNK, left = q->starts[g + 1] - p0;
    const int64_t m = left < QW_CHUNK ? left : QW_CHUNK, nr = q->n - r0 < QW_R ? q->n - r0 : QW_R;
    const int64_t i0 = p0 - q->starts[0];
#ifdef MLS_INT16_TILES
    if (q->amx && q->pstart[g] >= 0 && qa_takes(q->type, m) && nr == QW_R) { /* else qw_run: the same bits */
        const int64_t kb = k / 32, g0 = (q->pstart[g] + c * QW_CHUNK) / 16; /* QW_CHUNK a multiple of 16 */
        qa_rows(q->type, q->w + q->experts[g] * q->expert_stride + r0 * q->row_bytes, q->row_bytes, q->xbh + g0 * kb * 128,
                q->xbl + g0 * kb * 128, q->xdt + g0 * kb * 16, m, k, q->y + p0 * q->ldy + r0, q->ldy);
        return;
    }
#endif
    qw_run(q->type, q->w + q->experts[g] * q->expert_stride + r0 * q->row_bytes, q->row_bytes, nr, q->xc + i0 * k,
           q->xd + i0 * (k / 32), m, k, q->y + p0 * q->ldy + r0, q->ldy, mem);
}

/* Rows [starts[a], starts[a + 1]) of x (row stride ldx) times expert experts[a]'s n rows (w + experts[a] *
   expert_stride, row_bytes apart) into y (row stride ldy). One parallel region: the activations quantized (rows
   split between the threads), then the work list (qw_work), each item's rows read in place or its panel unpacked
   into the thread's buffer and met by the chunk's rows (qw_run). Items run dynamic (a thread may lose its core to a
   neighbour), or, where every group has at most QW_FEW rows (decode), as one contiguous range per thread, so that
   qw_few's prefetch of the next 16 rows serves its own thread. Returns 0, -4 out of memory. */
static int qw_grouped(int type, const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
    const int64_t kb = k / 32, rows = starts[groups] - starts[0], panels = (n + QW_R - 1) / QW_R;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1)); /* each group's first item */
    int16_t *xc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(rows * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(rows * kb) + 64);
    int failed = !first || !xc || !xd, few = 1;
    if (!failed) {
        first[0] = 0;
        for (int64_t a = 0; a < groups; a++) {
            first[a + 1] = first[a] + (starts[a + 1] - starts[a] + QW_CHUNK - 1) / QW_CHUNK * panels;
            few &= starts[a + 1] - starts[a] <= QW_FEW;
        }
    }
    /* on the AMX-INT8 tiles: the codes' bytes packed (qa_pack) for the groups of QA_MIN_ROWS rows or more */
    const int takes = !failed && !few && qa_takes(type, QA_MIN_ROWS);
    int64_t *pstart = takes ? (int64_t *)malloc(sizeof(int64_t) * (size_t)groups) : 0;
    const int64_t prows = pstart ? tile_offsets(starts, groups, QA_MIN_ROWS, pstart) : 0;
    int32_t *xbh = 0, *xbl = 0;
    float *xdt = 0;
    const int amx = prows > 0;
    failed |= amx && qa_alloc(prows, k, &xbh, &xbl, &xdt) != 0;
    const qw_work q = {type, w, n, row_bytes, expert_stride, k, panels, ldy, experts, starts, first, xc, xd, y,
                       amx, pstart, xbh, xbl, xdt};
#pragma omp parallel num_threads(threads) if (!failed)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                qw_quantize_row(x + (starts[0] + i) * ldx, k, xc + i * k, xd + i * kb);
        }
#ifdef MLS_INT16_TILES
        const int tiles = !failed && amx; /* this thread packs its share and loads the tile shapes (released below) */
        if (tiles) {
            qa_pack_groups(xc, xd, starts, pstart, groups, k, xbh, xbl, xdt);
            qa_config();
        }
#endif
        /* the panel buffer, where an item has more than QW_FEW rows */
        void *mem = failed || few ? NULL : aligned_alloc(64, qw_panel_bytes(k));
        const int ready = !failed && (few || mem);
        if (!ready && !failed) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t items = first && xc && xd ? first[groups] : 0; /* the same count in every thread */
        int64_t a = 0;
        if (few) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                if (ready) qw_item(&q, it, &a, mem);
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t it = 0; it < items; it++)
                if (ready) qw_item(&q, it, &a, mem);
        }
#ifdef MLS_INT16_TILES
        if (tiles) _tile_release();
#endif
        free(mem);
    }
    free(first);
    free(xc);
    free(xd);
    free(pstart);
    free(xbh);
    return failed ? -4 : 0;
}
#endif

/* ---------------------------------------------------------------- the decode steps' int16 products
   The one-call decode layer and MoE block (decode_layer.c, moe/block.c) take these products where their activation
   setting has MLS_ACT_INT16 and a weight's type is one of the above that the setting's int8 cap leaves in fp32
   (under activations "int8_6bit_int16": Q8_0, Q5_0, MXFP4), as the per-op path does (kernels/int16_prefill.py
   takes_rest): the same kernels at every row count, so a request's result does not depend on its batch. */
#ifdef MLS_INT16
static inline int qw_in(int type, int64_t setting) {
    return (setting & MLS_ACT_INT16) && !q8rows_in(type, setting) && qw_type(type);
}

/* rows x [m, k] (row stride ldx) -> codes xc [m, k] and scales xd [m, k / 32] */
static inline void qw_quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int16_t *xc, float *xd) {
    for (int64_t i = 0; i < m; i++) qw_quantize_row(x + i * ldx, k, xc + i * k, xd + i * (k / 32));
}
#else /* no AVX512-VNNI: no type takes them, and these are never called */
#define QW_R 16
#define QW_FEW 3
static inline int qw_in(int type, int64_t setting) {
    (void)type, (void)setting;
    return 0;
}
static inline size_t qw_panel_bytes(int64_t k) { return (size_t)k; }
static inline void qw_quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int16_t *xc, float *xd) {
    (void)x, (void)m, (void)k, (void)ldx, (void)xc, (void)xd;
}
static inline void qw_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc,
                          const float *xd, int64_t m, int64_t k, float *y, int64_t ldy, void *panel) {
    (void)type, (void)w, (void)row_bytes, (void)nr, (void)xc, (void)xd, (void)m, (void)k, (void)y, (void)ldy;
    (void)panel;
}
#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) dequantize(W)^T for rows w [n] (row_bytes apart) of a
   32-value block type (qw_type), with int16 activations on AVX512-VNNI (above): 0, -1 a build without AVX512-VNNI,
   -2 k not a multiple of 32, -3 not such a type, -4 out of memory */
int mls_int16_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                   int64_t row_bytes, float *y, int64_t ldy, int threads) {
#ifdef MLS_INT16
    if (k % 32) return -2;
    if (!qw_type(type)) return -3;
    if (m == 0 || n == 0) return 0;
    const int64_t expert = 0, starts[2] = {0, m};
    return qw_grouped(type, x, ldx, k, w, n, row_bytes, 0, &expert, starts, 1, y, ldy, threads);
#else
    (void)type, (void)x, (void)m, (void)k, (void)ldx, (void)w, (void)n, (void)row_bytes, (void)y, (void)ldy;
    (void)threads;
    return -1;
#endif
}

/* Several weights of one type and row width times the same m (<= QW_FEW) activation rows: weight i's n[i] rows
   (w[i], row_bytes apart) into y[i] (row stride ldy[i]) -- a layer's projections of one input (DeepSeek-V4's q_a,
   kv and compressor / indexer projections). The activations quantized once, then one work list of 16-row panels
   over all the weights, each read in place (qw_run's few-rows path): per weight the same items and operations as
   mls_int16_gemm's, so the same bits as one call per weight, without a call's start per weight (its threads' fork
   and join, its quantization, the reads' ramp: a 4-layer model's 10 small projections a step ran ~11 GB/s alone
   against ~19 for its large ones, a 2-core AMX Xeon). Past QW_FEW rows one weight's call may take the AMX-INT8
   tiles, which this form does not (at 16 rows it measured slower than the calls apart). -> 0, -1 not built, -2 k
   not whole blocks or m above QW_FEW, -3 a type without int16 products, -4 out of memory. */
int mls_int16_gemm_multi(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *const *w,
                         const int64_t *n, int64_t nw, int64_t row_bytes, float *const *y, const int64_t *ldy,
                         int threads) {
#ifdef MLS_INT16
    if (k % 32 || m > QW_FEW) return -2;
    if (!qw_type(type)) return -3;
    if (m == 0 || nw == 0) return 0;
    const int64_t kb = k / 32;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nw + 1)); /* each weight's first panel */
    int16_t *xc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(m * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(m * kb) + 64);
    const int failed = !first || !xc || !xd;
    for (int64_t i = 0; !failed && i <= nw; i++) first[i] = i ? first[i - 1] + (n[i - 1] + QW_R - 1) / QW_R : 0;
#pragma omp parallel num_threads(threads) if (!failed)
    if (!failed) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) qw_quantize_row(x + r * ldx, k, xc + r * k, xd + r * kb);
        int64_t i = 0;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < first[nw]; it++) {
            while (first[i + 1] <= it) i++;
            while (first[i] > it) i--;
            const int64_t r0 = (it - first[i]) * QW_R, nr = n[i] - r0 < QW_R ? n[i] - r0 : QW_R;
            qw_run(type, w[i] + r0 * row_bytes, row_bytes, nr, xc, xd, m, k, y[i] + r0, ldy[i], NULL);
        }
    }
    free(first);
    free(xc);
    free(xd);
    return failed ? -4 : 0;
#else
    (void)type, (void)x, (void)m, (void)k, (void)ldx, (void)w, (void)n, (void)nw, (void)row_bytes, (void)y, (void)ldy;
    (void)threads;
    return -1;
#endif
}

/* the grouped form (routed experts, heads): rows [starts[a], starts[a + 1]) of x [P, k] times expert experts[a]'s
   rows (w + experts[a] * expert_stride), into y [P, ldy]; codes as mls_int16_gemm */
int mls_int16_grouped(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
#ifdef MLS_INT16
    if (k % 32) return -2;
    if (!qw_type(type)) return -3;
    if (n == 0 || groups == 0) return 0;
    return qw_grouped(type, x, k, k, w, n, row_bytes, expert_stride, experts, starts, groups, y, ldy, threads);
#else
    (void)type, (void)x, (void)k, (void)w, (void)n, (void)row_bytes, (void)expert_stride, (void)experts;
    (void)starts, (void)groups, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* whether this build runs a type's products here (every row count; the decode steps take them): 1 yes, 0 no (not
   such a type, or a build without AVX2) */
int mls_int16_takes(int type) {
#ifdef MLS_INT16
    return qw_type(type);
#else
    (void)type;
    return 0;
#endif
}

/* whether this build runs a type's products of many rows on unpacked panels (AVX512-VNNI; a prompt's products take
   int16 activations only there): 1 yes, 0 no */
int mls_int16_panels(int type) {
#ifdef MLS_INT16_PANELS
    return qw_type(type);
#else
    (void)type;
    return 0;
#endif
}

int mls_int16_in(int type, int64_t setting) { return qw_in(type, setting); }

int64_t mls_int16_tile_rows(int type) {
#ifdef MLS_INT16_TILES
    return qa_takes(type, QA_MIN_ROWS) ? QA_MIN_ROWS : 0;
#else
    (void)type;
    return 0;
#endif
}

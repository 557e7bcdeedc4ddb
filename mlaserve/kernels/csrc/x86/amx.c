/* ---------------------------------------------------------------- AMX-INT8 tiles: the driver of every tile type
   For the products int8.c runs with int8 activations (q8_K-style: codes, per 256 values a scale d_x and per 32 the
   code sums) when a call has at least amx_min_rows activation rows (batched decode of 8+ sequences; prefill). The
   CPU's tile unit multiplies a 16 x 64 byte tile by a 16 x 64 byte tile into 16 x 16 int32 sums in one instruction,
   about 8x the int8 multiply-adds per cycle of a 512-bit vpdpbusd; each weight row is unpacked once per call for
   all activation rows.

   The driver here holds what every type shares; a type brings only a hook (amx_hook_t): x86/amx_planes.c's for
   Q4_K, Q6_K (base-8 digit planes of code times scale), x86/amx_units.c's for the types with one integer scale
   per 32 or 16 values. Notation (one pass: 16 weight rows r, 16 activation rows i, super-block blk of 256 values):
     B [k / 4, 64] int8   the activation rows' codes, 4 consecutive values of a row per int32 (the tiles' VNNI
                          layout; amx_pack, once per call; rows past m zero), with d_x [k / 256, 16] and the per-32
                          code sums bsum [k / 256 * 4, 16] as int16 pairs
     A, ls, d_w, ...      the weight block's unpacked form (amx_rows_t), written by the hook's unpack
     S [16, 16]    int32  the hook's product: sum over the super-block's values of code x activation code times
                          the codes' integer scale, exactly the VNNI row kernel's integer sum (|S| < 2^28)
     y[i, r] += (d_w[r] * d_x[i]) * S[r, i]     (every type, per super-block in order)
     y[i, r] -= (dmin_w[r] * d_x[i]) * M[r, i]  (types with mins, Q4_K / Q5_K: M = sum_j mn[r, j] bsum[i, j], the
                                                 sub-block mins times the activation's code sums, exact)
     y_out = y * factor                          (the grid types' power of two; 1 for the rest, exact)
   The integer sums are exact and the float operations are the VNNI row kernels' (x86/avx2.c q8k_*_mr, ref/int8.c),
   in the same order per row, so each y comes out bit for bit as theirs whatever the batch.

   Hook contract (adding a type = writing these and listing the type in amx_hook_of):
     planes, scales  the unpacked block's sizes: planes int8 [16, k] code planes; scales int32 integer scales per
                     256 values kept in ls (0 when the planes carry the scales); factor: the rows' last multiply
     tiles           the shapes of the tiles its product uses (the driver loads the configuration per thread)
     unpack          up to 16 weight rows into A, ls, d_w, and with mins dmin_w and mn (mins 2j | 2j + 1 << 16, the
                     int16 pairs madd wants): every byte of A and ls for its nr rows (the driver zeroes them only
                     for a last block shorter than 16 rows, so that rows past nr give S = 0)
     product         one super-block blk for the 16 weight rows and one packed group of 16 activation rows: tile
                     loads and dot products, its integer scales applied to the int32 sums (exact), then each
                     row's S handed to amx_accumulate (the float steps, with or without mins) into acc
   The driver (amx_grouped: one weight, or every expert and part of a grouped call) splits the 16-row weight blocks
   over the threads (one group: contiguous ranges; several: dynamic, their costs differ), packs the
   activations once per call, and walks super-blocks outside, activation groups inside: a super-block's unpacked rows (16 x 256 values a plane) stay in L1 while every
   group's activations stream past.

   Linux hands the tile registers to a process only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
   amx_permission asks once and keeps the answer (mls_int8_tiles reports it for the kernel plan). Each thread loads
   the tile configuration before its first tile instruction and releases the tiles when done. */
#if defined(MLS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define MLS_AMX 1
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16     /* a tile's rows: weight rows per pass; also the activation rows (C's 16 int32 columns) */
#define AMX_MIN_ROWS 8 /* activation rows from which a product takes the tiles (fewer leave most of B empty) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 the process may use the tiles, -errno the kernel refused them (asked once; a repeated ask is harmless) */
static int amx_permission(void) {
    static int state;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -(errno ? errno : EPERM);
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* the types of x86/amx_units.c (one integer scale per 32 or 16 values that no byte plane holds) */
static inline int amx_unit_type(int type) {
    return type == MLS_IQ4_XS || type == MLS_IQ2_XXS || type == MLS_IQ3_XXS || type == MLS_IQ3_S || type == MLS_IQ1_S ||
           type == MLS_Q5_K || type == MLS_IQ2_XS || type == MLS_IQ2_S || type == MLS_IQ1_M;
}

static inline int amx_type(int type) { return type == MLS_Q4_K || type == MLS_Q6_K || amx_unit_type(type); }

/* activation rows from which a product on this type takes the tiles (benchmarks/int8_tiles.py, 2 threads, an AMX
   Xeon, tiles / VNNI rows): every type from AMX_MIN_ROWS, 8 (Q4_K 1.34x there, the unit types 1.29-2.38x, Q6_K
   1.05-1.08x since its planes come from a byte-permute table (1.4-1.55x at 12, 1.9x at 16); 0.67-0.87x at 4 but
   IQ4_XS). The tiles give the VNNI rows' bits, so the crossover moves speed only; measured on one CPU (a 2-core
   Sapphire-Rapids-class Xeon), to be measured again on others. */
static inline int64_t amx_min_rows(int type) {
    (void)type;
    return AMX_MIN_ROWS;
}

/* whether a product of m activation rows on this type runs on the tiles */
static inline int amx_takes(int type, int64_t m) { return amx_type(type) && m >= amx_min_rows(type) && amx_permission() == 1; }

/* ldtilecfg's 64 bytes: palette 1, per tile its rows and bytes per row */
typedef struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* One block of up to 16 weight rows, unpacked (the hook's unpack writes it; the sizes are the hook's) */
typedef struct {
    int8_t *a;    /* [planes, 16, k] codes (a plane AMX_ROWS * k apart) */
    int32_t *ls;  /* [16, k / 256 * scales] integer scales */
    int32_t *mn;  /* [16, k / 256 * 4] (mins): 2j | 2j + 1 << 16 */
    float *d;     /* [16, k / 256] d_w */
    float *dmin;  /* [16, k / 256] (mins) */
} amx_rows_t;

/* One group of up to 16 activation rows, packed (amx_pack) */
typedef struct {
    const int32_t *xp;   /* [k / 4, 16] 4 codes of a row each */
    const float *dx;     /* [k / 256, 16] d_x */
    const int32_t *bsum; /* [k / 256 * 4, 16] per-32 code sums, int16 pairs */
} amx_acts_t;

/* a tile type's hook (see the contract above) */
typedef struct {
    int planes, scales;
    float factor;
    void (*tiles)(int type, amx_cfg_t *c);
    void (*unpack)(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, const amx_rows_t *o);
    void (*product)(int type, const amx_rows_t *W, int64_t blk, const amx_acts_t *x, int64_t k, float *acc);
} amx_hook_t;

static amx_hook_t amx_plane_hook(int type); /* x86/amx_planes.c */
static amx_hook_t amx_unit_hook(int type);  /* x86/amx_units.c */

static amx_hook_t amx_hook_of(int type) { return amx_unit_type(type) ? amx_unit_hook(type) : amx_plane_hook(type); }

/* Activation rows [0, mr) (mr <= 16) in the tiles' layout: xp [k / 4, 16] int32 (4 codes of a row each), dx
   [k / 256, 16] their scales, bsum [k / 256 * 4, 16] their per-32 code sums as int16 pairs; rows past mr zero */
static void amx_pack(const int8_t *xq, const float *xd, int64_t mr, int64_t k, int32_t *xp, float *dx, int32_t *bsum) {
    const int64_t kb = k / 256, slots = k / 32;
    memset(xp, 0, sizeof(int32_t) * (size_t)(k / 4 * AMX_ROWS));
    memset(dx, 0, sizeof(float) * (size_t)(kb * AMX_ROWS));
    memset(bsum, 0, sizeof(int32_t) * (size_t)(kb * 4 * AMX_ROWS));
    for (int64_t i = 0; i < mr; i++) {
        const int8_t *row = xq + i * k;
        for (int64_t c = 0; c < k / 4; c++) memcpy(xp + c * AMX_ROWS + i, row + 4 * c, 4);
        for (int64_t blk = 0; blk < kb; blk++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            dx[blk * AMX_ROWS + i] = meta->d;
            for (int j = 0; j < 4; j++)
                bsum[(blk * 4 + j) * AMX_ROWS + i] = (meta->bsum[2 * j] & 0xFFFF) | ((int32_t)meta->bsum[2 * j + 1] << 16);
        }
    }
}

/* Weight row r's S (its 16 activation rows' integer sums of super-block blk) into its running sums acc [16] (over
   the super-blocks before blk, in their order): the float steps every VNNI row kernel takes, here once. A hook's
   product calls it per row as S is formed: S stays in a register, not a round trip through memory per super-block. */
static inline void amx_accumulate(const amx_rows_t *W, int mins, int64_t blk, int64_t kb, const amx_acts_t *x, int r,
                                  __m512i S, float *acc) {
    const __m512 d_x = _mm512_loadu_ps(x->dx + blk * AMX_ROWS);
    __m512 y = _mm512_load_ps(acc);
    y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->d[r * kb + blk]), d_x), _mm512_cvtepi32_ps(S)));
    if (mins) {
        const int32_t *mn = W->mn + r * kb * 4 + blk * 4;
        const int32_t *bsum = x->bsum + blk * 4 * AMX_ROWS;
        __m512i M = _mm512_madd_epi16(_mm512_set1_epi32(mn[0]), _mm512_loadu_si512(bsum));
        for (int j = 1; j < 4; j++)
            M = _mm512_add_epi32(M, _mm512_madd_epi16(_mm512_set1_epi32(mn[j]), _mm512_loadu_si512(bsum + j * AMX_ROWS)));
        y = _mm512_sub_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->dmin[r * kb + blk]), d_x), _mm512_cvtepi32_ps(M)));
    }
    _mm512_store_ps(acc, y);
}

/* The groups of a grouped call that a kernel takes (keep(rows, arg)): their indices (kept[0 .. n)), where their
   16-row packs start (pg[0 .. n], pg[0] = 0) and the most packs of one group. One allocation (kept; free it);
   pack_owner walks a thread's ascending share of packs back to their groups. Returns 0, -4 out of memory. */
typedef struct {
    int64_t *kept, *pg, n, most;
} amx_picks_t;
static int amx_pick(const int64_t *starts, int64_t groups, int (*keep)(int64_t rows, const void *arg), const void *arg,
                    amx_picks_t *p) {
    p->kept = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * groups + 2));
    if (!p->kept) return -4;
    p->pg = p->kept + groups;
    p->pg[0] = p->n = p->most = 0;
    for (int64_t a = 0; a < groups; a++) {
        const int64_t rows = starts[a + 1] - starts[a], packs = (rows + AMX_ROWS - 1) / AMX_ROWS;
        if (rows == 0 || !keep(rows, arg)) continue;
        p->kept[p->n] = a;
        p->pg[p->n + 1] = p->pg[p->n] + packs;
        p->most = packs > p->most ? packs : p->most;
        p->n++;
    }
    return 0;
}
/* the kept group of pack pi, moving *j forward (a thread's static share of packs ascends) */
static inline int64_t pack_owner(const amx_picks_t *p, int64_t pi, int64_t *j) {
    while (p->pg[*j + 1] <= pi) (*j)++;
    return *j;
}

static int amx_keep(int64_t rows, const void *type) { return amx_takes(*(const int *)type, rows); }

/* what every item of one product shares (an amx_grouped call; one projection of the MoE block) */
typedef struct {
    amx_hook_t h;
    int type;
    int64_t k, row_bytes, ldy, nls;
    size_t per_group, xp_n, dx_n, a_n;
    amx_cfg_t cfg; /* the hook's tile shapes */
} amx_call_t;

/* the call of a product on this type: weight rows of k values (row_bytes apart), outputs ldy apart */
static amx_call_t amx_call_of(int type, int64_t k, int64_t row_bytes, int64_t ldy) {
    const amx_hook_t h = amx_hook_of(type);
    const int64_t kb = k / 256;
    const size_t xp_n = (size_t)(k / 4 * AMX_ROWS), dx_n = (size_t)(kb * AMX_ROWS), bs_n = (size_t)(kb * 4 * AMX_ROWS);
    amx_call_t c = {h, type, k, row_bytes, ldy, AMX_ROWS * kb * h.scales, xp_n + dx_n + bs_n, xp_n, dx_n,
                    (size_t)(h.planes * AMX_ROWS * k), {0}};
    c.cfg.palette = 1;
    h.tiles(type, &c.cfg);
    return c;
}

/* this thread's tile shapes made `want` (loaded only where they differ from `cur`, the ones it has loaded: a palette
   of 0 none yet) */
static inline void amx_tiles_use(amx_cfg_t *cur, const amx_cfg_t *want) {
    if (memcmp(cur, want, sizeof *want) == 0) return;
    *cur = *want;
    _tile_loadconfig(want);
}

/* a group of m activation rows (int8 codes xq [m, k], q8_K scales xd, k / 32 slots a row) into its ceil(m / 16)
   packs at xg, c->per_group int32 apart */
static void amx_pack_rows(const amx_call_t *c, const int8_t *xq, const float *xd, int64_t m, int32_t *xg) {
    for (int64_t i0 = 0; i0 < m; i0 += AMX_ROWS) {
        int32_t *xp = xg + i0 / AMX_ROWS * c->per_group;
        amx_pack(xq + i0 * c->k, xd + i0 * (c->k / 32), m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS, c->k, xp,
                 (float *)(xp + c->xp_n), xp + c->xp_n + c->dx_n);
    }
}

/* One item: a block of nr (<= 16) rows (rows r0 .. of w) times a group's packs (xg, groups_a of them, m rows), into
   y (the group's first row, the block's first column): unpacked once, every super-block's products over the
   packs in order, then acc [16 r][16 i] -> y [i][r]: per activation row one gather of its column and one store of
   its nr outputs (the same product by the factor as a scalar one: the same bits). */
static void amx_item(const amx_call_t *c, amx_rows_t *W, float *acc, const uint8_t *w, int64_t r0, int64_t nr,
                     const int32_t *xg, int64_t groups_a, int64_t m, float *y) {
    if (nr < AMX_ROWS) { /* a hook's unpack writes every byte of its rows: only a last, short block has rows past nr,
                            which must give S = 0 */
        memset(W->a, 0, c->a_n);
        memset(W->ls, 0, sizeof(int32_t) * (size_t)c->nls);
    }
    c->h.unpack(c->type, w + r0 * c->row_bytes, c->row_bytes, nr, c->k, W);
    memset(acc, 0, sizeof(float) * AMX_ROWS * 16 * (size_t)groups_a);
    for (int64_t blk = 0; blk < c->k / 256; blk++)
        for (int64_t g = 0; g < groups_a; g++) {
            const int32_t *xp = xg + g * c->per_group;
            const amx_acts_t x = {xp, (const float *)(xp + c->xp_n), xp + c->xp_n + c->dx_n};
            c->h.product(c->type, W, blk, &x, c->k, acc + g * AMX_ROWS * 16);
        }
    const __m512i by_row = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16)); /* acc's offsets of one i's 16 r */
    const __m512 factor = _mm512_set1_ps(c->h.factor);
    const __mmask16 rows = nr >= AMX_ROWS ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int64_t g = 0; g < groups_a; g++) {
        const int64_t i0 = g * AMX_ROWS, mr = m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS;
        for (int64_t i = 0; i < mr; i++) {
            const __m512 col = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, by_row, acc + g * AMX_ROWS * 16 + i, 4);
            _mm512_mask_storeu_ps(y + (i0 + i) * c->ldy + r0, rows, _mm512_mul_ps(col, factor));
        }
    }
}

/* This thread's buffers for items of any of the calls cs[0 .. n): acc [most packs, 16, 16], then the unpacked block
   (A, ls, mn, d, dmin) sized for the largest, each 64-byte aligned as k is a multiple of 256. NULL when memory runs
   out. */
static char *amx_thread_alloc(const amx_call_t *cs, int n, int64_t most, amx_rows_t *W) {
    size_t a_n = 0;
    int64_t nls = 0, kb = 0;
    for (int i = 0; i < n; i++) {
        a_n = cs[i].a_n > a_n ? cs[i].a_n : a_n;
        nls = cs[i].nls > nls ? cs[i].nls : nls;
        kb = cs[i].k / 256 > kb ? cs[i].k / 256 : kb;
    }
    const size_t bytes = sizeof(float) * AMX_ROWS * 16 * (size_t)most + a_n + sizeof(int32_t) * (size_t)nls +
                         sizeof(int32_t) * (size_t)(AMX_ROWS * kb * 4) + 2 * sizeof(float) * (size_t)(AMX_ROWS * kb);
    char *mem = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!mem) return 0;
    W->a = (int8_t *)((float *)mem + AMX_ROWS * 16 * most);
    W->ls = (int32_t *)(W->a + a_n);
    W->mn = W->ls + nls;
    W->d = (float *)(W->mn + AMX_ROWS * kb * 4);
    W->dmin = W->d + AMX_ROWS * kb;
    return mem;
}

/* Groups of activation rows times expert weights on the tiles, every part of each expert: for group a (rows
   starts[a] .. starts[a + 1] of xq / xd) that takes the tiles (amx_takes), part q's expert experts[a] (ws[q] +
   experts[a] * expert_stride, n rows row_bytes apart) into y's columns q * n .. q * n + n (row stride ldy); groups
   that do not take the tiles are left to the caller. One parallel region for the whole call: the activations of
   every such group packed (static), then one work list of (group, part, 16-row weight block) items (a group's
   blocks next to each other; static for one group, else dynamic), so a call over many experts pays one fork and
   one tail, not one per expert and part. Each item runs the same operations as a call on its expert alone, so the bits do not depend on the
   grouping. Returns 0, -4 when memory runs out. */
static int amx_grouped(int type, const uint8_t *const *ws, int64_t nparts, int64_t n, int64_t row_bytes,
                       int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                       const int8_t *xq, const float *xd, int64_t k, float *y, int64_t ldy, int threads) {
    const amx_call_t c = amx_call_of(type, k, row_bytes, ldy);
    const int64_t blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    amx_picks_t t;
    if (amx_pick(starts, groups, amx_keep, &type, &t)) return -4;
    const int64_t packs = t.pg[t.n], items = t.n * nparts * blocks;
    char *packed = items ? (char *)aligned_alloc(64, ((size_t)packs * c.per_group * 4 + 63) / 64 * 64) : 0;
    int rc = items && !packed ? -4 : 0;
    if (packed) {
#pragma omp parallel num_threads(threads)
        {
            amx_rows_t W;
            char *mem = amx_thread_alloc(&c, 1, t.most, &W);
            if (!mem) {
#pragma omp atomic write
                rc = -4;
            } else
                _tile_loadconfig(&c.cfg);
            int64_t j = 0;
#pragma omp for schedule(static)
            for (int64_t pi = 0; pi < packs; pi++) {
                const int64_t jt = pack_owner(&t, pi, &j), a = t.kept[jt], i0 = starts[a] + (pi - t.pg[jt]) * AMX_ROWS;
                const int64_t mr = starts[a + 1] - i0 < AMX_ROWS ? starts[a + 1] - i0 : AMX_ROWS;
                int32_t *xp = (int32_t *)packed + pi * c.per_group;
                amx_pack(xq + i0 * k, xd + i0 * (k / 32), mr, k, xp, (float *)(xp + c.xp_n), xp + c.xp_n + c.dx_n);
            }
#define AMX_GROUPED_ITEM                                                                                        \
    if (mem) {                                                                                                  \
        const int64_t jt = it / (nparts * blocks), q = it / blocks % nparts, a = t.kept[jt];                   \
        const int64_t r0 = it % blocks * AMX_ROWS;                                                              \
        amx_item(&c, &W, (float *)mem, ws[q] + experts[a] * expert_stride, r0,                                  \
                 n - r0 < AMX_ROWS ? n - r0 : AMX_ROWS, (const int32_t *)packed + t.pg[jt] * c.per_group,       \
                 t.pg[jt + 1] - t.pg[jt], starts[a + 1] - starts[a], y + starts[a] * ldy + q * n);             \
    }
            /* One group (a weight's product): items of one cost, each thread a contiguous range, so the unpack's
               read-ahead (4 KiB past its rows) runs into the thread's next item; 16-row products 7.5-8.2 -> 8.1-9.0
               GB/s (Q4_K, Q6_K; the 2-core AMX Xeon, against dynamic items). Several groups: dynamic, their items
               cost as their rows do. */
            if (t.n == 1) {
#pragma omp for schedule(static)
                for (int64_t it = 0; it < items; it++) AMX_GROUPED_ITEM
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++) AMX_GROUPED_ITEM
            }
#undef AMX_GROUPED_ITEM
            if (mem) _tile_release();
            free(mem);
        }
    }
    free(packed);
    free(t.kept);
    return rc;
}

/* y [m, n] (row stride ldy) = X W^T for quantized activations xq [m, k] / xd and weight rows w [n] (row_bytes
   apart), on the tiles (m >= amx_min_rows: the caller asked amx_takes): amx_grouped with one group. Returns 0, -4
   when memory runs out. */
static int amx_gemm(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd,
                    int64_t m, int64_t k, float *y, int64_t ldy, int threads) {
    const int64_t expert = 0, starts[2] = {0, m};
    return amx_grouped(type, &w, 1, n, row_bytes, 0, &expert, starts, 1, xq, xd, k, y, ldy, threads);
}
#endif

/* the activation rows from which a product on this type takes the tiles here; 0 when it never does (not a tile
   type, no tiles in this build) */
int64_t mls_int8_tile_rows(int type) {
#ifdef MLS_AMX
    return amx_type(type) ? amx_min_rows(type) : 0;
#else
    (void)type;
    return 0;
#endif
}

/* whether this build has the tiles and the process may use them: 1 yes, 0 a build without AMX-INT8 (or not on
   Linux), -errno the kernel refused the tile state */
int mls_int8_tiles(void) {
#ifdef MLS_AMX
    return amx_permission();
#else
    return 0;
#endif
}

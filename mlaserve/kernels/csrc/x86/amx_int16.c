/* ------------------------- int16 products of the 32-value block types on the AMX-INT8 tiles: each code as two bytes
   Where the process has the AMX-INT8 tiles, a product of an int16 type (qw_type: Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4, d
   times an int8 code per value) of QA_MIN_ROWS activation rows or more takes the same
   integers on the tile unit. An activation code is c = 256 h + l (h = c >> 8 in -128..127, l = c & 255 in 0..255), so
     S_b[r, i] = 256 sum_{k in b} q[r, k] h[i, k] + sum_{k in b} q[r, k] l[i, k]     (TDPBSSD, TDPBSUD: exact int32)
   and the block's float step is qw_tile's: y[i, r] += fl(d[r, b] d_x[i, b]) fl(S_b[r, i]), block by block. The same
   bits as the VNNI panels and rows (tests/kernels/test_int16_prefill.py compares a row's result at every row count),
   with two tile products in place of 512 vpdpwssd and broadcasts per block of 16 weight and 16 activation rows.
   Layout (one 32-value block b: K = 32, half a tile's depth; 16 weight rows r, one group of 16 activation rows i)
     A [16 r, 32]           int8    the weight rows' codes of block b: Q8_0's loaded from the blocks as they lie (a
                                    tile row per weight row, row_bytes apart: no unpack), the others' unpacked
                                    per block (qw_codes) into a 16 x 32 tile
     B_h, B_l [8, 16 i x 4] int8 / uint8   the activation rows' high and low bytes, 4 consecutive values per int32,
                                    packed once per call (qa_pack: xbh, xbl [group][kb][8][16] int32, each group's
                                    rows padded with zeros to 16), their scales xdt [group][kb][16]
     C_h, C_l [16 r, 16 i]  int32   = A B_h, A B_l; 256 C_h + C_l = S_b
   acc[r] (lanes i) += fl(d[r, b] d_x[i, b]) fl(S_b[r, :]); the 16 x 16 sums are transposed into y's rows at the end. */
#if defined(MLS_INT16_PANELS) && defined(MLS_AMX)
#define MLS_INT16_TILES 1 /* this build runs them (int16.c, moe/block.c ask) */

/* the tile shapes: A (tile 0) 16 x 32 bytes, B_h, B_l (1, 2) 8 x 64, C_h, C_l (3, 4) 16 x 64 */
static amx_cfg_t qa_shapes(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = t == 1 || t == 2 ? 8 : 16;
        c.colsb[t] = t == 0 ? 32 : 64;
    }
    return c;
}

/* this thread's tile shapes made qa_shapes' */
static void qa_config(void) {
    const amx_cfg_t c = qa_shapes();
    _tile_loadconfig(&c);
}

/* activation rows from which a product takes the tiles: one weight's GB/s (benchmarks/gemv_bandwidth.py --rows,
   2 threads; the 2-core AMX Xeon of 2026-12-06), tiles / VNNI panels. Q8_0 (1536 x 2048, 2048 x 1536, 32768 x 2048):
   16 rows 10.1-13.5 / 5.4-6.1, 8 rows 11.2-12.4 / 6.8-7.9, 6 rows 10.3-12.1 / 7.5-10.3, 4 rows 10.2-12.5 / 7.6-11.2.
   Q5_0 (2048 x 10944, 2816 x 2048; its codes unpacked per block): 16 rows 6.2-8.1 / 3.4-5.0, 8 rows 6.3-8.2 /
   4.3-7.3, 4 rows 6.7-8.8 / 4.6-9.7. 1-3 rows keep the weight rows read in place (qw_few: 17-20 GB/s at one row),
   where a tile pass would cost what 16 rows do. The same bits either way. Measured on one CPU (a 2-core
   Sapphire-Rapids-class Xeon), to be measured on others. */
#define QA_MIN_ROWS 4

/* whether a product of m rows of this type runs here on the tiles */
static inline int qa_takes(int type, int64_t m) { return qw_type(type) && m >= QA_MIN_ROWS && amx_permission() == 1; }

/* one group of mr (<= 16) activation rows (codes xc in qw_quantize_row's pair order, k apart; scales xd, k / 32
   apart) into B_h, B_l [kb][8][16] and xdt [kb][16]; rows past mr zero */
static void qa_pack(const int16_t *xc, const float *xd, int64_t mr, int64_t k, int32_t *bh, int32_t *bl, float *xdt) {
    static const int16_t swap12[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                       16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
    const __m512i natural = _mm512_loadu_si512(swap12);
    const int64_t kb = k / 32;
    for (int64_t b = 0; b < kb; b += 2) {
        const int two = b + 1 < kb;
        __m512i vh[16], vl[16];
        for (int i = 0; i < 16; i++) {
            __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, l[2] = {h[0], h[0]};
            for (int j = 0; i < mr && j <= two; j++) {
                const __m512i c = _mm512_permutexvar_epi16(natural, _mm512_loadu_si512(xc + i * k + 32 * (b + j)));
                l[j] = _mm512_cvtepi16_epi8(c); /* the low bytes */
                h[j] = _mm512_cvtepi16_epi8(_mm512_srai_epi16(c, 8));
            }
            vh[i] = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
            vl[i] = _mm512_inserti64x4(_mm512_castsi256_si512(l[0]), l[1], 1);
        }
        transpose16_epi32(vh); /* vh[8 j + t]: dword t (values 4 t .. 4 t + 3) of block b + j, lane i */
        transpose16_epi32(vl);
        for (int j = 0; j <= two; j++) {
            for (int t = 0; t < 8; t++) {
                _mm512_store_si512(bh + ((b + j) * 8 + t) * 16, vh[8 * j + t]);
                _mm512_store_si512(bl + ((b + j) * 8 + t) * 16, vl[8 * j + t]);
            }
            for (int i = 0; i < 16; i++) xdt[(b + j) * 16 + i] = i < mr ? xd[i * kb + b + j] : 0.0f;
        }
    }
}

/* 16 weight rows of an int16 type (qw_type) at w (row_bytes apart) times one packed group of activation rows into y
   rows [0, mr) (row stride ldy); type a constant where inlined. Q8_0's codes are the A tile as they lie; the other
   types' blocks give theirs through qw_codes (the VNNI panels' unpacking: the same integers), 16 rows of a block
   into a 512-byte tile per block. The next 16 weight rows stream into L2 beside the reads, as qw_few's. */
static inline __attribute__((always_inline)) void qa_pass_t(const int type, const uint8_t *w, int64_t row_bytes,
                                                            const int32_t *bh, const int32_t *bl, const float *xdt,
                                                            int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32, step = (16 * row_bytes + kb - 1) / kb, bytes = block_bytes(type);
    const __m512i offs = rows16_offsets(row_bytes);
    const char *pf = (const char *)w + 16 * row_bytes;
    int32_t cs[2][256] __attribute__((aligned(64)));
    int8_t a[16 * 32] __attribute__((aligned(64)));
    float d[16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        pf = rows16_prefetch(pf, w, row_bytes, b, step);
        if (type == MLS_Q8_0)
            _tile_loadd(0, w + 34 * b + 2, row_bytes);
        else {
            for (int r = 0; r < 16; r++) _mm256_store_si256((__m256i *)(a + 32 * r), qw_codes(w + r * row_bytes + bytes * b, type));
            _tile_loadd(0, a, 32);
        }
        _tile_loadd(1, bh + b * 128, 64);
        _tile_loadd(2, bl + b * 128, 64);
        _tile_zero(3);
        _tile_zero(4);
        _tile_dpbssd(3, 0, 1);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(3, cs[0], 64);
        _tile_stored(4, cs[1], 64);
        _mm512_store_ps(d, qw_scales(w + bytes * b, offs, 0xFFFF, type));
        const __m512 dx = _mm512_load_ps(xdt + 16 * b);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) {
            const __m512i S = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cs[0] + 16 * r), 8),
                                               _mm512_load_si512(cs[1] + 16 * r));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), _mm512_cvtepi32_ps(S), acc[r]);
        }
    }
    __m512i v[16];
    for (int r = 0; r < 16; r++) v[r] = _mm512_castps_si512(acc[r]);
    transpose16_epi32(v); /* v[i]: lane r = acc[r][i] */
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * ldy, _mm512_castsi512_ps(v[i]));
}

#define QA_PASS_CASE(t)                                                                                       \
    case t: qa_pass_t(t, w, row_bytes, bh, bl, xdt, mr, k, y, ldy); break;
static void qa_pass(int type, const uint8_t *w, int64_t row_bytes, const int32_t *bh, const int32_t *bl,
                    const float *xdt, int mr, int64_t k, float *y, int64_t ldy) {
    switch (type) {
        QA_PASS_CASE(MLS_Q8_0) QA_PASS_CASE(MLS_Q4_0) QA_PASS_CASE(MLS_Q5_0) QA_PASS_CASE(MLS_IQ4_NL)
        QA_PASS_CASE(MLS_MXFP4)
    default: break;
    }
}
#undef QA_PASS_CASE

/* 16 weight rows of an int16 type at w times m activation rows packed by qa_pack (groups of 16, kb * 128 int32 of
   each byte and kb * 16 scales apart) into y (row stride ldy) */
static void qa_rows(int type, const uint8_t *w, int64_t row_bytes, const int32_t *bh, const int32_t *bl,
                    const float *xdt, int64_t m, int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32;
    for (int64_t s = 0; 16 * s < m; s++)
        qa_pass(type, w, row_bytes, bh + s * kb * 128, bl + s * kb * 128, xdt + s * kb * 16,
                m - 16 * s < 16 ? (int)(m - 16 * s) : 16, k, y + 16 * s * ldy, ldy);
}

/* the codes xc / scales xd (k values a row; row starts[a] - starts[0] is group a's first) of every group with off[a]
   >= 0 packed for qa_rows at packed row off[a] of bh, bl, dx: a loop of the calling team (every thread calls it) */
static void qa_pack_groups(const int16_t *xc, const float *xd, const int64_t *starts, const int64_t *off, int64_t groups,
                           int64_t k, int32_t *bh, int32_t *bl, float *dx) {
    const int64_t kb = k / 32;
#pragma omp for schedule(dynamic)
    for (int64_t a = 0; a < groups; a++) {
        const int64_t i0 = starts[a] - starts[0], rows = starts[a + 1] - starts[a];
        for (int64_t s = 0; off[a] >= 0 && 16 * s < rows; s++) {
            const int64_t g16 = off[a] / 16 + s, i = i0 + 16 * s;
            qa_pack(xc + i * k, xd + i * kb, rows - 16 * s < 16 ? rows - 16 * s : 16, k, bh + g16 * kb * 128,
                    bl + g16 * kb * 128, dx + g16 * kb * 16);
        }
    }
}
#else
#define QA_MIN_ROWS 4 /* (no tiles in this build: never reached) */
static inline int qa_takes(int type, int64_t m) {
    (void)type, (void)m;
    return 0;
}
#endif

/* room for rows packed rows of k values (qa_pack's layout; rows padded to 16): *h, *l and *dx in one allocation (free
   *h); 0, or -4 out of memory */
static int qa_alloc(int64_t rows, int64_t k, int32_t **h, int32_t **l, float **dx) {
    const size_t padded = (size_t)(rows + 15) / 16 * 16, bytes = padded * (size_t)k;
    *h = (int32_t *)aligned_alloc(64, 2 * bytes + sizeof(float) * padded * (size_t)(k / 32) + 64);
    if (!*h) return -4;
    *l = *h + bytes / 4, *dx = (float *)(*l + bytes / 4);
    return 0;
}

/* each group's first packed row off[a] (groups of rows [starts[a], starts[a + 1]); those of min_rows rows or more
   (the tile kind's crossover: QA_MIN_ROWS for the int16 tiles, the int8 hooks' amx_min_rows), each padded to a
   multiple of 16, so group a's first pack of 16 rows is off[a] / 16; -1 the others, whose rows stay on the row
   kernels); returns the packed rows */
static inline int64_t tile_offsets(const int64_t *starts, int64_t groups, int64_t min_rows, int64_t *off) {
    int64_t rows = 0;
    for (int64_t a = 0; a < groups; a++) {
        const int64_t n = starts[a + 1] - starts[a];
        off[a] = n >= min_rows ? rows : -1;
        rows += n >= min_rows ? (n + 15) / 16 * 16 : 0;
    }
    return rows;
}

/* ---------------------------------------------------- AMX-BF16 tiles: Q8_0 products, activations as bf16 pairs
   Prefill products of Q8_0 weights (more than GEMV_ROWS activation rows) on the bf16 tile unit, without giving up
   fp32-grade results. A Q8_0 code q is an int8, exact in bf16; each activation is split into two bfloat16s, its
   rounding and the rounding's remainder; the unit sums code times both halves in fp32 per 32-value block, and the
   block's fp16 scale multiplies that sum in fp32 outside the unit. Plain bf16 (the weight value d q and x rounded)
   adds ~0.57x a Q8_0 file's own quantization error (kernels/bf16_prefill.py); this adds ~2^-16 per product.

   Notation (one product y = x W^T; bf = round to nearest even bfloat16, u = 2^-8):
     w = d q               a Q8_0 weight value: fp16 block scale d times int8 code q (the reference's value)
     x_h = bf(x), x_l = bf(x - x_h)      (x - x_h exact in fp32; |x - x_h - x_l| <= u^2 |x|)
     S_b[r, i] = sum_{k in block b} q[r, k] (x_h + x_l)[i, k]     two tile products (codes x x_h, codes x x_l):
                                                                  products exact, sums fp32 inside the unit
     y[i, r] = sum_b d[r, b] S_b[r, i]   fp32, one fma per block in block order
     error: |y - x W^T| <= (u^2 + (K / 32 + 65) 2^-24 (1 + 2u)) sum_k |x_k| |w_k|
            (the remainder's remainder; <= 64 roundings inside a block's two tile products, one per block outside)
   Layout (TDPBF16PS C[r, i] += sum_p A[r, 2p] B[p, i].lo + A[r, 2p + 1] B[p, i].hi, tiles of 16 x 64 bytes):
     A  codes    per block of 32 weight rows and depth chunk (bx_weights, once per call): [blocks][2 tiles][16 rows]
                 [32 bf16], with their scales d [blocks][32]
     B  acts     X' [groups, 2K / 32, 16 pairs, 16 rows] (bx_acts, once per call): per block x_h(b), x_l(b)
     C  [r, i]   the block's sums S_b, 2 weight tiles x 2 activation groups in tiles 0-3, stored and scaled into
                 acc [blocks][pairs of groups][4 tiles][16][16] fp32 (bx_block), written transposed into y [i, r]
   A row's result is the same whatever the batch: its 16-row group's tiles take the same steps in the same order.
   The unit treats bf16 subnormal inputs as zero and flushes fp32 subnormal outputs (below 2^-126: no effect at
   activation scales); an infinite x becomes NaN (x - x_h), which the engine's NaN checks report. */
#if defined(MLS_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MLS_AMX_BF16 1
#define BX_BLOCK 32                   /* weight rows per block (two A tiles) */
#define BX_STEP_BYTES (16 * 16 * 4)   /* one B tile: 16 pairs x 16 rows */

/* this thread's tile configuration: palette 1, all 8 tiles 16 rows x 64 bytes (every bf16 kernel's shape) */
static void bx_load_full_tiles(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* 32 fp32 values (v0: 0-15, v1: 16-31) -> their bf16 split: hi = bf(v), lo = bf(v - hi), each as 32 bf16 in
   order (16 int32 lanes, lane p = values 2p | 2p + 1 << 16: a tile row, and a B pair) */
static inline void bx_split(__m512 v0, __m512 v1, __m512i *hi, __m512i *lo) {
    const __m256i h0 = (__m256i)_mm512_cvtneps_pbh(v0), h1 = (__m256i)_mm512_cvtneps_pbh(v1);
    const __m512 f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
    const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, f1), _mm512_sub_ps(v0, f0));
}

/* r [16] rows of 16 int32 -> their transpose in place (r[c] = column c): 32-bit, 64-bit, then 128-bit interleaves */
static inline void bx_transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* rows 4g .. 4g + 3: b[4g + j] holds column 4L + j of them in 128-bit lane L */
        b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) { /* column 4L + j = lane L of b[j], b[4 + j], b[8 + j], b[12 + j] */
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* Activation rows [0, mr) (mr <= 16) of x (row stride ldx) into X' steps [2k / 32][16 pairs][16 rows] int32:
   per 32-value block x_h, x_l (rows past mr zero): each block's 16 rows split, then transposed */
static void bx_acts(const float *x, int64_t ldx, int64_t mr, int64_t k, int32_t *xp) {
    const int64_t nb = k / 32;
    for (int64_t b = 0; b < nb; b++) {
        __m512i hi[16], lo[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i < mr)
                bx_split(_mm512_loadu_ps(x + i * ldx + 32 * b), _mm512_loadu_ps(x + i * ldx + 32 * b + 16), &hi[i],
                         &lo[i]);
            else
                hi[i] = lo[i] = _mm512_setzero_si512();
        }
        bx_transpose16(hi);
        bx_transpose16(lo);
        int32_t *s = xp + b * 2 * 256;
        for (int p = 0; p < 16; p++) {
            _mm512_storeu_si512(s + 16 * p, hi[p]);
            _mm512_storeu_si512(s + 256 + 16 * p, lo[p]);
        }
    }
}

/* Weight rows [0, nr) (nr <= 32) of Q8_0 blocks (row_bytes apart), values [k0, k0 + kc), into W' in tile order:
   [kc / 32 blocks][2 tiles][16 rows][32 bf16] the codes q (exact in bf16), and their scales dw [kc / 32][32];
   rows past nr zero */
static void bx_weights(const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k0, int64_t kc, int32_t *wp,
                       float *dw) {
    const int64_t nb = kc / 32;
    for (int64_t r = 0; r < BX_BLOCK; r++) {
        int32_t *o = wp + (r / 16) * 256 + (r % 16) * 16; /* the row in block 0: 16 int32 pairs */
        if (r >= nr) {
            for (int64_t b = 0; b < nb; b++) {
                _mm512_storeu_si512(o + b * 512, _mm512_setzero_si512());
                dw[b * BX_BLOCK + r] = 0.0f;
            }
            continue;
        }
        const uint8_t *row = w + r * row_bytes + 34 * (k0 / 32);
        /* the row's next chunk asked for now (a block's 32 rows are 32 streams a row apart, which the hardware's
           prefetcher did not keep ahead of: the first code load of a block held most of this loop's time) */
        for (int64_t o = 0; o < 34 * nb; o += 64) __builtin_prefetch(row + 34 * nb + o, 0, 3);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + 34 * b;
            const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
            const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
            _mm512_storeu_si512(o + b * 512, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
            dw[b * BX_BLOCK + r] = f16(blk);
        }
    }
}

/* One 32-value block of a depth chunk for a block's two weight tiles (A: codes at a) and activation groups b0 (and
   b1 when two; each x_h then x_l): the tiles' integer-code sums S[r, i] = sum q (x_h + x_l), then acc += d_w[r] S in
   fp32, per weight row in order (acc: [4 tiles][16 weight rows][16 activation rows], in L1) */
static inline void bx_block(const char *a, const char *b0, const char *b1, int two, const float *d, float *cb,
                            float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + 1024, 64);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_loadd(6, b0 + BX_STEP_BYTES, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
        _tile_loadd(7, b1 + BX_STEP_BYTES, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cb, 64);
    _tile_stored(2, cb + 512, 64);
    if (two) {
        _tile_stored(1, cb + 256, 64);
        _tile_stored(3, cb + 768, 64);
    }
    const int step = two ? 1 : 2; /* tiles 2a + g: weight tile a, group g (one group: tiles 0 and 2) */
    for (int t = 0; t < 4; t += step)
        for (int rr = 0; rr < 16; rr++) {
            float *y = acc + t * 256 + rr * 16;
            const __m512 dr = _mm512_set1_ps(d[(t / 2) * 16 + rr]);
            _mm512_store_ps(y, _mm512_fmadd_ps(dr, _mm512_load_ps(cb + t * 256 + rr * 16), _mm512_load_ps(y)));
        }
}

/* One activation group's sums of a 32-row block (ca: its two tiles' [16 r][16 i] halves, 512 floats apart) into y:
   per activation row (mr of them, ldy apart) its nr <= 32 outputs gathered from the tiles' column i */
static inline void bx_store(const float *ca, int64_t mr, int64_t nr, float *y, int64_t ldy) {
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    const __mmask16 m0 = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __mmask16 m1 = nr >= 32 ? 0xFFFF : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
    for (int64_t i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, m0, _mm512_i32gather_ps(col, ca + i, 4));
        if (m1) _mm512_mask_storeu_ps(y + i * ldy + 16, m1, _mm512_i32gather_ps(col, ca + 512 + i, 4));
    }
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T for Q8_0 weight rows w [n] (row_bytes apart) on the
   bf16 tiles, as above. The depth is taken BX_KC values at a time (the Goto order): every group's
   activation steps of a chunk stay in L2 while the weight blocks pass, each block's chunk of codes converted once,
   the accumulators kept in acc [blocks][pairs][4 tiles] between chunks and written transposed into y at the end.
   Returns 0, -4 when memory runs out. */
#define BX_KC 256
static int bx_gemm(const uint8_t *w, int64_t n, int64_t row_bytes, const float *x, int64_t ldx, int64_t m, int64_t k,
                   float *y, int64_t ldy, int threads) {
    const int64_t groups = (m + 15) / 16, pairs = (groups + 1) / 2, blocks = (n + BX_BLOCK - 1) / BX_BLOCK;
    const size_t per_group = (size_t)(2 * k / 32) * BX_STEP_BYTES;
    char *packed = (char *)aligned_alloc(64, (size_t)groups * per_group);
    float *acc = (float *)aligned_alloc(64, sizeof(float) * 1024 * (size_t)(blocks * pairs));
    if (!packed || !acc) {
        free(packed);
        free(acc);
        return -4;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++)
        bx_acts(x + g * 16 * ldx, ldx, m - 16 * g < 16 ? m - 16 * g : 16, k, (int32_t *)(packed + g * per_group));
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        /* per thread: the block's codes (2 KiB per 32 values), their scales, the 4 tiles' sums of one block */
        const size_t wbytes = (size_t)(BX_KC / 32) * 2048, dbytes = sizeof(float) * (BX_KC / 32) * BX_BLOCK;
        char *wp = (char *)aligned_alloc(64, wbytes + dbytes + 4096);
        if (!wp) {
#pragma omp atomic write
            rc = -4;
        } else {
            bx_load_full_tiles();
        }
        float *dw = (float *)(wp + wbytes), *cb = (float *)(wp + wbytes + dbytes);
        for (int64_t k0 = 0; k0 < k; k0 += BX_KC) {
            const int64_t kc = k - k0 < BX_KC ? k - k0 : BX_KC, nb = kc / 32;
#pragma omp for schedule(dynamic, 1)
            for (int64_t bi = 0; bi < blocks; bi++) {
                if (!wp) continue;
                const int64_t r0 = bi * BX_BLOCK, nr = n - r0 < BX_BLOCK ? n - r0 : BX_BLOCK;
                bx_weights(w + r0 * row_bytes, row_bytes, nr, k0, kc, (int32_t *)wp, dw);
                for (int64_t pr = 0; pr < pairs; pr++) {
                    const int64_t g = 2 * pr;
                    const char *b0 = packed + g * per_group + (2 * k0 / 32) * BX_STEP_BYTES;
                    float *ca = acc + (bi * pairs + pr) * 1024;
                    if (k0 == 0) memset(ca, 0, sizeof(float) * 1024); /* by the thread that adds into it first */
                    for (int64_t b = 0; b < nb; b++)
                        bx_block(wp + b * 2048, b0 + 2 * b * BX_STEP_BYTES, b0 + per_group + 2 * b * BX_STEP_BYTES,
                                 g + 1 < groups, dw + b * BX_BLOCK, cb, ca);
                }
            }
        }
        if (wp) _tile_release();
        free(wp);
    }
    if (rc == 0) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t bi = 0; bi < blocks; bi++)
                bx_store(acc + (bi * pairs + g / 2) * 1024 + (g % 2) * 256, m - 16 * g < 16 ? m - 16 * g : 16,
                         n - bi * BX_BLOCK < BX_BLOCK ? n - bi * BX_BLOCK : BX_BLOCK, y + 16 * g * ldy + bi * BX_BLOCK,
                         ldy);
    }
    free(packed);
    free(acc);
    return rc;
}

/* One item of bx_grouped: a 32-row block (rows r0 .. of an expert's w) times an expert's split groups (xa, ga of
   them, m rows) over the whole depth: its rows' codes converted chunk by chunk, every pair of groups summed per
   chunk (the same bx_block calls per accumulator in the same order as bx_gemm's), then written into y (the
   expert's first row, the block's first column). wp: the thread's codes and scales of one chunk, then the 4
   tiles' sums, then acc for the item's pairs. */
static void bx_item(const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, int64_t r0, const char *xa, int64_t ga,
                    int64_t m, char *wp, float *y, int64_t ldy) {
    const size_t per_group = (size_t)(2 * k / 32) * BX_STEP_BYTES;
    const size_t wbytes = (size_t)(BX_KC / 32) * 2048, dbytes = sizeof(float) * (BX_KC / 32) * BX_BLOCK;
    float *dw = (float *)(wp + wbytes), *cb = (float *)(wp + wbytes + dbytes), *acc = cb + 1024;
    const int64_t pairs = (ga + 1) / 2, nr = n - r0 < BX_BLOCK ? n - r0 : BX_BLOCK;
    memset(acc, 0, sizeof(float) * 1024 * (size_t)pairs);
    for (int64_t k0 = 0; k0 < k; k0 += BX_KC) {
        const int64_t nb = (k - k0 < BX_KC ? k - k0 : BX_KC) / 32;
        bx_weights(w + r0 * row_bytes, row_bytes, nr, k0, 32 * nb, (int32_t *)wp, dw);
        for (int64_t pr = 0; pr < pairs; pr++) {
            const char *b0 = xa + 2 * pr * per_group + (2 * k0 / 32) * BX_STEP_BYTES;
            for (int64_t b = 0; b < nb; b++)
                bx_block(wp + b * 2048, b0 + 2 * b * BX_STEP_BYTES, b0 + per_group + 2 * b * BX_STEP_BYTES,
                         2 * pr + 1 < ga, dw + b * BX_BLOCK, cb, acc + pr * 1024);
        }
    }
    for (int64_t g = 0; g < ga; g++)
        bx_store(acc + (g / 2) * 1024 + (g % 2) * 256, m - 16 * g < 16 ? m - 16 * g : 16, nr, y + 16 * g * ldy + r0, ldy);
}

/* The grouped form (routed experts): rows [starts[a], starts[a + 1]) of x [P, k] times expert experts[a]'s rows
   (w + experts[a] * expert_stride) into y [P, ldy]. The experts whose split activations fit BX_GROUP_BYTES (a few
   16-row groups: prefill's usual share of a routed expert) run in one parallel region: every such expert's groups
   split (static), then one dynamic list of (expert, 32-row weight block) items over the whole depth (bx_item: the
   activations in L2), the same bits as bx_gemm's without its three parallel regions and a barrier per depth chunk
   per expert. The others go through bx_gemm, one after another. Returns 0, -4 when memory runs out. */
#define BX_GROUP_BYTES (1 << 20)
static int bx_few_rows(int64_t rows, const void *per_group) {
    return (size_t)((rows + 15) / 16) * *(const size_t *)per_group <= BX_GROUP_BYTES;
}
static int bx_grouped(const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
    const size_t per_group = (size_t)(2 * k / 32) * BX_STEP_BYTES;
    const int64_t blocks = (n + BX_BLOCK - 1) / BX_BLOCK;
    amx_picks_t f; /* the experts of few rows */
    if (amx_pick(starts, groups, bx_few_rows, &per_group, &f)) return -4;
    const int64_t packs = f.pg[f.n], items = f.n * blocks;
    char *packed = items ? (char *)aligned_alloc(64, (size_t)packs * per_group) : 0;
    int rc = items && !packed ? -4 : 0;
    if (packed) {
#pragma omp parallel num_threads(threads)
        {
            const size_t wbytes = (size_t)(BX_KC / 32) * 2048, dbytes = sizeof(float) * (BX_KC / 32) * BX_BLOCK;
            char *wp = (char *)aligned_alloc(64, wbytes + dbytes + 4096 + sizeof(float) * 1024 * (size_t)((f.most + 1) / 2));
            if (!wp) {
#pragma omp atomic write
                rc = -4;
            } else {
                bx_load_full_tiles();
            }
            int64_t j = 0;
#pragma omp for schedule(static)
            for (int64_t pi = 0; pi < packs; pi++) {
                const int64_t jt = pack_owner(&f, pi, &j), a = f.kept[jt], i0 = starts[a] + 16 * (pi - f.pg[jt]);
                bx_acts(x + i0 * k, k, starts[a + 1] - i0 < 16 ? starts[a + 1] - i0 : 16, k,
                        (int32_t *)(packed + pi * per_group));
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                if (!wp) continue;
                const int64_t jt = it / blocks, a = f.kept[jt];
                bx_item(w + experts[a] * expert_stride, n, row_bytes, k, it % blocks * BX_BLOCK,
                        packed + f.pg[jt] * per_group, f.pg[jt + 1] - f.pg[jt], starts[a + 1] - starts[a], wp,
                        y + starts[a] * ldy, ldy);
            }
            if (wp) _tile_release();
            free(wp);
        }
    }
    free(packed);
    for (int64_t a = 0; a < groups && rc == 0; a++) { /* the experts of many rows: the Goto order, one by one */
        const int64_t rows = starts[a + 1] - starts[a];
        if (rows > 0 && !bx_few_rows(rows, &per_group))
            rc = bx_gemm(w + experts[a] * expert_stride, n, row_bytes, x + starts[a] * k, k, rows, k, y + starts[a] * ldy,
                         ldy, threads);
    }
    free(f.kept);
    return rc;
}
#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) dequantize(W)^T for Q8_0 rows w [n] (row_bytes apart), on
   the AMX-BF16 tiles with the activations as bf16 pairs (above): 0, -1 this build or process has no bf16 tiles,
   -2 k not a multiple of 32, -4 out of memory */
int mls_q8_0_bf16_pairs(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                        int64_t row_bytes, float *y, int64_t ldy, int threads) {
#ifdef MLS_AMX_BF16
    if (amx_permission() != 1) return -1;
    if (k % 32) return -2;
    if (m == 0 || n == 0) return 0;
    return bx_gemm(w, n, row_bytes, x, ldx, m, k, y, ldy, threads);
#else
    (void)x, (void)m, (void)k, (void)ldx, (void)w, (void)n, (void)row_bytes, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* the grouped form (routed experts): rows [starts[a], starts[a + 1]) of x [P, k] times expert experts[a]'s rows
   (w + experts[a] * expert_stride), into y [P, ldy] (bx_grouped); codes as mls_q8_0_bf16_pairs */
int mls_q8_0_bf16_pairs_grouped(const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                                int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                                float *y, int64_t ldy, int threads) {
#ifdef MLS_AMX_BF16
    if (amx_permission() != 1) return -1;
    if (k % 32) return -2;
    if (n == 0) return 0;
    return bx_grouped(x, k, w, n, row_bytes, expert_stride, experts, starts, groups, y, ldy, threads);
#else
    (void)x, (void)k, (void)w, (void)n, (void)row_bytes, (void)expert_stride, (void)experts, (void)starts;
    (void)groups, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* whether this build has the bf16 tiles and the process may use them: 1 yes, 0 a build without AMX-BF16, -errno
   the kernel refused the tile state */
int mls_bf16_tiles(void) {
#ifdef MLS_AMX_BF16
    return amx_permission();
#else
    return 0;
#endif
}

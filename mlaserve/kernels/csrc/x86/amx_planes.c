/* ---------------------------------------------------------------- AMX-INT8 tiles: Q4_K, Q6_K as digit planes
   The hook (x86/amx.c's contract) of the K-quants whose code times scale fits bytes once the scale is split into
   base-8 digits, so a super-block is 4 tile products per plane with no per-unit work after the tiles. A "unit" =
   the values sharing one integer scale sc: Q4_K 32 (a sub-block, sc 0..63), Q6_K 16 (sc -128..127); codes q:
   Q4_K 0..15, Q6_K q - 32 in -32..31.
     sc = sum_p 8^p s_p   the scale in base-8 digits ("planes" p): Q4_K 2 digits 0..7, Q6_K 3 digits -3..4, so
                          that q * s_p fits the tiles' bytes (Q4_K <= 105 unsigned; Q6_K -128..124 signed)
     A_p [16, k]   int8   q * s_p of each value's unit
     C_p [16, 16]  int32  = sum over a super-block's 256 values of A_p B: 4 tile products of 64 values (TDPBUSD for
                          Q4_K, B's codes signed and A_p's unsigned; TDPBSSD for Q6_K), exact
     S = sum_p 8^p C_p = sum_units sc * (sum of q x over the unit), x86/avx2.c q8k_q45_mr / q8k_q6k_mr's integer sum
   Q4_K has mins (dmin_w, mn); Q6_K none. */
#ifdef MLS_AMX
#define AMX_PLANES 3 /* most scale digits (Q6_K) */

static inline int amx_planes(int type) { return type == MLS_Q6_K ? 3 : 2; }

/* sc -> its base-8 digits: Q4_K (0..63) 0..7 each; Q6_K (-128..127) -3..4 each (the residue mod 8 in -3..4) */
static inline void amx_digits(int32_t sc, int q6, int8_t s[AMX_PLANES]) {
    for (int p = 0; p < AMX_PLANES; p++) {
        const int32_t dgt = q6 ? ((sc + 3) & 7) - 3 : sc & 7;
        s[p] = (int8_t)dgt;
        sc = (sc - dgt) / 8;
    }
}

/* Q4_K's plane bytes q * s_p (q 0..15, s_p 0..7: at most 105) looked up, not multiplied: one shuffle per 32 codes
   and plane where an int16 multiply took six instructions (widen twice, multiply twice, pack, reorder); the same
   bytes. Row d holds d * (0..15) in both 128-bit lanes. */
#define AMX_Q4_ROW(d) \
    {0 * (d), 1 * (d), 2 * (d), 3 * (d), 4 * (d), 5 * (d), 6 * (d), 7 * (d), 8 * (d), 9 * (d), 10 * (d), 11 * (d), \
     12 * (d), 13 * (d), 14 * (d), 15 * (d), 0 * (d), 1 * (d), 2 * (d), 3 * (d), 4 * (d), 5 * (d), 6 * (d), 7 * (d), \
     8 * (d), 9 * (d), 10 * (d), 11 * (d), 12 * (d), 13 * (d), 14 * (d), 15 * (d)}
static const uint8_t AMX_Q4_TIMES[8][32] __attribute__((aligned(32))) = {
    AMX_Q4_ROW(0), AMX_Q4_ROW(1), AMX_Q4_ROW(2), AMX_Q4_ROW(3), AMX_Q4_ROW(4), AMX_Q4_ROW(5), AMX_Q4_ROW(6), AMX_Q4_ROW(7)};
#undef AMX_Q4_ROW

#ifdef __AVX512VBMI__
/* Q6_K's plane bytes by table: row s + 3 holds (q - 32) * s for the 6-bit code q (0..63), s the digits -3..4; a
   byte permute (vpermb) per 16-value unit looks a unit's plane bytes up from its digit's row, where the multiply
   took ten instructions per 32 values and plane; the same bytes */
#define Q6_T8(s, q) ((q) - 32) * (s), ((q) - 31) * (s), ((q) - 30) * (s), ((q) - 29) * (s), ((q) - 28) * (s), \
                    ((q) - 27) * (s), ((q) - 26) * (s), ((q) - 25) * (s)
#define Q6_ROW(s) \
    {Q6_T8(s, 0), Q6_T8(s, 8), Q6_T8(s, 16), Q6_T8(s, 24), Q6_T8(s, 32), Q6_T8(s, 40), Q6_T8(s, 48), Q6_T8(s, 56)}
static const int8_t AMX_Q6_TIMES[8][64] __attribute__((aligned(64))) = {
    Q6_ROW(-3), Q6_ROW(-2), Q6_ROW(-1), Q6_ROW(0), Q6_ROW(1), Q6_ROW(2), Q6_ROW(3), Q6_ROW(4)};
#undef Q6_ROW
#undef Q6_T8

/* one Q6_K super-block q (210 bytes) into its 256 values of the three planes (a, plane bytes apart): the 6-bit
   codes of 64 values per register, each unit's bytes permuted from its digit's table row under the unit's mask */
static inline void amx_q6_unpack_block(const uint8_t *q, int8_t *a, int64_t plane) {
    const int8_t *sc = (const int8_t *)(q + 192);
    /* the digits of the 16 unit scales, all planes at once (amx_digits' steps on int16 lanes), as table rows */
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    int16_t row[AMX_PLANES][16];
    for (int p = 0; p < AMX_PLANES; p++) {
        const __m256i dg = _mm256_sub_epi16(_mm256_and_si256(_mm256_add_epi16(v, _mm256_set1_epi16(3)), _mm256_set1_epi16(7)),
                                            _mm256_set1_epi16(3));
        _mm256_storeu_si256((__m256i *)row[p], _mm256_add_epi16(dg, _mm256_set1_epi16(3)));
        v = _mm256_srai_epi16(_mm256_sub_epi16(v, dg), 3); /* exact: v - dg is a multiple of 8 */
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
        for (int c = 0; c < 2; c++) { /* values 128 h + 64 c ..: groups g = 2 c, 2 c + 1 of q6k_codes */
            __m256i u[2];
            for (int e = 0; e < 2; e++) {
                const int g = 2 * c + e;
                const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(g & 1 ? ql1 : ql0, 4) : (g & 1 ? ql1 : ql0), m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m3);
                u[e] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            }
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(u[0]), u[1], 1);
            const int t = 128 * h + 64 * c, u0 = t >> 4;
            for (int p = 0; p < AMX_PLANES; p++) {
                __m512i o = _mm512_maskz_permutexvar_epi8(0xFFFFULL, idx, _mm512_load_si512(AMX_Q6_TIMES[row[p][u0]]));
                o = _mm512_mask_permutexvar_epi8(o, 0xFFFFULL << 16, idx, _mm512_load_si512(AMX_Q6_TIMES[row[p][u0 + 1]]));
                o = _mm512_mask_permutexvar_epi8(o, 0xFFFFULL << 32, idx, _mm512_load_si512(AMX_Q6_TIMES[row[p][u0 + 2]]));
                o = _mm512_mask_permutexvar_epi8(o, 0xFFFFULL << 48, idx, _mm512_load_si512(AMX_Q6_TIMES[row[p][u0 + 3]]));
                _mm512_storeu_si512(a + p * plane + t, o);
            }
        }
    }
}
#endif

/* a Q4_K super-block q into the planes at a (plane apart): its sub-block scales as digits on the codes; its
   mins, d and dmin into o at super-block index `at` (row * blocks per row + block). The 12 scale bytes are unpacked
   in one vector (k_scales_mins8, the row kernels' unpacking) and split into their two digits there (sc & 7, sc >> 3:
   amx_digits' Q4_K digits), the mins widened into the int16 pairs o->mn holds: the scalar unpacking and the digit
   loop per sub-block had taken most of this function's time (perf, a 16-row Q4_K product). */
static void amx_q4k_unpack_block(const uint8_t *q, int8_t *a, int64_t plane, const amx_rows_t *o, int64_t at) {
    const __m128i sm = k_scales_mins8(q + 4); /* bytes: scales 0..7, mins 0..7 */
    _mm_storeu_si128((__m128i *)(o->mn + at * 4), _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
    o->d[at] = f16(q);
    o->dmin[at] = f16(q + 2);
    uint8_t dg[2][16];
    _mm_storeu_si128((__m128i *)dg[0], _mm_and_si128(sm, _mm_set1_epi8(7)));
    _mm_storeu_si128((__m128i *)dg[1], _mm_and_si128(_mm_srli_epi16(sm, 3), _mm_set1_epi8(7)));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
        const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        for (int p = 0; p < 2; p++) {
            const __m256i t0 = _mm256_load_si256((const __m256i *)AMX_Q4_TIMES[dg[p][2 * c]]);
            const __m256i t1 = _mm256_load_si256((const __m256i *)AMX_Q4_TIMES[dg[p][2 * c + 1]]);
            _mm256_storeu_si256((__m256i *)(a + p * plane + 64 * c), _mm256_shuffle_epi8(t0, lo));
            _mm256_storeu_si256((__m256i *)(a + p * plane + 64 * c + 32), _mm256_shuffle_epi8(t1, hi));
        }
    }
}

#ifndef __AVX512VBMI__
/* a Q6_K super-block q into the planes at a without VBMI: each 16-value unit's codes times its scale's digits in
   int16 (amx_q6_unpack_block's bits, tests/kernels/test_int8_tiles.py) */
static void amx_q6_unpack_block_mul(const uint8_t *q, int8_t *a, int64_t plane) {
    const int8_t *sc = (const int8_t *)(q + 192);
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
        for (int g = 0; g < 4; g++) {
            const int t = 128 * h + 32 * g;
            const __m256i codes = q6k_codes(ql0, ql1, qh, g);
            int8_t s0[AMX_PLANES], s1[AMX_PLANES];
            amx_digits(sc[t >> 4], 1, s0);
            amx_digits(sc[(t >> 4) + 1], 1, s1);
            /* the two 16-value units of the group, each with its digits: the digit vectors per lane */
            for (int p = 0; p < 3; p++) {
                const __m256i dg = _mm256_set_m128i(_mm_set1_epi16(s1[p]), _mm_set1_epi16(s0[p]));
                const __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes)),
                                                      _mm256_permute2x128_si256(dg, dg, 0x00));
                const __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1)),
                                                      _mm256_permute2x128_si256(dg, dg, 0x11));
                const __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8);
                _mm256_storeu_si256((__m256i *)(a + p * plane + t), v);
            }
        }
    }
}
#endif

static void amx_plane_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, const amx_rows_t *o) {
    const int64_t kb = k / 256, plane = AMX_ROWS * k;
    const int q6 = type == MLS_Q6_K;
    const int64_t bytes = q6 ? 210 : 144;
    const char *pf = (const char *)w + PREFETCH_AHEAD; /* the rows' bytes as one stream (common.h) */
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *b = w + r * row_bytes;
        int8_t *a = o->a + r * k;
        for (int64_t blk = 0; blk < kb; blk++) {
            const uint8_t *q = b + blk * bytes;
            pf = prefetch_stream(pf, q);
            if (!q6) {
                amx_q4k_unpack_block(q, a + blk * 256, plane, o, r * kb + blk);
                continue;
            }
            o->d[r * kb + blk] = f16(q + 208);
#ifdef __AVX512VBMI__
            amx_q6_unpack_block(q, a + blk * 256, plane);
#else
            amx_q6_unpack_block_mul(q, a + blk * 256, plane);
#endif
        }
    }
}

/* tiles 0..2: C_p; 3: B; 4..6: A_p; each 16 rows of 64 bytes */
static void amx_plane_tiles(int type, amx_cfg_t *c) {
    (void)type;
    for (int t = 0; t < 7; t++) {
        c->rows[t] = AMX_ROWS;
        c->colsb[t] = 64;
    }
}

/* Super-block blk into acc: the planes' C_p (4 tile products each), S = sum_p 8^p C_p per row to amx_accumulate */
static void amx_plane_product(int type, const amx_rows_t *W, int64_t blk, const amx_acts_t *x, int64_t k, float *acc) {
    const int q6 = type == MLS_Q6_K;
    const int64_t plane = AMX_ROWS * k;
    const int32_t *xp = x->xp;
    int32_t cbuf[AMX_PLANES][AMX_ROWS * 16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t c0 = blk * 256; c0 < (blk + 1) * 256; c0 += 64) {
        _tile_loadd(3, xp + c0 / 4 * AMX_ROWS, 64);
        _tile_loadd(4, W->a + c0, k);
        _tile_loadd(5, W->a + plane + c0, k);
        if (q6) {
            _tile_loadd(6, W->a + 2 * plane + c0, k);
            _tile_dpbssd(0, 4, 3);
            _tile_dpbssd(1, 5, 3);
            _tile_dpbssd(2, 6, 3);
        } else {
            _tile_dpbusd(0, 4, 3);
            _tile_dpbusd(1, 5, 3);
        }
    }
    _tile_stored(0, cbuf[0], 64);
    _tile_stored(1, cbuf[1], 64);
    if (q6) _tile_stored(2, cbuf[2], 64);
    for (int r = 0; r < AMX_ROWS; r++) {
        __m512i s = _mm512_add_epi32(_mm512_load_si512(cbuf[0] + 16 * r), _mm512_slli_epi32(_mm512_load_si512(cbuf[1] + 16 * r), 3));
        if (q6) s = _mm512_add_epi32(s, _mm512_slli_epi32(_mm512_load_si512(cbuf[2] + 16 * r), 6));
        amx_accumulate(W, !q6, blk, k / 256, x, r, s, acc + 16 * r);
    }
}

static amx_hook_t amx_plane_hook(int type) {
    const amx_hook_t h = {amx_planes(type), 0, 1.0f, amx_plane_tiles, amx_plane_unpack, amx_plane_product};
    return h;
}
#undef AMX_PLANES
#endif

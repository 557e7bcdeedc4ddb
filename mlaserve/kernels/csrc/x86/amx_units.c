/* ---------------------------------------------------------------- AMX-INT8 tiles: scaled 32-value units
   The hook (x86/amx.c's driver and contract) of the super-block types whose VNNI int8 kernels (x86/avx2.c
   q8k_iq4xs_mr, q8k_grid_mr, q8k_q45_mr) sum, per super-block of 256 values, each 32-value sub-block's code
   products exactly and multiply that sum by the sub-block's integer scale: IQ4_XS (codes IQ4_NL's table values
   -127..113, scales -32..31), IQ2_XXS / IQ3_XXS / IQ3_S / IQ1_S (signed grid codes, |q| <= 62, IQ1: 8 g +- 1;
   odd scales 1..31), Q5_K (codes 0..31, scales 0..63, mins as Q4_K's), and with a scale per 16-value half
   IQ2_XS / IQ2_S / IQ1_M. A code times its scale does not fit a byte here (x86/amx_planes.c's base-8 digit
   planes need |q s_p| <= 127), so the tiles sum one unit (the u = 32 or 16 values sharing a scale) per product
   and the scale applies to the int32 sums:

   Notation (one pass: 16 weight rows r, 16 activation rows i, super-block blk, units j = 0 .. 256 / u - 1):
     A_j [16, u]    int8   the weight rows' codes of unit j (unpacked once per call for all activation rows)
     B_j [u / 4, 64] int8  the activation rows' codes of unit j, 4 consecutive values per int32 (x86/amx.c
                           amx_pack's layout: quads j u / 4 .. (j + 1) u / 4 - 1 of the super-block)
     C_j [16, 16]   int32  = A_j B_j (TDPBSSD, K = u: half (u 32) or a quarter (u 16) of a tile's depth), exact
     S   [16, 16]   int32  = sum_j ls[r, j] C_j[r, :], the VNNI kernel's integer sum (exact: |S| < 2^28)
   The driver's float steps then follow the VNNI kernels': Q5_K has mins (as Q4_K's), the grid types' factor is
   their power of two (iq_int_factor), IQ4_XS's and Q5_K's 1. */
#ifdef MLS_AMX
#define AMX_UNITS_MAX 16 /* units per super-block, at most (u = 16) */

/* u: the values sharing one integer scale, one tile product's depth */
static inline int amx_unit_size(int type) { return type == MLS_IQ2_XS || type == MLS_IQ2_S || type == MLS_IQ1_M ? 16 : 32; }

static inline int amx_unit_bytes(int type) {
    switch (type) {
    case MLS_IQ4_XS: return 136;
    case MLS_IQ2_XXS: return 66;
    case MLS_IQ3_XXS: return 98;
    case MLS_IQ3_S: return 110;
    case MLS_IQ1_S: return 50;
    case MLS_IQ2_XS: return 74;
    case MLS_IQ2_S: return 82;
    case MLS_IQ1_M: return 56;
    default: return 176; /* Q5_K */
    }
}

/* a grid type's sub-block ib: its 32 signed codes (IQ1's delta folded in) from the int8 products' operands
   (x86/avx2.c sign_grid32: the grid bytes with their signs applied in one instruction; iq1_operands) and its halves'
   scales ls[0], ls[1] (equal but for IQ2_XS, IQ2_S, IQ1_M) */
static inline __m256i amx_grid_codes(const uint8_t *b, int type, int ib, int32_t ls[2]) {
    __m256i u, sg;
    iq_ls(b, type, ib, ls);
    if (type == MLS_IQ1_S || type == MLS_IQ1_M) {
        iq1_operands(b, type, ib, &u, &sg);
        return sg;
    }
    sign_grid32(b, type, ib, &u, &sg);
    return _mm256_sign_epi8(u, sg);
}

static void amx_unit_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, const amx_rows_t *o) {
    const int u = amx_unit_size(type);
    const int64_t kb = k / 256, units = k / u, bytes = amx_unit_bytes(type);
    const char *pf = (const char *)w + PREFETCH_AHEAD; /* the rows' bytes as one stream (common.h) */
    for (int64_t r = 0; r < nr; r++) {
        int8_t *a = o->a + r * k;
        int32_t *ls = o->ls + r * units;
        for (int64_t blk = 0; blk < kb; blk++) {
            const uint8_t *b = w + r * row_bytes + blk * bytes;
            pf = prefetch_stream(pf, b);
            int8_t *ab = a + blk * 256;
            int32_t *lb = ls + blk * (256 / u);
            if (type == MLS_IQ4_XS) {
                o->d[r * kb + blk] = f16(b);
                iq4_xs_ls(b, lb);
                for (int ib = 0; ib < 8; ib++) _mm256_storeu_si256((__m256i *)(ab + 32 * ib), iq4_codes32(b + 8 + 16 * ib));
            } else if (type == MLS_Q5_K) {
                int32_t mn[8];
                k_scales_int(b + 4, lb, mn);
                for (int j = 0; j < 4; j++) o->mn[r * kb * 4 + blk * 4 + j] = (mn[2 * j] & 0xFFFF) | (mn[2 * j + 1] << 16);
                o->d[r * kb + blk] = f16(b);
                o->dmin[r * kb + blk] = f16(b + 2);
                const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                for (int j = 0; j < 8; j++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (j / 2)));
                    const __m256i lo = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(raw, 4) : raw, m4);
                    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one), 4);
                    _mm256_storeu_si256((__m256i *)(ab + 32 * j), _mm256_or_si256(lo, hi));
                }
            } else {
                const float dw = iq_int_d(b, type);
                o->d[r * kb + blk] = dw;
                for (int ib = 0; ib < 8; ib++) {
                    int32_t l2[2];
                    _mm256_storeu_si256((__m256i *)(ab + 32 * ib), amx_grid_codes(b, type, ib, l2));
                    if (u == 16)
                        lb[2 * ib] = l2[0], lb[2 * ib + 1] = l2[1];
                    else
                        lb[ib] = l2[0];
                }
            }
        }
    }
}

/* tiles 0..3: C_j of 4 units; 4, 5: A_j [16, u]; 6, 7: B_j [u / 4, 64] */
static void amx_unit_tiles(int type, amx_cfg_t *c) {
    const int u = amx_unit_size(type);
    for (int t = 0; t < 8; t++) {
        c->rows[t] = (uint8_t)(t < 6 ? AMX_ROWS : u / 4);
        c->colsb[t] = (uint16_t)(t < 4 || t >= 6 ? 64 : u);
    }
}

/* C_j of super-block blk into tile t, through A tile ta and B tile tb (tile numbers: literal immediates) */
#define AMX_UNIT_DP(t, j, ta, tb)                                                                              \
    do {                                                                                                       \
        _tile_loadd(tb, xp + (blk * 256 + u * (j)) / 4 * AMX_ROWS, 64);                                         \
        _tile_loadd(ta, W->a + blk * 256 + u * (j), k);                                                         \
        _tile_dpbssd(t, ta, tb);                                                                                \
    } while (0)

/* Super-block blk into acc: the units' C_j, 4 at a time (alternating A and B tiles, so a load need not wait for
   the previous product), each times its integer scale in int32, each row's S to amx_accumulate */
static void amx_unit_product(int type, const amx_rows_t *W, int64_t blk, const amx_acts_t *x, int64_t k, float *acc) {
    const int u = amx_unit_size(type), per = 256 / u;
    const int32_t *xp = x->xp;
    const int64_t units = k / u;
    int32_t cbuf[AMX_UNITS_MAX][AMX_ROWS * 16] __attribute__((aligned(64)));
    for (int h = 0; h < per / 4; h++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        AMX_UNIT_DP(0, 4 * h, 4, 6);
        AMX_UNIT_DP(1, 4 * h + 1, 5, 7);
        AMX_UNIT_DP(2, 4 * h + 2, 4, 6);
        AMX_UNIT_DP(3, 4 * h + 3, 5, 7);
        _tile_stored(0, cbuf[4 * h], 64);
        _tile_stored(1, cbuf[4 * h + 1], 64);
        _tile_stored(2, cbuf[4 * h + 2], 64);
        _tile_stored(3, cbuf[4 * h + 3], 64);
    }
    for (int r = 0; r < AMX_ROWS; r++) {
        const int32_t *ls = W->ls + r * units + blk * per;
        __m512i s = _mm512_mullo_epi32(_mm512_set1_epi32(ls[0]), _mm512_load_si512(cbuf[0] + 16 * r));
        for (int j = 1; j < per; j++) s = _mm512_add_epi32(s, _mm512_mullo_epi32(_mm512_set1_epi32(ls[j]), _mm512_load_si512(cbuf[j] + 16 * r)));
        amx_accumulate(W, type == MLS_Q5_K, blk, k / 256, x, r, s, acc + 16 * r);
    }
}
#undef AMX_UNIT_DP

static amx_hook_t amx_unit_hook(int type) {
    /* the grids' row sums end times their power of two (x86/avx2.c q8k_grid_mr: y = acc * factor) */
    const float factor = type == MLS_IQ4_XS || type == MLS_Q5_K ? 1.0f : iq_int_factor(type);
    const amx_hook_t h = {1, 256 / amx_unit_size(type), factor, amx_unit_tiles, amx_unit_unpack, amx_unit_product};
    return h;
}
#undef AMX_UNITS_MAX
#endif

/* ---------------------------------------------- int8 products of many rows on VNNI weight panels (AVX512-VNNI)
   For the int8 products int8.c runs (q8_K activations: codes, per 256 values a scale d_x and per 32 the code sums)
   where the CPU has AVX512-VNNI but the process no AMX-INT8 tiles, and a product has at least vnni_min_rows
   activation rows (prefill's routed experts and dense products, batched decode): Q4_K, Q5_K, Q6_K and the i-quants
   on q8_K activations (IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M; the AMX tiles' types). The row
   kernels (x86/avx2.c q8k_*_mr) unpack a weight super-block once per 4 activation rows and reduce 8 lanes per row
   and super-block; here
   16 weight rows lie in the 16 int32 lanes of a vector, unpacked once per call into a thread's panel, and each
   activation row meets them with one vpdpbusd per 4 values (its 4 codes broadcast) and no horizontal sums.

   Notation (one panel: weight rows r0 .. r0 + 16, lane r; super-block blk of 256 values, sub-block j of 32 values,
   dword t of 4 values; activation row i)
     C  [kb, 8 j, 8 t, 16 r] u8 x 4  codes of weight row r, values 256 blk + 32 j + 4 t .. + 3 (Q5_K: 5 bits)
     sc [kb, 16, 16 r] int32         the sub-block scales (j < 8; per 16 values G for Q6_K and the i-quants);
                                     mn [kb, 4 p, 16 r] int32 the mins as int16 pairs
                                     (mn_2p | mn_2p+1 << 16);  d, dmin [kb, 16 r] fp32 the super-block scales
     a_j[r] = sum_t vpdpbusd(C[blk, j, t, r], x_i[256 blk + 32 j + 4 t .. + 3])     (exact int32)
     S[r]   = sum_j sc[blk, j, r] a_j[r]        M[r] = sum_p madd(mn[blk, p, r], bsum_i[2p], bsum_i[2p + 1])
     y[i, r] += (d[r] d_x) S[r];   y[i, r] -= (dmin[r] d_x) M[r]             (per super-block, in order)
   The types with a scale per 16 values (Q6_K, the i-quants) keep codes w + off in C (unsigned; vnni_offset) and take
   off X_G (the activation row's code sum over those 16 values) from each sum before its scale: vnni_tile.
   S and M are the row kernels' integers (exact: |S| < 2^28) and the float steps theirs in their order per (i, r)
   (-ffp-contract=off), so every output is theirs bit for bit, whatever the batch, the tile or the thread
   (tests/kernels/test_int8_panels.py). */
#if defined(MLS_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(MLS_NO_INT8_PANELS)
#define MLS_VNNI_PANELS 1 /* -DMLS_NO_INT8_PANELS: the row kernels at every count (benchmarks/int8_tiles.py's control) */
#define VNNI_R 16        /* weight rows per panel: the int32 lanes of a vector */
#define VNNI_MR 8        /* activation rows per tile: 8 sums a_j, 8 S, 8 accumulators in registers */
/* activation rows from which a product takes the panels (fewer: the row kernels, 4 rows per pass over a weight row,
   which need no unpacked copy). Measured crossover (a 2-core AVX-512 EPYC without AMX, 2026-12-06, glm-real's routed
   experts, 64 experts per call, 2 threads): Q4_K level at 8-12 rows, 1.3x at 16, 1.5-2x at 32-128; Q6_K (three
   transposes and a sum per 16 values) level at 12-16, 1.2-1.3x at 20-24, 1.7-3x at 32-128; the i-quants (their codes
   from the row kernels' readers, 16 rows at a time) level at 8, IQ2_XXS / IQ3_XXS 1.7x at 16, 2.4-3.9x at 32-128
   (the standard model's IQ mix). */
#define VNNI_MIN_ROWS 12
#define VNNI_MIN_ROWS_Q6K 16
#define VNNI_MIN_ROWS_IQ 16
#define VNNI_BLK_BYTES (8 * 8 * 64 + 16 * 64 + 4 * 64 + 2 * 64) /* a panel's bytes per super-block */

/* the types whose panels hold signed integer codes plus an offset (vnni_unpack_signed) */
static inline int vnni_signed_type(int type) {
    return type == MLS_IQ4_XS || type == MLS_IQ2_XXS || type == MLS_IQ2_XS || type == MLS_IQ2_S ||
           type == MLS_IQ3_XXS || type == MLS_IQ3_S || type == MLS_IQ1_S || type == MLS_IQ1_M;
}

static inline int vnni_type(int type) {
    return type == MLS_Q4_K || type == MLS_Q5_K || type == MLS_Q6_K || vnni_signed_type(type);
}

/* the offset that makes a type's codes unsigned bytes for vpdpbusd (Q6_K's codes are stored so: q = w + 32) */
static inline int vnni_offset(int type) { return type == MLS_Q6_K ? 32 : type == MLS_IQ4_XS ? 128 : 64; }

/* whether a product of m activation rows on this type runs on the panels */
static inline int64_t vnni_min_rows(int type) {
    return type == MLS_Q4_K || type == MLS_Q5_K ? VNNI_MIN_ROWS : type == MLS_Q6_K ? VNNI_MIN_ROWS_Q6K : VNNI_MIN_ROWS_IQ;
}

static inline int vnni_takes(int type, int64_t m) { return vnni_type(type) && m >= vnni_min_rows(type); }

typedef struct {
    __m512i *c;   /* [kb * 8 * 8] codes */
    __m512i *sc;  /* [kb * 16] scales: per 32 values (Q4_K, Q5_K: the first 8 of a super-block's 16), per 16 (the rest) */
    __m512i *mn;  /* [kb * 4] mins, int16 pairs */
    __m512 *d;    /* [kb] */
    __m512 *dmin; /* [kb] */
} vnni_panel_t;

/* the panel's arrays in one 64-byte aligned buffer of kb * VNNI_BLK_BYTES */
static inline vnni_panel_t vnni_panel_at(void *mem, int64_t kb) {
    vnni_panel_t P;
    P.c = (__m512i *)mem;
    P.sc = P.c + kb * 64;
    P.mn = P.sc + kb * 16;
    P.d = (__m512 *)(P.mn + kb * 4);
    P.dmin = P.d + kb;
    return P;
}

/* the dwords `dwords` (a mask of 0 .. 15) at p + r * row_bytes of the rows r < nr, as columns: v[d] lane r = dword d
   of row r (zero past nr and outside the mask; masked loads read nothing outside it) */
static inline __attribute__((always_inline)) void rows_as_lanes(const uint8_t *p, int64_t row_bytes, int64_t nr,
                                                                __mmask16 dwords, __m512i v[16]) {
    for (int r = 0; r < 16; r++) v[r] = r < nr ? _mm512_maskz_loadu_epi32(dwords, p + r * row_bytes) : _mm512_setzero_si512();
    transpose16_epi32(v);
}

/* super-block blk's d, dmin, sub-block scales and mins of 16 rows into the panel, from the 4 dwords of its first 16
   bytes (dd, u0, u1, u2: lane r the dword of row r): k_scales_mins8's words lane by lane (scales 0..3 | 4..7, mins
   0..3 | 4..7 one per byte), the mins as int16 pairs */
static inline __attribute__((always_inline)) void vnni_scales_q45(__m512i dd, __m512i u0, __m512i u1, __m512i u2,
                                                                  int64_t blk, const vnni_panel_t *P) {
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4 = _mm512_set1_epi32(0x0f0f0f0f);
    const __m512i m2 = _mm512_set1_epi32(0x03030303), ff = _mm512_set1_epi32(0xFF);
    P->d[blk] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    P->dmin[blk] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    const __m512i sc_lo = _mm512_and_si512(u0, m6), mn_lo = _mm512_and_si512(u1, m6);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(u2, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m2), 4));
    const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4),
                                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m2), 4));
    for (int j = 0; j < 4; j++) {
        P->sc[blk * 16 + j] = _mm512_and_si512(_mm512_srli_epi32(sc_lo, 8 * j), ff);
        P->sc[blk * 16 + 4 + j] = _mm512_and_si512(_mm512_srli_epi32(sc_hi, 8 * j), ff);
    }
    for (int p = 0; p < 2; p++) { /* mins 2p, 2p + 1 of a word: bytes 2p, 2p + 1 into int16 lanes 0, 1 */
        const __m512i lo = _mm512_srli_epi32(mn_lo, 16 * p), hi = _mm512_srli_epi32(mn_hi, 16 * p);
        P->mn[blk * 4 + p] = _mm512_or_si512(_mm512_and_si512(lo, ff), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(lo, 8), ff), 16));
        P->mn[blk * 4 + 2 + p] = _mm512_or_si512(_mm512_and_si512(hi, ff), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, 8), ff), 16));
    }
}

/* nr (<= 16) rows of a Q4_K / Q5_K weight, row_bytes apart from w, into the panel; lanes past nr get zero codes,
   scales and mins (their outputs are not stored). The scales' dwords are gathered from the 16 rows, the codes' 64-byte
   runs loaded and transposed (32 gathers took ~half of a panel's time at 8 activation rows). */
static void vnni_unpack_q45(const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, int five, const vnni_panel_t *P) {
    const __mmask16 live = nr >= VNNI_R ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)row_bytes));
    const __m512i z = _mm512_setzero_si512(), m4 = _mm512_set1_epi32(0x0f0f0f0f), one = _mm512_set1_epi32(0x01010101);
    const int64_t bytes = five ? 176 : 144, qoff = five ? 48 : 16;
#define VNNI_GATHER(p) _mm512_mask_i32gather_epi32(z, live, idx, (const void *)(p), 1)
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * bytes;
        vnni_scales_q45(VNNI_GATHER(b), VNNI_GATHER(b + 4), VNNI_GATHER(b + 8), VNNI_GATHER(b + 12), blk, P);
        /* qs: byte l of 32 c .. 32 c + 31 holds value l of sub-block 2 c (low nibble) and of 2 c + 1 (high); Q5_K's
           qh byte l holds bit 4 of value l of sub-block j in its bit j */
        __m512i qh[16], v[16];
        if (five) rows_as_lanes(b + 16, row_bytes, nr, 0x00FF, qh); /* qh[t], t < 8 */
        for (int half = 0; half < 2; half++) {
            rows_as_lanes(b + qoff + 64 * half, row_bytes, nr, 0xFFFF, v); /* v[8 (c - 2 half) + t] */
            for (int d = 0; d < 16; d++) {
                const int c = 2 * half + d / 8, t = d % 8;
                __m512i lo = _mm512_and_si512(v[d], m4), hi = _mm512_and_si512(_mm512_srli_epi32(v[d], 4), m4);
                if (five) {
                    lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[t], 2 * c), one), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[t], 2 * c + 1), one), 4));
                }
                P->c[(blk * 8 + 2 * c) * 8 + t] = lo;
                P->c[(blk * 8 + 2 * c + 1) * 8 + t] = hi;
            }
        }
    }
#undef VNNI_GATHER
}

/* nr (<= 16) rows of a Q6_K weight into the panel (as vnni_unpack_q45): codes q = lo | hi << 4 (0 .. 63; the -32
   is the tile's, on the activations' sums), the 16 int8 scales sign-extended, d. Value 128 h + 32 g + l: lo the
   nibble g >> 1 of ql[64 h + 32 (g & 1) + l], hi the bits 2 g of qh[32 h + l] (ref/int8.c q8rows_kquant). */
static void vnni_unpack_q6k(const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, const vnni_panel_t *P) {
    const __mmask16 live = nr >= VNNI_R ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)row_bytes));
    const __m512i z = _mm512_setzero_si512(), m4 = _mm512_set1_epi32(0x0f0f0f0f), m3 = _mm512_set1_epi32(0x03030303);
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 210;
        /* the dword at 206 ends at the super-block's last byte: d in its high half */
        const __m512i dd = _mm512_mask_i32gather_epi32(z, live, idx, (const void *)(b + 206), 1);
        P->d[blk] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
        for (int w4 = 0; w4 < 4; w4++) {
            const __m512i v = _mm512_mask_i32gather_epi32(z, live, idx, (const void *)(b + 192 + 4 * w4), 1);
            for (int e = 0; e < 4; e++) /* scale 4 w4 + e: byte e, sign-extended */
                P->sc[blk * 16 + 4 * w4 + e] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * e), 24);
        }
        __m512i qh[16], ql[16];
        rows_as_lanes(b + 128, row_bytes, nr, 0xFFFF, qh); /* qh[8 h + t] */
        for (int h = 0; h < 2; h++) {
            rows_as_lanes(b + 64 * h, row_bytes, nr, 0xFFFF, ql); /* ql[8 (g & 1) + t] */
            for (int g = 0; g < 4; g++)
                for (int t = 0; t < 8; t++) {
                    const __m512i q = ql[8 * (g & 1) + t], hi = qh[8 * h + t];
                    const __m512i lo = _mm512_and_si512(g >> 1 ? _mm512_srli_epi32(q, 4) : q, m4);
                    const __m512i up = _mm512_and_si512(_mm512_srli_epi32(hi, 2 * g), m3);
                    P->c[(blk * 8 + 4 * h + g) * 8 + t] = _mm512_or_si512(lo, _mm512_slli_epi32(up, 4));
                }
        }
    }
}

/* nr (<= 16) rows of an i-quant into the panel: per row and sub-block the row kernels' signed codes w (IQ4_XS: the
   non-linear table's values; the sign-grid types: grid byte times its sign, sign_grid32; IQ1_S / IQ1_M: 8 g +- 1,
   iq1_operands) stored as w + vnni_offset, unsigned bytes (IQ4_XS's -127 .. 113 with 128; the grids' |w| <= 62 and
   IQ1's |w| <= 9 with 64), their integer scales per 16 values (iq_ls; IQ4_XS: ls - 32 for both halves) and d
   (iq_int_d; IQ4_XS: its fp16 d). The codes go through tmp [16, 256] (one super-block of the 16 rows) and are
   transposed from there. */
static void vnni_unpack_signed(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, uint8_t *tmp,
                               const vnni_panel_t *P) {
    const int64_t bytes = type_of(type)->block_bytes;
    const __m256i off = _mm256_set1_epi8((char)vnni_offset(type));
    const int iq1 = type == MLS_IQ1_S || type == MLS_IQ1_M;
    for (int64_t blk = 0; blk < k / 256; blk++) {
        int32_t ls16[16][VNNI_R] __attribute__((aligned(64)));
        float d[VNNI_R] __attribute__((aligned(64)));
        memset(ls16, 0, sizeof ls16);
        memset(d, 0, sizeof d);
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *b = w + r * row_bytes + blk * bytes;
            int32_t ls[8];
            if (type == MLS_IQ4_XS) iq4_xs_ls(b, ls);
            d[r] = type == MLS_IQ4_XS ? f16(b) : iq_int_d(b, type);
            for (int ib = 0; ib < 8; ib++) {
                __m256i code, u, sg;
                if (type == MLS_IQ4_XS) {
                    code = iq4_codes32(b + 8 + 16 * ib);
                    ls16[2 * ib][r] = ls16[2 * ib + 1][r] = ls[ib];
                } else {
                    if (iq1)
                        iq1_operands(b, type, ib, &u, &sg), code = sg;
                    else
                        sign_grid32(b, type, ib, &u, &sg), code = _mm256_sign_epi8(u, sg);
                    int32_t half[2];
                    iq_ls(b, type, ib, half);
                    ls16[2 * ib][r] = half[0];
                    ls16[2 * ib + 1][r] = half[1];
                }
                _mm256_storeu_si256((__m256i *)(tmp + r * 256 + 32 * ib), _mm256_add_epi8(code, off));
            }
        }
        P->d[blk] = _mm512_load_ps(d);
        for (int g = 0; g < 16; g++) P->sc[blk * 16 + g] = _mm512_load_si512(ls16[g]);
        for (int q = 0; q < 4; q++) { /* values 64 q .. 64 q + 63: sub-blocks 2 q, 2 q + 1 */
            __m512i v[16];
            rows_as_lanes(tmp + 64 * q, 256, nr, 0xFFFF, v);
            for (int dw = 0; dw < 16; dw++) P->c[(blk * 8 + 2 * q + dw / 8) * 8 + dw % 8] = v[dw];
        }
    }
}

/* a[i] += the exact int32 sums of the panel's code dwords C[0 .. dwords) times activation row i's codes (x + i k, 4
   a dword, broadcast): one vpdpbusd per dword and row; dwords and mr constants where inlined with them */
static inline __attribute__((always_inline)) void vnni_dots(const __m512i *C, const int8_t *x, int64_t k,
                                                            const int dwords, const int mr, __m512i *a) {
#pragma GCC unroll 8
    for (int t = 0; t < dwords; t++) {
        const __m512i cv = _mm512_load_si512(C + t);
        for (int i = 0; i < mr; i++) {
            int32_t x4;
            memcpy(&x4, x + i * k + 4 * t, 4);
            a[i] = _mm512_dpbusd_epi32(a[i], cv, _mm512_set1_epi32(x4));
        }
    }
}

/* Activation rows [0, mr) (codes xq, k apart; their q8k_meta slots xd, k / 32 floats apart) times the panel, into y
   (row stride ldy; lanes `live` stored). Per super-block, G groups of `dwords` dwords of codes, each group's exact
   sums (vnni_dots) times its scale into S:
     g16 0 (Q4_K, Q5_K): 8 groups of 32 values from zero; y += (d d_x) S, y -= (dmin d_x) M (M the mins times the
            activation's code sums, madd on int16 pairs)
     g16 1 (Q6_K, the i-quants): 16 groups of 16 values, codes stored as w + off, each group's sum starting from
            -off X_G (X_G the activation row's code sum over G, x16: k / 16 per row), so A = sum w x; y += (d d_x) S
   and y * factor at the end (the grid types' power of two, 1 for the rest: the row kernels' last multiply, exact by
   1). g16, off, mr constants where inlined with them. */
static inline __attribute__((always_inline)) void vnni_tile(const vnni_panel_t *P, const int8_t *xq, const float *xd,
                                                            const int32_t *x16, const int g16, const int off,
                                                            const float factor, const int mr, int64_t k, float *y,
                                                            int64_t ldy, __mmask16 live) {
    const int64_t slots = k / 32;
    const int groups = g16 ? 16 : 8, dwords = g16 ? 4 : 8;
    __m512 acc[VNNI_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++) {
        __m512i S[VNNI_MR];
        for (int i = 0; i < mr; i++) S[i] = _mm512_setzero_si512();
        for (int G = 0; G < groups; G++) {
            __m512i a[VNNI_MR];
            for (int i = 0; i < mr; i++)
                a[i] = g16 ? _mm512_set1_epi32(-off * x16[i * (k / 16) + blk * 16 + G]) : _mm512_setzero_si512();
            vnni_dots(P->c + blk * 64 + dwords * G, xq + blk * 256 + 4 * dwords * G, k, dwords, mr, a);
            const __m512i sc = P->sc[blk * 16 + G];
            for (int i = 0; i < mr; i++) S[i] = _mm512_add_epi32(S[i], _mm512_mullo_epi32(a[i], sc));
        }
        for (int i = 0; i < mr; i++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            const __m512 dx = _mm512_set1_ps(meta->d);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(P->d[blk], dx), _mm512_cvtepi32_ps(S[i])));
            if (g16) continue;
            int32_t pair[4];
            memcpy(pair, meta->bsum, sizeof pair);
            __m512i M = _mm512_madd_epi16(P->mn[blk * 4], _mm512_set1_epi32(pair[0]));
            for (int p = 1; p < 4; p++) M = _mm512_add_epi32(M, _mm512_madd_epi16(P->mn[blk * 4 + p], _mm512_set1_epi32(pair[p])));
            acc[i] = _mm512_sub_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(P->dmin[blk], dx), _mm512_cvtepi32_ps(M)));
        }
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + i * ldy, live, _mm512_mul_ps(acc[i], _mm512_set1_ps(factor)));
}

/* m activation rows times one unpacked panel (nr live rows): tiles of VNNI_MR rows, the last one shorter; x16 the
   rows' per-16 code sums (the g16 types only) */
static void vnni_rows(int type, const vnni_panel_t *P, const int8_t *xq, const float *xd, const int32_t *x16,
                      int64_t m, int64_t k, float *y, int64_t ldy, int64_t nr) {
    const __mmask16 live = nr >= VNNI_R ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const int64_t slots = k / 32;
    const int g16 = !(type == MLS_Q4_K || type == MLS_Q5_K), off = vnni_offset(type);
    const float factor = vnni_signed_type(type) && type != MLS_IQ4_XS ? iq_int_factor(type) : 1.0f;
    for (int64_t i = 0; i < m; i += VNNI_MR) {
        const int64_t mr = m - i < VNNI_MR ? m - i : VNNI_MR;
        const int8_t *xi = xq + i * k;
        const float *di = xd + i * slots;
        float *yi = y + i * ldy;
#define VNNI_TILE(r)                                                                        \
    case r:                                                                                 \
        if (g16)                                                                            \
            vnni_tile(P, xi, di, x16 + i * (k / 16), 1, off, factor, r, k, yi, ldy, live);   \
        else                                                                                \
            vnni_tile(P, xi, di, NULL, 0, 0, 1.0f, r, k, yi, ldy, live);                     \
        break;
        switch (mr) {
            VNNI_TILE(8) VNNI_TILE(7) VNNI_TILE(6) VNNI_TILE(5) VNNI_TILE(4) VNNI_TILE(3) VNNI_TILE(2) VNNI_TILE(1)
        default: break;
        }
#undef VNNI_TILE
    }
}

/* per activation row and 16 values, the sum of the codes (the g16 types' offset): x16 [p, k / 16] */
static void vnni_sums16(const int8_t *xq, int64_t p, int64_t k, int32_t *x16) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p; i++)
        for (int64_t g = 0; g < k / 16; g++) {
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += xq[i * k + 16 * g + l];
            x16[i * (k / 16) + g] = s;
        }
}

/* The groups a of a grouped call (activation rows starts[a] .. starts[a + 1] of xq / xd) that take the panels
   (take(type, rows)), every part q (ws[q] + experts[a] * expert_stride, n rows row_bytes apart) into y's columns
   q * n .. q * n + n (row stride ldy). One parallel region: a work list of (group, part, 16-row panel) items
   (dynamic: a thread may lose its core to a neighbour), each unpacked once into the thread's panel and met by all of
   its group's rows. Groups that do not take the panels are left to the caller. Returns 0, -4 out of memory. */
static int int8_panels_grouped(int type, const uint8_t *const *ws, int64_t nparts, int64_t n, int64_t row_bytes,
                               int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                               const int8_t *xq, const float *xd, int64_t k, float *y, int64_t ldy, int threads,
                               int (*take)(int type, int64_t rows)) {
    const int64_t kb = k / 256, panels = (n + VNNI_R - 1) / VNNI_R, items = groups * nparts * panels;
    const int five = type == MLS_Q5_K, q6 = type == MLS_Q6_K, g16 = !(type == MLS_Q4_K || five);
    const int sgn = vnni_signed_type(type);
    int32_t *x16 = g16 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(starts[groups] * (k / 16)) + 1) : NULL;
    if (g16 && !x16) return -4;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (g16) vnni_sums16(xq, starts[groups], k, x16); /* its loop ends in a barrier */
        void *mem = aligned_alloc(64, (size_t)(kb * VNNI_BLK_BYTES + (sgn ? VNNI_R * 256 : 0)));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
        const vnni_panel_t P = vnni_panel_at(mem, kb);
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            const int64_t a = it / (nparts * panels), q = it / panels % nparts, r0 = (it % panels) * VNNI_R;
            const int64_t p0 = starts[a], m = starts[a + 1] - p0;
            if (!mem || m == 0 || !take(type, m)) continue;
            const int64_t nr = n - r0 < VNNI_R ? n - r0 : VNNI_R;
            const uint8_t *wr = ws[q] + experts[a] * expert_stride + r0 * row_bytes;
            if (q6)
                vnni_unpack_q6k(wr, row_bytes, nr, k, &P);
            else if (sgn)
                vnni_unpack_signed(type, wr, row_bytes, nr, k, (uint8_t *)mem + kb * VNNI_BLK_BYTES, &P);
            else
                vnni_unpack_q45(wr, row_bytes, nr, k, five, &P);
            vnni_rows(type, &P, xq + p0 * k, xd + p0 * (k / 32), g16 ? x16 + p0 * (k / 16) : NULL, m, k,
                      y + p0 * ldy + q * n + r0, ldy, nr);
        }
        free(mem);
    }
    free(x16);
    return failed ? -4 : 0;
}

/* the interface to int8.c (x86/avx2_panels.c has the same): the activation rows from which a product on this type
   takes the panels, 0 never */
static inline int64_t int8_panels_min_rows(int type) { return vnni_type(type) ? vnni_min_rows(type) : 0; }
#define MLS_INT8_PANELS "avx512-vnni"
#endif

/* ----------------------------------------------------- int8 products of many rows on AVX2 weight panels (no VNNI)
   x86/vnni_panels.c's scheme for CPUs without AVX512-VNNI: the int8 products int8.c runs (q8_K activations) of
   Q4_K, Q5_K, Q6_K and the i-quants with at least a2_min_rows activation rows (prefill's dense products and routed experts,
   batched decode), 8 weight rows in the 8 int32 lanes of a ymm, unpacked once per call into a thread's panel. With
   no vpdpbusd, each activation row meets a dword of 4 codes a lane with one vpmaddubsw (its 4 codes broadcast: int16
   pair sums) and the pair sums of `chunk` dwords are added in int16 before one vpmaddwd by the scale (int16 pairs)
   turns them into int32. The row kernels (x86/avx2.c q8k_*_mr) unpack a weight super-block once per 4 activation
   rows and reduce 8 lanes per row and super-block; the panels pay neither.

   Notation (one panel: weight rows r0 .. r0 + 8, lane r; super-block blk of 256 values, sub-block j of 32 values,
   dword t of 4 values; activation row i, codes |x| <= 127)
     C   [kb, 8 j, 8 t, 8 r] u8 x 4   codes of weight row r, values 256 blk + 32 j + 4 t .. + 3 (0 .. 15, 31, 63)
     sc  [kb, 16, 8 r] int16 x 2      the scale of each group of 32 values (Q4_K, Q5_K: j < 8) or 16 (Q6_K: G < 16),
                                      in both int16 halves of a lane
     mn  [kb, 8 p, 8 r] int16 x 2     Q4_K, Q5_K: mins 2p, 2p + 1 (p < 4); Q6_K: scales 2p, 2p + 1 (p < 8)
     d, dmin [kb, 8 r] fp32
     h_c[r] = sum_{t in chunk c} maddubs(C[.., t, r], x_i[.. 4 t .. + 3])   (int16: |h| <= chunk 2 max|C| 127 < 2^15:
              Q4_K 8 dwords 8 * 2 * 15 * 127, Q5_K 4 * 2 * 31 * 127, Q6_K 2 * 2 * 63 * 127)
     S[r]   = sum_c madd(h_c[r], sc[group of c, r])                       (exact int32, |S| < 2^28)
     Q4_K, Q5_K: M[r] = sum_p madd(mn[blk, p, r], bsum_i[2p] | bsum_i[2p + 1] << 16)
                 y[i, r] += (d[r] d_x) S[r];   y[i, r] -= (dmin[r] d_x) M[r]
     Q6_K:       codes q = w + 32; M[r] = sum_p madd(mn[blk, p, r], X_i[2p] | X_i[2p + 1] << 16) (X_G the row's code
                 sum over the 16 values of group G, |X_G| <= 2032); y[i, r] += (d[r] d_x) (S[r] - 32 M[r])
     i-quants:   C holds the signed codes w; h from maddubs(|w|, sign(x, w)) (|w| x sign(x, w) = w x, the row kernels'
                 operands; |h| <= chunk 2 max|w| 127: IQ4_XS 1 dword, the grids 2, IQ1 4); y[i, r] += (d[r] d_x) S[r],
                 y times the type's power-of-two factor at the end
   S, M and S - 32 M are the row kernels' integers and the float steps theirs in their order (q8k_block_end), so every
   output is theirs bit for bit, whatever the batch, the tile or the thread (tests/kernels/test_int8_panels.py). */
#if defined(__AVX2__) && defined(MLS_SIMD) && !defined(MLS_VNNI_PANELS) && !defined(MLS_NO_INT8_PANELS)
#include <omp.h>
#define A2_R 8  /* weight rows per panel: the int32 lanes of a ymm */
#define A2_MR 6 /* activation rows per tile: 6 int16 sums h, 6 int32 sums S in registers */
/* activation rows from which a product takes the panels (fewer: the row kernels) */
#define A2_MIN_ROWS 8
#define A2_CHUNK 4 /* panels a thread takes at a time: a2_prefetch_item knows its next one */
#define A2_BLK_BYTES ((8 * 8 + 16 + 8 + 2) * 32) /* a panel's bytes per super-block */

/* the i-quants with q8_K activations: signed codes (x86/vnni_panels.c vnni_signed_type's list) */
static inline int a2_signed(int type) {
    return type == MLS_IQ4_XS || type == MLS_IQ2_XXS || type == MLS_IQ2_XS || type == MLS_IQ2_S || type == MLS_IQ3_XXS ||
           type == MLS_IQ3_S || type == MLS_IQ1_S || type == MLS_IQ1_M;
}

static inline int a2_type(int type) { return type == MLS_Q4_K || type == MLS_Q5_K || type == MLS_Q6_K || a2_signed(type); }

static inline int64_t a2_min_rows(int type) { return a2_type(type) ? A2_MIN_ROWS : 0; }

/* the tile's forms (a2_tile): the K-quants, and the i-quants by their largest |code| (the int16 chunk) */
enum { A2_Q4K, A2_Q5K, A2_Q6K, A2_IQ4XS, A2_GRID, A2_IQ1 };
static inline int a2_form(int type) {
    return type == MLS_Q4_K ? A2_Q4K : type == MLS_Q5_K ? A2_Q5K : type == MLS_Q6_K ? A2_Q6K : type == MLS_IQ4_XS ? A2_IQ4XS
         : type == MLS_IQ1_S || type == MLS_IQ1_M ? A2_IQ1 : A2_GRID;
}

typedef struct {
    __m256i *c;  /* [kb * 64] codes */
    __m256i *sc; /* [kb * 16] scales as int16 pairs */
    __m256i *mn; /* [kb * 8] mins (Q4_K, Q5_K: the first 4) or scales (Q6_K) by pairs */
    __m256 *d;   /* [kb] */
    __m256 *dmin; /* [kb] */
} a2_panel_t;

static inline a2_panel_t a2_panel_at(void *mem, int64_t kb) {
    a2_panel_t P;
    P.c = (__m256i *)mem;
    P.sc = P.c + kb * 64;
    P.mn = P.sc + kb * 16;
    P.d = (__m256 *)(P.mn + kb * 8);
    P.dmin = P.d + kb;
    return P;
}

/* v[t] lane r = dword t of a[r] (an 8 x 8 transpose of dwords) */
static inline __attribute__((always_inline)) void a2_lanes8(__m256i a[8], __m256i v[8]) {
    __m256i b[8];
    for (int q = 0; q < 8; q += 2) { /* rows q, q + 1: dwords 0 1 interleaved, 2 3, | 4 5, 6 7 */
        b[q] = _mm256_unpacklo_epi32(a[q], a[q + 1]);
        b[q + 1] = _mm256_unpackhi_epi32(a[q], a[q + 1]);
    }
    for (int q = 0; q < 8; q += 4) { /* rows q .. q + 3: dword t in lanes t % 4 | 4 + t % 4 */
        a[q] = _mm256_unpacklo_epi64(b[q], b[q + 2]);
        a[q + 1] = _mm256_unpackhi_epi64(b[q], b[q + 2]);
        a[q + 2] = _mm256_unpacklo_epi64(b[q + 1], b[q + 3]);
        a[q + 3] = _mm256_unpackhi_epi64(b[q + 1], b[q + 3]);
    }
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_permute2x128_si256(a[t], a[4 + t], 0x20);
        v[4 + t] = _mm256_permute2x128_si256(a[t], a[4 + t], 0x31);
    }
}

/* v[t] lane r = dword t of the 32 bytes at p + r * row_bytes, rows r < nr (zero past nr) */
static inline __attribute__((always_inline)) void a2_rows_as_lanes(const uint8_t *p, int64_t row_bytes, int64_t nr,
                                                                   __m256i v[8]) {
    __m256i a[8];
    for (int r = 0; r < 8; r++)
        a[r] = r < nr ? _mm256_loadu_si256((const __m256i *)(p + r * row_bytes)) : _mm256_setzero_si256();
    a2_lanes8(a, v);
}

/* the 16 bytes at p + r * row_bytes of rows r < nr (zero past nr), sign- or zero-extended to int16, as pairs by
   lanes: v[p] lane r = e[r][2p] | e[r][2p + 1] << 16 (a2_pairs of all 8 pairs at once) */
static inline __attribute__((always_inline)) void a2_bytes_as_pairs(const uint8_t *p, int64_t row_bytes, int64_t nr,
                                                                    const int is_signed, __m256i v[8]) {
    __m256i a[8];
    for (int r = 0; r < 8; r++) {
        const __m128i b = r < nr ? _mm_loadu_si128((const __m128i *)(p + r * row_bytes)) : _mm_setzero_si128();
        a[r] = is_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
    }
    a2_lanes8(a, v);
}

/* the int16 pair (lo | hi << 16) of each row r < 8 as a vector of 8 lanes */
static inline __m256i a2_pairs(const int16_t lo[8], const int16_t hi[8]) {
    int32_t v[8];
    for (int r = 0; r < 8; r++) v[r] = (int32_t)((uint32_t)(uint16_t)lo[r] | (uint32_t)(uint16_t)hi[r] << 16);
    return _mm256_loadu_si256((const __m256i *)v);
}

/* from pairs by lanes (lo | hi << 16): lo in both halves, hi in both halves (the scale pairs sc) */
static inline __m256i a2_lo_twice(__m256i v) { return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA); }
static inline __m256i a2_hi_twice(__m256i v) { return _mm256_blend_epi16(v, _mm256_srli_epi32(v, 16), 0x55); }

/* the fp16 at p + r * row_bytes of rows r < nr as 8 float lanes (zero past nr) */
static inline __m256 a2_f16_rows(const uint8_t *p, int64_t row_bytes, int64_t nr) {
    float d[8];
    for (int r = 0; r < 8; r++) d[r] = r < nr ? f16(p + r * row_bytes) : 0.0f;
    return _mm256_setr_ps(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
}

/* super-block blk's d, dmin, scales and mins of nr rows (b: row 0's super-block) into the panel; zero past nr */
static void a2_scales_q45(const uint8_t *b, int64_t row_bytes, int64_t nr, int64_t blk, const a2_panel_t *P) {
    uint8_t sm[8][16]; /* each row's scales 0..7, mins 0..7 */
    for (int64_t r = 0; r < nr; r++) _mm_storeu_si128((__m128i *)sm[r], k_scales_mins8(b + r * row_bytes + 4));
    __m256i T[8]; /* T[p] p < 4: scales 2p, 2p + 1 by pairs; T[4 + p]: mins 2p, 2p + 1 */
    a2_bytes_as_pairs(sm[0], 16, nr, 0, T);
    for (int p = 0; p < 4; p++) {
        P->sc[blk * 16 + 2 * p] = a2_lo_twice(T[p]);
        P->sc[blk * 16 + 2 * p + 1] = a2_hi_twice(T[p]);
        P->mn[blk * 8 + p] = T[4 + p];
    }
    P->d[blk] = a2_f16_rows(b, row_bytes, nr);
    P->dmin[blk] = a2_f16_rows(b + 2, row_bytes, nr);
}

/* nr (<= 8) rows of a Q4_K / Q5_K weight, row_bytes apart from w, into the panel. qs: byte l of 32 c .. 32 c + 31
   holds value l of sub-block 2 c (low nibble) and of 2 c + 1 (high); Q5_K's qh byte l bit j is bit 4 of value l of
   sub-block j. */
static void a2_unpack_q45(const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, int five, const a2_panel_t *P) {
    const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), one = _mm256_set1_epi32(0x01010101);
    const int64_t bytes = five ? 176 : 144, qoff = five ? 48 : 16;
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * bytes;
        a2_scales_q45(b, row_bytes, nr, blk, P);
        __m256i qh[8], v[8];
        if (five) a2_rows_as_lanes(b + 16, row_bytes, nr, qh);
        for (int c = 0; c < 4; c++) {
            a2_rows_as_lanes(b + qoff + 32 * c, row_bytes, nr, v);
            for (int t = 0; t < 8; t++) {
                __m256i lo = _mm256_and_si256(v[t], m4), hi = _mm256_and_si256(_mm256_srli_epi32(v[t], 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh[t], 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh[t], 2 * c + 1), one), 4));
                }
                P->c[(blk * 8 + 2 * c) * 8 + t] = lo;
                P->c[(blk * 8 + 2 * c + 1) * 8 + t] = hi;
            }
        }
    }
}

/* nr (<= 8) rows of a Q6_K weight into the panel: codes q = lo | hi << 4 (0 .. 63: w + 32), the 16 int8 scales
   sign-extended, by themselves and by pairs, d. Value 128 h + 32 g + l: lo the nibble g >> 1 of
   ql[64 h + 32 (g & 1) + l], hi the bits 2 g of qh[32 h + l] (ref/int8.c q8rows_kquant). */
static void a2_unpack_q6k(const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, const a2_panel_t *P) {
    const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m3 = _mm256_set1_epi32(0x03030303);
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 210;
        __m256i T[8]; /* scales 2p, 2p + 1 by pairs */
        a2_bytes_as_pairs(b + 192, row_bytes, nr, 1, T);
        for (int p = 0; p < 8; p++) {
            P->sc[blk * 16 + 2 * p] = a2_lo_twice(T[p]);
            P->sc[blk * 16 + 2 * p + 1] = a2_hi_twice(T[p]);
            P->mn[blk * 8 + p] = T[p];
        }
        P->d[blk] = a2_f16_rows(b + 208, row_bytes, nr);
        __m256i qh[2][8], ql[8];
        a2_rows_as_lanes(b + 128, row_bytes, nr, qh[0]);
        a2_rows_as_lanes(b + 160, row_bytes, nr, qh[1]);
        for (int h = 0; h < 2; h++)
            for (int odd = 0; odd < 2; odd++) {
                a2_rows_as_lanes(b + 64 * h + 32 * odd, row_bytes, nr, ql);
                for (int g = odd; g < 4; g += 2)
                    for (int t = 0; t < 8; t++) {
                        const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi32(ql[t], 4) : ql[t], m4);
                        const __m256i up = _mm256_and_si256(_mm256_srli_epi32(qh[h][t], 2 * g), m3);
                        P->c[(blk * 8 + 4 * h + g) * 8 + t] = _mm256_or_si256(lo, _mm256_slli_epi32(up, 4));
                    }
            }
    }
}

/* nr (<= 8) rows of an i-quant into the panel: per row and sub-block the row kernels' signed codes w (IQ4_XS: the
   non-linear table's values; the sign-grid types: grid byte times its sign, sign_grid32; IQ1_S / IQ1_M: 8 g +- 1,
   iq1_operands), their integer scales per 16 values (iq_ls; IQ4_XS: ls - 32 for both halves) and d (iq_int_d;
   IQ4_XS: its fp16 d). The codes go through tmp [8, 256] (one super-block of the 8 rows) and are transposed from
   there. The tile takes |w| into vpmaddubsw and w's signs onto the activations, as the row kernels do. */
static void a2_unpack_signed(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, uint8_t *tmp,
                             const a2_panel_t *P) {
    const int64_t bytes = type_of(type)->block_bytes;
    const int iq1 = type == MLS_IQ1_S || type == MLS_IQ1_M;
    for (int64_t blk = 0; blk < k / 256; blk++) {
        int16_t ls16[16][8] = {{0}};
        float d[8] = {0};
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *b = w + r * row_bytes + blk * bytes;
            int32_t ls[8];
            if (type == MLS_IQ4_XS) iq4_xs_ls(b, ls);
            d[r] = type == MLS_IQ4_XS ? f16(b) : iq_int_d(b, type);
            for (int ib = 0; ib < 8; ib++) {
                __m256i code, u, sg;
                if (type == MLS_IQ4_XS) {
                    code = iq4_codes32(b + 8 + 16 * ib);
                    ls16[2 * ib][r] = ls16[2 * ib + 1][r] = (int16_t)ls[ib];
                } else {
                    if (iq1)
                        iq1_operands(b, type, ib, &u, &sg), code = sg;
                    else
                        sign_grid32(b, type, ib, &u, &sg), code = _mm256_sign_epi8(u, sg);
                    int32_t half[2];
                    iq_ls(b, type, ib, half);
                    ls16[2 * ib][r] = (int16_t)half[0];
                    ls16[2 * ib + 1][r] = (int16_t)half[1];
                }
                _mm256_storeu_si256((__m256i *)(tmp + r * 256 + 32 * ib), code);
            }
        }
        P->d[blk] = _mm256_loadu_ps(d);
        for (int G = 0; G < 16; G++) P->sc[blk * 16 + G] = a2_pairs(ls16[G], ls16[G]);
        for (int j = 0; j < 8; j++) a2_rows_as_lanes(tmp + 32 * j, 256, nr, P->c + (blk * 8 + j) * 8);
    }
}

/* Activation rows [0, mr) (codes xq, k apart; their q8k_meta slots xd, k / 32 floats apart; Q6_K: xp their code
   sums per 16 values by pairs, k / 32 a row) times the panel, into y (row stride ldy; lanes r < nr stored). Per
   super-block `groups` scale groups of `gd` dwords, each in chunks of `chunk` dwords (h in int16, one madd by the
   group's scale): Q4_K 8 x 8 in one chunk, Q5_K 8 x 8 in two, Q6_K 16 x 4 in two; the i-quants 16 x 4, in chunks by
   their largest |w| (IQ4_XS 127: 1 dword, the grids' 62: 2, IQ1's 9: 4), each dword's |w| into vpmaddubsw and its
   signs onto the activation codes (vpsignb: the products w x), the row's sum times the type's factor at the end.
   form (a2_form) and mr constants where inlined. */
static inline __attribute__((always_inline)) void a2_tile(const a2_panel_t *P, const int8_t *xq, const float *xd,
                                                          const int32_t *xp, const int form, const float factor,
                                                          const int mr, int64_t k, float *y, int64_t ldy, int64_t nr) {
    const int64_t slots = k / 32;
    const int q6 = form == A2_Q6K, mins = form == A2_Q4K || form == A2_Q5K, sgn = form >= A2_IQ4XS;
    const int groups = mins ? 8 : 16, gd = mins ? 8 : 4;
    const int chunk = form == A2_Q4K ? 8 : form == A2_Q5K || form == A2_IQ1 ? 4 : form == A2_IQ4XS ? 1 : 2;
    __m256 acc[A2_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const __m256i *C = P->c + blk * 64;
        const int8_t *xb = xq + blk * 256;
        __m256i S[A2_MR];
        for (int i = 0; i < mr; i++) S[i] = _mm256_setzero_si256();
        for (int G = 0; G < groups; G++) {
            const __m256i sc = P->sc[blk * 16 + G];
            for (int c0 = G * gd; c0 < G * gd + gd; c0 += chunk) {
                __m256i h[A2_MR];
                for (int i = 0; i < mr; i++) h[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int t = c0; t < c0 + chunk; t++) {
                    const __m256i cv = _mm256_load_si256(C + t), u = sgn ? _mm256_abs_epi8(cv) : cv;
                    for (int i = 0; i < mr; i++) {
                        int32_t x4;
                        memcpy(&x4, xb + i * k + 4 * t, 4);
                        const __m256i x = sgn ? _mm256_sign_epi8(_mm256_set1_epi32(x4), cv) : _mm256_set1_epi32(x4);
                        h[i] = _mm256_add_epi16(h[i], _mm256_maddubs_epi16(u, x));
                    }
                }
                for (int i = 0; i < mr; i++) S[i] = madd16_acc(S[i], h[i], sc);
            }
        }
        for (int i = 0; i < mr; i++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            const __m256 dx = _mm256_set1_ps(meta->d);
            if (q6) {
                const int32_t *pairs = xp + i * slots + blk * 8;
                __m256i M = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) M = madd16_acc(M, P->mn[blk * 8 + p], _mm256_set1_epi32(pairs[p]));
                S[i] = _mm256_sub_epi32(S[i], _mm256_slli_epi32(M, 5));
            }
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(P->d[blk], dx), _mm256_cvtepi32_ps(S[i])));
            if (!mins) continue;
            int32_t pair[4];
            memcpy(pair, meta->bsum, sizeof pair);
            __m256i M = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) M = madd16_acc(M, P->mn[blk * 8 + p], _mm256_set1_epi32(pair[p]));
            acc[i] = _mm256_sub_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(P->dmin[blk], dx), _mm256_cvtepi32_ps(M)));
        }
    }
    for (int i = 0; i < mr; i++) {
        const __m256 v = sgn ? _mm256_mul_ps(acc[i], _mm256_set1_ps(factor)) : acc[i];
        if (nr >= A2_R) {
            _mm256_storeu_ps(y + i * ldy, v);
            continue;
        }
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy(y + i * ldy, out, sizeof(float) * (size_t)nr);
    }
}

/* m activation rows times one unpacked panel (nr live rows): tiles of A2_MR rows, the last one shorter */
static void a2_rows(int type, const a2_panel_t *P, const int8_t *xq, const float *xd, const int32_t *xp, int64_t m,
                    int64_t k, float *y, int64_t ldy, int64_t nr) {
    const int64_t slots = k / 32;
    const int form = a2_form(type);
    const float factor = form == A2_GRID || form == A2_IQ1 ? iq_int_factor(type) : 1.0f;
    for (int64_t i = 0; i < m; i += A2_MR) {
        const int64_t mr = m - i < A2_MR ? m - i : A2_MR;
        const int8_t *xi = xq + i * k;
        const float *di = xd + i * slots;
        const int32_t *pi = xp ? xp + i * slots : NULL;
        float *yi = y + i * ldy;
#define A2_FORM(f, r)                                                                                  \
    case f:                                                                                            \
        a2_tile(P, xi, di, pi, f, factor, r, k, yi, ldy, nr);                                          \
        break;
#define A2_TILE(r)                                                                                     \
    case r:                                                                                            \
        switch (form) {                                                                                \
            A2_FORM(A2_Q4K, r) A2_FORM(A2_Q5K, r) A2_FORM(A2_Q6K, r) A2_FORM(A2_IQ4XS, r)              \
            A2_FORM(A2_GRID, r) A2_FORM(A2_IQ1, r)                                                     \
        default: break;                                                                                \
        }                                                                                              \
        break;
        switch (mr) {
            A2_TILE(6) A2_TILE(5) A2_TILE(4) A2_TILE(3) A2_TILE(2) A2_TILE(1)
        default: break;
        }
#undef A2_TILE
#undef A2_FORM
    }
}

/* one activation row's code sums of each 16 values by pairs (X_2p | X_2p+1 << 16, p < k / 32) into xp [k / 32] */
static void a2_sums16_row(const int8_t *xq, int64_t k, int32_t *xp) {
    for (int64_t p = 0; p < k / 32; p++) {
        int32_t s[2] = {0, 0};
        for (int l = 0; l < 32; l++) s[l / 16] += xq[32 * p + l];
        xp[p] = (int32_t)((uint32_t)(uint16_t)s[0] | (uint32_t)(uint16_t)s[1] << 16);
    }
}

/* every activation row's (a2_sums16_row): xp [rows, k / 32], the rows shared out over the team */
static void a2_sums16(const int8_t *xq, int64_t rows, int64_t k, int32_t *xp) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; i++) a2_sums16_row(xq + i * k, k, xp + i * (k / 32));
}

/* nr (<= 8) weight rows at w into the panel at mem (its a2_panel_at view P), by type */
static void a2_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, void *mem,
                      const a2_panel_t *P) {
    if (type == MLS_Q6_K)
        a2_unpack_q6k(w, row_bytes, nr, k, P);
    else if (a2_signed(type))
        a2_unpack_signed(type, w, row_bytes, nr, k, (uint8_t *)mem + k / 256 * A2_BLK_BYTES, P);
    else
        a2_unpack_q45(w, row_bytes, nr, k, type == MLS_Q5_K, P);
}

/* a thread's panel memory for rows of k values of a panel type (a2_panel_at, the signed types' transpose rows) */
static inline size_t a2_panel_bytes(int type, int64_t k) {
    return (size_t)(k / 256 * A2_BLK_BYTES + (a2_signed(type) ? A2_R * 256 : 0));
}

/* For a caller inside its own parallel region (moe/block.c's shared expert): nr weight rows at w (row_bytes apart)
   times m activation rows (q8_K codes xq [m, k], scales xd; Q6_K: xp, their a2_sums16) into y (row stride ldy), 8
   rows a panel in mem (a2_panel_bytes, 32-byte aligned), the next 8 rows prefetched meanwhile: the panels' bits */
#define MLS_A2_ITEMS 1
static void a2_item(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq, const float *xd,
                    const int32_t *xp, int64_t m, int64_t k, float *y, int64_t ldy, void *mem) {
    const a2_panel_t P = a2_panel_at(mem, k / 256);
    for (int64_t r0 = 0; r0 < nr; r0 += A2_R) {
        const int64_t n8 = nr - r0 < A2_R ? nr - r0 : A2_R, next = nr - r0 - n8 < A2_R ? nr - r0 - n8 : A2_R;
        a2_unpack(type, w + r0 * row_bytes, row_bytes, n8, k, mem, &P);
        prefetch_l2(w + (r0 + n8) * row_bytes, next * row_bytes);
        a2_rows(type, &P, xq, xd, xp, m, k, y + r0, ldy, n8);
    }
}

/* The item a thread takes after `it`: the next one of its chunk of A2_CHUNK items, or (a guess the schedule does
   not promise) the first one after the other threads' next chunks. */
static inline int64_t a2_next_item(int64_t it) {
    return (it + 1) % A2_CHUNK ? it + 1 : it + 1 + A2_CHUNK * (omp_get_num_threads() - 1);
}

/* item it's weight rows (8 rows lie in one run of bytes) into L2, issued between one panel's unpacking and its tiles:
   the unpacking reads 8 rows row_bytes apart, 32 bytes of each at a time, which the hardware prefetchers did not
   keep ahead of (its first loads held most of its time; the Q4_K_M file's Q6_K lm_head at 16 rows, the AVX2 EPYC:
   one thread 13.3-14.4 -> 11.0 ms, two 7.0-7.3 -> 5.9) */
static inline void a2_prefetch_item(const uint8_t *const *ws, int64_t nparts, int64_t panels, int64_t n,
                                    int64_t row_bytes, int64_t expert_stride, const int64_t *experts, int64_t items,
                                    int64_t it) {
    if (it >= items) return;
    const int64_t a = it / (nparts * panels), q = it / panels % nparts, r0 = (it % panels) * A2_R;
    prefetch_l2(ws[q] + experts[a] * expert_stride + r0 * row_bytes, (n - r0 < A2_R ? n - r0 : A2_R) * row_bytes);
}

/* The groups a of a grouped call that take the panels (take(type, rows)), as vnni_panels.c's int8_panels_grouped: one
   parallel region over (group, part, 8-row panel) items, each unpacked once into the thread's panel and met by all
   of its group's rows, the thread's next item streamed into L2 meanwhile. Returns 0, -4 out of memory. */
static int int8_panels_grouped(int type, const uint8_t *const *ws, int64_t nparts, int64_t n, int64_t row_bytes,
                               int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups,
                               const int8_t *xq, const float *xd, int64_t k, float *y, int64_t ldy, int threads,
                               int (*take)(int type, int64_t rows)) {
    const int64_t kb = k / 256, panels = (n + A2_R - 1) / A2_R, items = groups * nparts * panels;
    const int q6 = type == MLS_Q6_K;
    int32_t *xp = q6 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(starts[groups] * (k / 32)) + 1) : NULL;
    if (q6 && !xp) return -4;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (q6) a2_sums16(xq, starts[groups], k, xp); /* its loop ends in a barrier */
        void *mem = aligned_alloc(32, a2_panel_bytes(type, k));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
        const a2_panel_t P = a2_panel_at(mem, kb);
#pragma omp for schedule(dynamic, A2_CHUNK)
        for (int64_t it = 0; it < items; it++) {
            const int64_t a = it / (nparts * panels), q = it / panels % nparts, r0 = (it % panels) * A2_R;
            const int64_t p0 = starts[a], m = starts[a + 1] - p0;
            if (!mem || m == 0 || !take(type, m)) continue;
            const int64_t nr = n - r0 < A2_R ? n - r0 : A2_R;
            const uint8_t *wr = ws[q] + experts[a] * expert_stride + r0 * row_bytes;
            a2_unpack(type, wr, row_bytes, nr, k, mem, &P);
            a2_prefetch_item(ws, nparts, panels, n, row_bytes, expert_stride, experts, items, a2_next_item(it));
            a2_rows(type, &P, xq + p0 * k, xd + p0 * (k / 32), q6 ? xp + p0 * (k / 32) : NULL, m, k,
                    y + p0 * ldy + q * n + r0, ldy, nr);
        }
        free(mem);
    }
    free(xp);
    return failed ? -4 : 0;
}

/* the interface to int8.c: the activation rows from which a product on this type takes the panels, 0 never */
static inline int64_t int8_panels_min_rows(int type) { return a2_min_rows(type); }
#define MLS_INT8_PANELS "avx2"
#endif

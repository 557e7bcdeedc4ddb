/* The side-by-side kernels of a build without x86/rows16_q8k.c's AVX-512 ones: AVX2's 8 weight rows (Q4_K, Q5_K, Q6_K,
   IQ4_XS at 1-7 activation rows; the grid i-quants at 1-3; Q4_0, IQ4_NL at one: rows16_most), stubs where the build
   has no SIMD, and the callers' test and call (rows16_in, rows16_run) for every build. */
#if defined(MLS_SIMD) && !defined(MLS_Q8K_ROWS16)
/* ------------------------------------- AVX2: 1-3 activation rows times 8 Q4_K / Q5_K weight rows side by side
   rows16_q45's scheme in 8 lanes: the rows' fp16 scales and 12 scale bytes by AVX2 gathers, unpacked for 8 rows at
   once, M by four vpmaddwd (vpdpwssd with AVX-VNNI) per activation row, each row's S as q8k_q45_mr makes it
   (q45_row_sums; at 2-3 activation rows q45_row_sums_mr, the rows sharing each weight row's unpacking), the block's
   float steps in 8 lanes in the one-row kernel's order (its bits). A run of 16 rows (the callers' unit) is two
   calls. One row, as an AVX2 build on the 2-core AVX-512 EPYC: one thread 12.8-13.7 -> 14.5-15.7 GB/s of Q4_K
   against the row kernel (docs/PERFORMANCE.md); 2-7 rows on the AVX2-only EPYC (Zen 3): rows16_q8k_rows below. */

/* a Q4_K / Q5_K super-block's scales of 8 rows (b0: row 0's block; offs / live: rows16's lane offsets and mask):
   d and dmin as 8 float lanes, each row's 8 sub-block scales as a qword of scs (rows 0, 1, 4, 5 from the low
   unpack, 2, 3, 6, 7 from the high one), the mins as int16 pairs (j, j + 2) in mn[0..3]: k_scales_mins8's
   operations in 8 lanes, the 12 scale bytes as three gathered dwords per row */
typedef struct {
    __m256 dw, dmin;
    __m256i mn[4];
    uint64_t scs[8] __attribute__((aligned(32)));
} rows8_scales_t;

static inline __attribute__((always_inline)) void rows8_q45_scales(const uint8_t *b0, __m256i offs, __m256i live,
                                                                   rows8_scales_t *S) {
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4v = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x03030303);
    const __m256i lo8 = _mm256_set1_epi32(0x00FF00FF), zero = _mm256_setzero_si256();
    const __m256i dd = _mm256_mask_i32gather_epi32(zero, (const int *)b0, offs, live, 1); /* d | dmin << 16 */
    S->dw = f16_lanes(dd), S->dmin = f16_lanes(_mm256_srli_epi32(dd, 16));
    const __m256i u0 = _mm256_mask_i32gather_epi32(zero, (const int *)(b0 + 4), offs, live, 1);
    const __m256i u1 = _mm256_mask_i32gather_epi32(zero, (const int *)(b0 + 8), offs, live, 1);
    const __m256i u2 = _mm256_mask_i32gather_epi32(zero, (const int *)(b0 + 12), offs, live, 1);
    const __m256i sc_lo = _mm256_and_si256(u0, m6);
    const __m256i sc_hi =
        _mm256_or_si256(_mm256_and_si256(u2, m4v), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4));
    const __m256i mn_lo = _mm256_and_si256(u1, m6);
    const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4v),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4));
    S->mn[0] = _mm256_and_si256(mn_lo, lo8), S->mn[1] = _mm256_and_si256(_mm256_srli_epi32(mn_lo, 8), lo8);
    S->mn[2] = _mm256_and_si256(mn_hi, lo8), S->mn[3] = _mm256_and_si256(_mm256_srli_epi32(mn_hi, 8), lo8);
    _mm256_store_si256((__m256i *)S->scs, _mm256_unpacklo_epi32(sc_lo, sc_hi));
    _mm256_store_si256((__m256i *)(S->scs + 4), _mm256_unpackhi_epi32(sc_lo, sc_hi));
}

/* M_r = sum_j mn_r[j] bsum[j] for the 8 rows against one activation row's code sums: exact in int32 */
static inline __m256i rows8_mins(const __m256i mn[4], const int16_t *bs) {
    __m256i M = madd16_acc(_mm256_setzero_si256(), mn[0], _mm256_set1_epi32(pair16(bs[0], bs[2])));
    M = madd16_acc(M, mn[1], _mm256_set1_epi32(pair16(bs[1], bs[3])));
    M = madd16_acc(M, mn[2], _mm256_set1_epi32(pair16(bs[4], bs[6])));
    return madd16_acc(M, mn[3], _mm256_set1_epi32(pair16(bs[5], bs[7])));
}

static inline __attribute__((always_inline)) void rows8_q45(const uint8_t *w, int64_t row_bytes, int64_t nr,
                                                            const int five, const int8_t *xq, const float *xd,
                                                            const int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t nb = k / 256, bytes = five ? 176 : 144, step = (8 * row_bytes + nb - 1) / nb, slots = k / 32;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr), lane);
    const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)row_bytes));
    const char *pf = (const char *)w + 8 * row_bytes;
    __m256 acc[3];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        pf = prefetch_next_rows(pf, w, 8, row_bytes, blk, step); /* the next 8 rows into L2 beside the reads */
        const uint8_t *b0 = w + blk * bytes;
        rows8_scales_t S;
        rows8_q45_scales(b0, offs, live, &S);
        __m256i x[8];
        if (mr == 1)
            for (int j = 0; j < 8; j++) x[j] = _mm256_loadu_si256((const __m256i *)(xq + blk * 256 + 32 * j));
        __m256i P[3 * 16]; /* P[i * 16 + r]: activation row i, weight row r (q45_row_sums_mr's stride) */
        for (int r = 0; r < 8; r++) {
            if (r >= nr) {
                for (int i = 0; i < mr; i++) P[i * 16 + r] = _mm256_setzero_si256();
                continue;
            }
            const int slot = ((r & 3) < 2 ? 0 : 4) + (r >> 2) * 2 + (r & 1);
            const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(S.scs + slot))));
            if (mr == 1)
                P[r] = q45_row_sums(b0 + r * row_bytes, five, sc16, x);
            else
                q45_row_sums_mr(b0 + r * row_bytes, five, sc16, xq + blk * 256, k, mr, P + r);
        }
        for (int i = 0; i < mr; i++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            const __m256 dx = _mm256_set1_ps(meta->d);
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(S.dw, dx), _mm256_cvtepi32_ps(lane_sums8x8(P + i * 16))));
            acc[i] = _mm256_sub_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(S.dmin, dx), _mm256_cvtepi32_ps(rows8_mins(S.mn, meta->bsum))));
        }
    }
    for (int i = 0; i < mr; i++) _mm256_maskstore_ps(y + i * ldy, live, acc[i]);
}

/* AVX2: 1-3 activation rows times 8 weight rows of the q8_K types without mins (Q6_K, IQ4_XS, the grid i-quants).
   Their row kernels (x86/avx2.c q8k_q6k_mr, q8k_iq4xs_mr, q8k_grid_mr) end each super-block of each row with a
   horizontal sum of 8 int32 lanes and scalar float steps, a dependent chain per row that the next row's work waits
   behind on short rows (an IQ mix's routed experts: 2-4 super-blocks a row). Here 8 rows go side by side: each
   row's lanes from the row kernels' own sums (q6k_sums, iq4xs_sums, grid_sums: the same integers), the 8 reduced
   at once (lane_sums8x8), the float steps in 8 lanes in the row kernel's order (lane r of acc = acc + (d_r d_x) S_r,
   the grids' power of two once at the end), so its bits. At 2-3 rows each weight row's sums function serves them all
   (the row kernels' own multi-row form: one unpacking per weight row). type and mr constants where inlined. */
static inline float rows8_d(const uint8_t *br, const int type) {
    return type == MLS_Q6_K ? f16(br + 208) : type == MLS_IQ4_XS ? f16(br) : iq_int_d(br, type);
}

static inline __attribute__((always_inline)) void rows8_nomin(const uint8_t *w, int64_t row_bytes, int64_t nr,
                                                              const int type, const int8_t *xq, const float *xd,
                                                              const int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t nb = k / 256, step = (8 * row_bytes + nb - 1) / nb, slots = k / 32;
    const int64_t bytes = type == MLS_Q6_K ? 210 : type == MLS_IQ4_XS ? 136 : grid_bytes(type);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const char *pf = (const char *)w + 8 * row_bytes;
    __m256 acc[3];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        pf = prefetch_next_rows(pf, w, 8, row_bytes, blk, step); /* the next 8 rows into L2 beside the reads */
        const uint8_t *b0 = w + blk * bytes;
        const int8_t *xb = xq + blk * 256;
        float dw[8] __attribute__((aligned(32)));
        __m256i P[3 * 8]; /* P[i * 8 + r]: activation row i, weight row r */
        for (int r = 0; r < 8; r++) {
            if (r >= nr) {
                for (int i = 0; i < mr; i++) P[i * 8 + r] = _mm256_setzero_si256();
                dw[r] = 0.0f;
                continue;
            }
            const uint8_t *br = b0 + r * row_bytes;
            __m256i s[3]; /* the mr rows share the weight row's unpacking, as in its row kernel */
            dw[r] = rows8_d(br, type);
            if (type == MLS_Q6_K)
                q6k_sums(br, xb, k, mr, s);
            else if (type == MLS_IQ4_XS)
                iq4xs_sums(br, xb, k, mr, s);
            else
                grid_sums(br, type, xb, k, mr, s);
            for (int i = 0; i < mr; i++) P[i * 8 + r] = s[i];
        }
        const __m256 d = _mm256_load_ps(dw);
        for (int i = 0; i < mr; i++) {
            const __m256 dx = _mm256_set1_ps(((const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS))->d);
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(lane_sums8x8(P + i * 8))));
        }
    }
    for (int i = 0; i < mr; i++) {
        const __m256 v = type != MLS_Q6_K && type != MLS_IQ4_XS ? _mm256_mul_ps(acc[i], _mm256_set1_ps(iq_int_factor(type)))
                                                                : acc[i];
        _mm256_maskstore_ps(y + i * ldy, live, v);
    }
}

static inline int rows8_nomin_takes(int type) {
    return type == MLS_Q6_K || type == MLS_IQ4_XS || type == MLS_IQ2_XXS || type == MLS_IQ2_XS || type == MLS_IQ2_S ||
           type == MLS_IQ3_XXS || type == MLS_IQ3_S || type == MLS_IQ1_S || type == MLS_IQ1_M;
}

/* mr (1-3) activation rows times nr (<= 8) weight rows, type and mr specialised */
static void rows8_nomin_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                            const float *xd, int64_t mr, int64_t k, float *y, int64_t ldy) {
#define ROWS8_CASE(t)                                                                   \
    case t:                                                                             \
        if (mr == 1) rows8_nomin(w, row_bytes, nr, t, xq, xd, 1, k, y, ldy);            \
        else if (mr == 2) rows8_nomin(w, row_bytes, nr, t, xq, xd, 2, k, y, ldy);       \
        else rows8_nomin(w, row_bytes, nr, t, xq, xd, 3, k, y, ldy);                    \
        break;
    switch (type) {
        ROWS8_CASE(MLS_Q6_K) ROWS8_CASE(MLS_IQ4_XS) ROWS8_CASE(MLS_IQ2_XXS) ROWS8_CASE(MLS_IQ2_XS) ROWS8_CASE(MLS_IQ2_S)
        ROWS8_CASE(MLS_IQ3_XXS) ROWS8_CASE(MLS_IQ3_S) ROWS8_CASE(MLS_IQ1_S)
        default: ROWS8_CASE(MLS_IQ1_M)
    }
#undef ROWS8_CASE
}

/* AVX2: one activation row times 8 weight rows of Q4_0 or IQ4_NL (32-value blocks, Q8_0-style activations). The
   row kernel (x86/avx2.c q8rows_mr) keeps 8 float lanes per row, lane l = fma(d_w d_x, S_l, lane l) per block in
   order, one dependent fma per block and row. Here 8 rows go side by side, 8 independent chains: the 8 rows' d_w by
   one gather, times d_x once per block (the same fp32 products), each row's S_l from its codes (IQ4_NL: i8dot32 of
   q8_codes32's, as the row kernel; Q4_0: the unsigned nibbles' sums less 8 X_l, X_l the lane's activation codes'
   sum made once per block, the same integer as the signed sum: rows16_q4_0's scheme), each row's fma with its lane
   of the products broadcast, the rows' 8 lanes summed as hsum8 at the end: every lane's operations and order are
   the row kernel's, so its bits. type and nr constants where inlined (a run of 8 rows keeps its 8 accumulators in
   registers; a count read at run time kept them on the stack, as rows16_q4_0 found). */
static inline __attribute__((always_inline)) void rows8_blk32(const uint8_t *w, int64_t row_bytes, const int64_t nr,
                                                              const int type, const int8_t *xq, const float *xd,
                                                              int64_t k, float *y) {
    const int64_t nb = k / 32, bytes = q8_block_bytes(type), step = (8 * row_bytes + nb - 1) / nb;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), ones = _mm256_set1_epi16(1);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr), lane);
    const __m256i offs = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)row_bytes));
    const char *pf = (const char *)w + 8 * row_bytes;
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    /* each block's scales gathered one block ahead: a gather's latency (~20 cycles) off the fmas' path */
    __m256i dd = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)w, offs, live, 1);
    for (int64_t blk = 0; blk < nb; blk++) {
        pf = prefetch_next_rows(pf, w, 8, row_bytes, blk, step); /* the next 8 rows into L2 beside the reads */
        const uint8_t *b0 = w + blk * bytes;
        const __m256 D = _mm256_mul_ps(f16_lanes(dd), _mm256_set1_ps(xd[blk]));
        if (blk + 1 < nb)
            dd = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(b0 + bytes), offs, live, 1);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + blk * 32));
        const __m256i bias = type == MLS_Q4_0 /* -8 X_l */
                                 ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                                    _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), ones), 3))
                                 : _mm256_setzero_si256();
        for (int r = 0; r < 8; r++) {
            if (r >= nr) continue;
            __m256 S;
            if (type == MLS_Q4_0)
                S = _mm256_cvtepi32_ps(_mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles32(b0 + r * row_bytes + 2), x), ones), bias));
            else {
                const __m256i c = q8_codes32(b0 + r * row_bytes, type);
                S = i8dot32(_mm256_sign_epi8(c, c), c, x);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(D, _mm256_set1_epi32(r)), S, acc[r]);
        }
    }
    for (int r = 0; r < 8; r++)
        if (r < nr) y[r] = hsum8(acc[r]);
}

static inline int rows8_blk32_takes(int type) { return type == MLS_Q4_0 || type == MLS_IQ4_NL; }

static inline int rows16_takes(int type) {
    return type == MLS_Q4_K || type == MLS_Q5_K || rows8_nomin_takes(type) || rows8_blk32_takes(type);
}
/* The most activation rows each type takes here (more: the AVX2 panels from 8, else the row kernels' chunks of 4).
   Q4_K / Q5_K at 2-7 rows: rows8_q45 on chunks of up to 3 of them, the rows of a chunk sharing each weight row's
   unpacking (q45_row_sums_mr), as rows16_q45 on AVX-512. One Q4_K 16384 x 1024 at 2 threads (the AVX2 EPYC), against
   the row kernel's chunks of 4, ms: 2 rows 0.54 -> 0.42, 3 0.67 -> 0.54, 4 0.87 -> 0.82, 5 1.29 -> 0.94, 6 1.38-1.44
   -> 1.08-1.17, 7 1.55 -> 1.36-1.43 (alternated). Q6_K and IQ4_XS the same way with rows8_nomin (Q6_K 32768 x 512:
   2 rows 0.82-0.86 -> 0.62, 4 1.46 -> 1.19, 5 2.12-2.24 -> 1.45-1.50, 7 2.63-2.74 -> 1.91-2.18; IQ4_XS 1024 x 2048:
   4 rows level, 7 0.29 -> 0.27). The grids' unpacking is dearer than their products: at 2-3 rows side by side they
   gain (IQ2_XXS 16384 x 1024, 3 rows 1.15 -> 0.97; IQ3_XXS 32768 x 512, 3 rows 1.52 -> 1.36), at 4 and 7 the row
   kernel's one pass of 4 rows is ahead of chunks of 3 (IQ2_XXS 4 rows 1.20-1.85 against 2.37-2.41). */
static inline int64_t rows16_most(int type) {
    return type == MLS_Q4_K || type == MLS_Q5_K || type == MLS_Q6_K || type == MLS_IQ4_XS ? 7
         : rows8_nomin_takes(type)                                                         ? 3
                                                                                           : 1;
}
#define MLS_ROWS16_MULTI 1
static void rows16_q8k_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                            const float *xd, int64_t m, int64_t k, float *y, int64_t ldy) {
    const int five = type == MLS_Q5_K;
    const int64_t slots = k / 32;
    for (int64_t r0 = 0; r0 < nr; r0 += 8) {
        const int64_t n8 = nr - r0 < 8 ? nr - r0 : 8;
        const uint8_t *wr = w + r0 * row_bytes;
        for (int64_t i = 0; i < m; i += 3) {
            const int64_t c = m - i < 3 ? m - i : 3;
            const int8_t *xi = xq + i * k;
            const float *di = xd + i * slots;
            float *yi = y + i * ldy + r0;
            if (rows8_nomin_takes(type)) rows8_nomin_run(type, wr, row_bytes, n8, xi, di, c, k, yi, ldy);
            else if (five && c == 3) rows8_q45(wr, row_bytes, n8, 1, xi, di, 3, k, yi, ldy);
            else if (five && c == 2) rows8_q45(wr, row_bytes, n8, 1, xi, di, 2, k, yi, ldy);
            else if (five && c == 1) rows8_q45(wr, row_bytes, n8, 1, xi, di, 1, k, yi, ldy);
            else if (!five && c == 3) rows8_q45(wr, row_bytes, n8, 0, xi, di, 3, k, yi, ldy);
            else if (!five && c == 2) rows8_q45(wr, row_bytes, n8, 0, xi, di, 2, k, yi, ldy);
            else if (!five && c == 1) rows8_q45(wr, row_bytes, n8, 0, xi, di, 1, k, yi, ldy);
        }
    }
}

static void rows16_q8k(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq, const float *xd,
                       int64_t k, float *y) {
    const int five = type == MLS_Q5_K;
    for (int64_t r0 = 0; r0 < nr; r0 += 8) {
        const int64_t n8 = nr - r0 < 8 ? nr - r0 : 8;
        if (rows8_nomin_takes(type))
            rows8_nomin_run(type, w + r0 * row_bytes, row_bytes, n8, xq, xd, 1, k, y + r0, 0);
        else if (type == MLS_Q4_0 && n8 == 8)
            rows8_blk32(w + r0 * row_bytes, row_bytes, 8, MLS_Q4_0, xq, xd, k, y + r0);
        else if (type == MLS_Q4_0)
            rows8_blk32(w + r0 * row_bytes, row_bytes, n8, MLS_Q4_0, xq, xd, k, y + r0);
        else if (type == MLS_IQ4_NL && n8 == 8)
            rows8_blk32(w + r0 * row_bytes, row_bytes, 8, MLS_IQ4_NL, xq, xd, k, y + r0);
        else if (type == MLS_IQ4_NL)
            rows8_blk32(w + r0 * row_bytes, row_bytes, n8, MLS_IQ4_NL, xq, xd, k, y + r0);
        else if (five)
            rows8_q45(w + r0 * row_bytes, row_bytes, n8, 1, xq, xd, 1, k, y + r0, 0);
        else
            rows8_q45(w + r0 * row_bytes, row_bytes, n8, 0, xq, xd, 1, k, y + r0, 0);
    }
}
#elif !defined(MLS_Q8K_ROWS16) /* a build without SIMD: the row kernels take them, and these are never called */
static inline int rows16_takes(int type) {
    (void)type;
    return 0;
}
static inline int64_t rows16_most(int type) {
    (void)type;
    return 1;
}
static inline void rows16_q8k(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                              const float *xd, int64_t k, float *y) {
    (void)type, (void)w, (void)row_bytes, (void)nr, (void)xq, (void)xd, (void)k, (void)y;
}
#endif

#if !defined(MLS_Q8K_ROWS16) && !defined(MLS_ROWS16_MULTI)
static inline void rows16_q8k_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                                   const float *xd, int64_t m, int64_t k, float *y, int64_t ldy) {
    (void)type, (void)w, (void)row_bytes, (void)nr, (void)xq, (void)xd, (void)m, (void)k, (void)y, (void)ldy;
}
#endif

/* whether a product of m activation rows of a type rows16_takes runs on the side-by-side kernels: one row, or up to
   the build's rows16_most rows of its type */
static inline int rows16_in(int type, int64_t m) { return rows16_takes(type) && m <= rows16_most(type); }

/* nr (<= 16) rows at w times m activation rows (rows16_in) into y (row stride ldy) */
static inline void rows16_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                              const float *xd, int64_t m, int64_t k, float *y, int64_t ldy) {
    if (m == 1)
        rows16_q8k(type, w, row_bytes, nr, xq, xd, k, y);
    else
        rows16_q8k_rows(type, w, row_bytes, nr, xq, xd, m, k, y, ldy);
}

/* ------------------------------------------- one activation row times 16 Q4_K / Q5_K / Q4_0 weight rows (AVX-512)
   A batch-1 decode product with int8 (q8_K) activations ran x86/avx2.c's q8k_q45_mr a weight row at a time: per
   super-block ~100 instructions, of which ~45 outside the 32-value dot products (the 12 scale bytes unpacked with
   scalar shifts, two fp16 scales, the int32 lanes summed, the float steps in scalars): one thread read ~13 GB/s of
   Q4_K, instruction-bound. Here 16 weight rows go side by side: their fp16 scales and 12 scale bytes come in by
   gathers and are unpacked for all 16 rows at once (k_scales_mins8's operations in 16 lanes), the mins times the
   activation's code sums (M) by four vpdpwssd for all rows, each row's 8 int32 lanes of scaled dot products (S) made
   as q8k_q45_mr makes them, reduced into one vector (lane r = row r's sum, exact in int32 whatever the order), and
   the block's float steps in 16 lanes: lane r of acc = acc + (d_r d_x) S_r, then acc - (dmin_r d_x) M_r, the one-row
   kernel's operations in its order (-ffp-contract=off), so its bits (tests/kernels/test_int8_kquants.py holds every
   row count to llama.cpp's definitions). The next 16 rows stream into L2 beside the reads (x86/avx512.c rows16_prefetch). One thread: 13 -> 15-18 GB/s (the 2-core AMD EPYC, alternated). */
/* an int32 of two int16s: lo, hi (a vpdpwssd operand) */
static inline int32_t pair16(int16_t lo, int16_t hi) { return (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16)); }

#ifdef MLS_SIMD
/* chunk c (0..3) of a Q4_K / Q5_K super-block's codes (qs its 128 code bytes, qh Q5_K's fifth bits): sub-blocks 2c
   (*w0, the low nibbles) and 2c + 1 (*w1), unsigned bytes; five a constant where inlined */
static inline __attribute__((always_inline)) void q45_codes(const uint8_t *qs, const __m256i qh, const int five,
                                                           const int c, __m256i *w0, __m256i *w1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    *w0 = _mm256_and_si256(raw, m4), *w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if (five) {
        *w0 = _mm256_or_si256(*w0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one), 4));
        *w1 = _mm256_or_si256(*w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
    }
}

/* One Q4_K / Q5_K weight row's integer sums S of a super-block (br its block, five: Q5_K; sc16 its 8 sub-block
   scales as int16 in both halves) against the block's activation codes x[8]: 8 int32 lanes, q8k_q45_mr's sums (the
   row kernel's integers), for the kernels below that take several rows per activation load */
static inline __attribute__((always_inline)) __m256i q45_row_sums(const uint8_t *br, const int five, const __m256i sc16,
                                                                  const __m256i x[8]) {
    const uint8_t *qs = br + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(br + 16)) : _mm256_setzero_si256();
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); /* two chains, as q8k_q45_mr */
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m256i w0, w1;
        q45_codes(qs, qh, five, c, &w0, &w1);
        s0 = madd16_acc(s0, _mm256_maddubs_epi16(w0, x[2 * c]), bcast16(sc16, 2 * c));
        s1 = madd16_acc(s1, _mm256_maddubs_epi16(w1, x[2 * c + 1]), bcast16(sc16, 2 * c + 1));
    }
    return _mm256_add_epi32(s0, s1);
}

/* q45_row_sums for mr (2, 3) activation rows at once: the weight row's codes and each sub-block's scale broadcast
   made once for all of them, each row's codes loaded from xb + i k (its super-block), each row's two chains as
   q8k_q45_mr's: the same integers per row */
static inline __attribute__((always_inline)) void q45_row_sums_mr(const uint8_t *br, const int five, const __m256i sc16,
                                                                  const int8_t *xb, int64_t k, const int mr,
                                                                  __m256i *P) {
    const uint8_t *qs = br + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(br + 16)) : _mm256_setzero_si256();
    __m256i s0[3], s1[3];
    for (int i = 0; i < mr; i++) s0[i] = s1[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m256i w0, w1;
        q45_codes(qs, qh, five, c, &w0, &w1);
        const __m256i b0 = bcast16(sc16, 2 * c), b1 = bcast16(sc16, 2 * c + 1);
        for (int i = 0; i < mr; i++) {
            const int8_t *x = xb + i * k + 64 * c;
            s0[i] = madd16_acc(s0[i], _mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)x)), b0);
            s1[i] = madd16_acc(s1[i], _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 32))), b1);
        }
    }
    for (int i = 0; i < mr; i++) P[i * 16] = _mm256_add_epi32(s0[i], s1[i]);
}
#endif

#if defined(MLS_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MLS_Q8K_ROWS16 1

/* lane r = the sum of P[r]'s 8 int32 lanes, r < 16 (30 shuffles and adds) */
static inline __m512i lane_sums8(const __m256i P[16]) {
    __m512i Z[8], a[4], b[2];
    for (int r = 0; r < 8; r++) Z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(P[r]), P[r + 8], 1);
    for (int i = 0; i < 4; i++) /* per 128-bit lane: (Z2i, Z2i+1) sums of dwords (0, 2) and (1, 3) */
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(Z[2 * i], Z[2 * i + 1]), _mm512_unpackhi_epi32(Z[2 * i], Z[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: rows 4i .. 4i + 3 (lanes 0, 1) and 8 + 4i .. (lanes 2, 3) */
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
    return _mm512_shuffle_i32x4(s, s, 0xD8); /* rows 0-3, 8-11, 4-7, 12-15 -> in order */
}

/* acc + the pair sums of a b (int16 x int16 -> int32, exact): vpdpwssd, or vpmaddwd and an add without VNNI */
static inline __m512i madd16_acc512(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* nr (<= 16) rows at w (row_bytes apart) times mr (1-3) activation rows (codes xq, k apart; q8k_meta slots xd, k /
   32 apart) into y[i ldy .. + nr); five: Q5_K (176-byte super-blocks, the fifth bit from qh), else Q4_K (144); five
   and mr constants where inlined. Two or three rows share each weight row's codes, scale broadcasts, gathers and
   scale unpacking (q45_row_sums_mr), where the row kernel (x86/avx2.c q8k_q45_mr) redid a row's scalar scale
   unpacking and its ends per row; each activation row's integers and float steps stay the one-row kernel's, so its
   bits. */
static inline __attribute__((always_inline)) void rows16_q45(const uint8_t *w, int64_t row_bytes, int64_t nr,
                                                             const int five, const int8_t *xq, const float *xd,
                                                             const int mr, int64_t k, float *y, int64_t ldy) {
    const int64_t nb = k / 256, bytes = five ? 176 : 144, step = (16 * row_bytes + nb - 1) / nb, slots = k / 32;
    const __mmask16 live = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __m512i offs = rows16_offsets(row_bytes);
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4v = _mm512_set1_epi32(0x0f0f0f0f), m2 = _mm512_set1_epi32(0x03030303);
    const __m512i lo8 = _mm512_set1_epi32(0x00FF00FF), zero = _mm512_setzero_si512();
    const char *pf = (const char *)w + 16 * row_bytes;
    __m512 acc[3];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; blk++) {
        pf = rows16_prefetch(pf, w, row_bytes, blk, step);
        const uint8_t *b0 = w + blk * bytes;
        const __m512i dd = _mm512_mask_i32gather_epi32(zero, live, offs, b0, 1); /* d | dmin << 16 */
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
        const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
        /* k_scales_mins8 in 16 lanes: the 12 scale bytes as three dwords per row */
        const __m512i u0 = _mm512_mask_i32gather_epi32(zero, live, offs, b0 + 4, 1);
        const __m512i u1 = _mm512_mask_i32gather_epi32(zero, live, offs, b0 + 8, 1);
        const __m512i u2 = _mm512_mask_i32gather_epi32(zero, live, offs, b0 + 12, 1);
        const __m512i sc_lo = _mm512_and_si512(u0, m6);
        const __m512i sc_hi =
            _mm512_or_si512(_mm512_and_si512(u2, m4v), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), m2), 4));
        const __m512i mn_lo = _mm512_and_si512(u1, m6);
        const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m4v),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), m2), 4));
        const __m512i mn0 = _mm512_and_si512(mn_lo, lo8), mn1 = _mm512_and_si512(_mm512_srli_epi32(mn_lo, 8), lo8);
        const __m512i mn2 = _mm512_and_si512(mn_hi, lo8), mn3 = _mm512_and_si512(_mm512_srli_epi32(mn_hi, 8), lo8);
        /* each row's 8 scale bytes (sc_lo, sc_hi) as a qword: rows 4q, 4q + 1 from the low unpack, 4q + 2, 4q + 3
           from the high one (q the 128-bit lane) */
        uint64_t scs[16] __attribute__((aligned(64)));
        _mm512_store_si512(scs, _mm512_unpacklo_epi32(sc_lo, sc_hi));
        _mm512_store_si512(scs + 8, _mm512_unpackhi_epi32(sc_lo, sc_hi));
        __m256i P[3 * 16]; /* P[i * 16 + r]: activation row i, weight row r */
        __m256i x[8];
        if (mr == 1)
            for (int j = 0; j < 8; j++) x[j] = _mm256_loadu_si256((const __m256i *)(xq + blk * 256 + 32 * j));
        for (int r = 0; r < 16; r++) {
            if (r >= nr) {
                for (int i = 0; i < mr; i++) P[i * 16 + r] = _mm256_setzero_si256();
                continue;
            }
            const int slot = ((r & 3) < 2 ? 0 : 8) + (r >> 2) * 2 + (r & 1);
            const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(scs + slot))));
            if (mr == 1)
                P[r] = q45_row_sums(b0 + r * row_bytes, five, sc16, x);
            else
                q45_row_sums_mr(b0 + r * row_bytes, five, sc16, xq + blk * 256, k, mr, P + r);
        }
        for (int i = 0; i < mr; i++) {
            /* M_r = sum_j mn_r[j] bsum[j]: the mins as int16 pairs (j, j + 2) against bsum's, exact in int32 */
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            const int16_t *bs = meta->bsum;
            __m512i M = madd16_acc512(zero, mn0, _mm512_set1_epi32(pair16(bs[0], bs[2])));
            M = madd16_acc512(M, mn1, _mm512_set1_epi32(pair16(bs[1], bs[3])));
            M = madd16_acc512(M, mn2, _mm512_set1_epi32(pair16(bs[4], bs[6])));
            M = madd16_acc512(M, mn3, _mm512_set1_epi32(pair16(bs[5], bs[7])));
            const __m512 dx = _mm512_set1_ps(meta->d);
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(lane_sums8(P + i * 16))));
            acc[i] = _mm512_sub_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(M)));
        }
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + i * ldy, live, acc[i]);
}

/* acc + the sums of four u8 x s8 products per int32 lane (exact: the callers' codes keep every pair's sum inside
   int16): vpdpbusd, or vpmaddubsw, vpmaddwd and an add without VNNI */
static inline __m512i dpbusd_acc512(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

/* Q4_0 (18-byte blocks: fp16 d, 16 bytes of nibbles, value d (q - 8)), nr (<= 16) rows times one activation row of
   Q8_0-style codes (xq, one scale per 32 values in xd), two rows per 512-bit vector. The row kernel (x86/avx2.c
   q8rows_mr) keeps 8 float lanes per row, lane l = fma(d_w d_x, S_l, lane l) per block in order, S_l the exact sum
   of the 4 products (q - 8) x of its values, and one thread ran ~14 instructions per block and row (~14 GB/s). Here
   a vector holds two rows' 8 lanes (lanes 0-7 and 8-15: row 2p and 2p + 1), S comes from the unsigned nibbles
   directly, S_l = sum q x - 8 X_l (X_l the lane's activation codes' sum, made once per block for all rows; the
   same integer), the 16 rows' d_w d_x from one gather (the same fp32 products) and each pair's fma takes its two
   scales at once: every lane's operations and order are the row kernel's, so its bits, ~5 instructions per block
   and row. */
static inline __attribute__((always_inline)) void rows16_q4_0_n(const uint8_t *w, int64_t row_bytes, int64_t nr,
                                                                 const int pairs, const int8_t *xq, const float *xd,
                                                                 int64_t k, float *y) {
    const int64_t nb = k / 32, step = (16 * row_bytes + nb - 1) / nb;
    const __mmask16 live = nr >= 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __m512i offs = rows16_offsets(row_bytes), zero = _mm512_setzero_si512();
    const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    /* per 128-bit lane of [row a, row a, row b, row b]'s 16 bytes: the low nibbles (values 0-15), the high (16-31) */
    const __m512i shift = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                            0x0004000400040004);
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); /* s's lanes 2p, 2p + 1 */
    __m512 acc[8];
    for (int p = 0; p < 8; p++) acc[p] = _mm512_setzero_ps();
    const char *pf = (const char *)w + 16 * row_bytes;
    for (int64_t blk = 0; blk < nb; blk++) {
        pf = rows16_prefetch(pf, w, row_bytes, blk, step);
        const uint8_t *b0 = w + blk * 18;
        const __m512i dd = _mm512_mask_i32gather_epi32(zero, live, offs, b0, 1); /* d in the low 16 bits */
        const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)), _mm512_set1_ps(xd[blk]));
        const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + blk * 32)));
        const __m512i bias = _mm512_sub_epi32(zero, _mm512_slli_epi32(dpbusd_acc512(zero, ones, x), 3)); /* -8 X */
        for (int p = 0; p < pairs; p++) {
            const uint8_t *ra = b0 + 2 * p * row_bytes + 2, *rb = 2 * p + 1 < nr ? ra + row_bytes : ra;
            const __m512i raw = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ra))),
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rb)), 1);
            const __m512i q = _mm512_and_si512(_mm512_srlv_epi16(raw, shift), m4);
            const __m512 sp = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32((int)(2 * p))), s);
            acc[p] = _mm512_fmadd_ps(sp, _mm512_cvtepi32_ps(dpbusd_acc512(bias, q, x)), acc[p]);
        }
    }
    for (int p = 0; p < pairs; p++) {
        y[2 * p] = hsum8(_mm512_castps512_ps256(acc[p]));
        if (2 * p + 1 < nr) y[2 * p + 1] = hsum8(_mm512_extractf32x8_ps(acc[p], 1));
    }
}

/* rows16_q4_0_n with a constant count of pairs: a whole run of 16 rows (every run but a weight's last) keeps its 8
   accumulators in registers (a count read at run time kept them on the stack, a load and a store per fma; perf:
   this kernel 65% of a ds-real Q4_0 batch-1 step). The two libraries in one process, one activation row, 2 threads:
   1408 x 2048 22.8 -> 25.1 GB/s, 10944 x 2048 19.4 -> 21.2; the step 13.0-13.3 -> 11.8-12.9 ms (alternated; the
   2-core AMD EPYC) */
static void rows16_q4_0(const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq, const float *xd, int64_t k,
                        float *y) {
    if (nr == 16)
        rows16_q4_0_n(w, row_bytes, nr, 8, xq, xd, k, y);
    else
        rows16_q4_0_n(w, row_bytes, nr, (int)(nr + 1) / 2, xq, xd, k, y);
}

/* Q4_0 times m >= 2 activation rows (their Q8_0-style codes and scales), two rows per 512-bit vector: lanes 0-7 row
   2p's 8 float lanes, 8-15 row 2p + 1's, and two weight rows per pass, so each activation pair's vector (and its
   8 X_l, the lanes' code sums) serves both. Per lane the row kernel's operations in its order (x86/avx2.c q8rows_mr:
   fma(d_w d_x, S_l, lane) per block, S_l = sum q x - 8 X_l the same integer as its signed sum), so its bits at every
   row count; ~4 instructions per block and activation row against its ~10 (a 16-request step of the standard Q4_0
   file spent 53% of both threads in it). xp: the activations as pairs, [blocks][8][64 bytes] per chunk of 16 rows
   (row 2p in the low 32 bytes, a missing row zero), dxt: their scales [blocks][16] (zero past the last row). */
static inline __attribute__((always_inline)) void q4_0_pairs_n(const uint8_t *w, int64_t row_bytes, int64_t nr,
                                                                const int8_t *xp, const float *dxt, int64_t rows,
                                                                const int pairs, int64_t k, float *y, int64_t ldy) {
    const int64_t nb = k / 32;
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const uint8_t *w1 = nr > 1 ? w + row_bytes : w;
    __m512 acc[2][8];
    for (int r = 0; r < 2; r++)
        for (int p = 0; p < 8; p++) acc[r][p] = _mm512_setzero_ps();
    const char *pf = (const char *)w1 + PREFETCH_AHEAD;
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b0 = w + blk * 18, *b1 = w1 + blk * 18;
        pf = prefetch_stream(pf, b1);
        const __m512i q0 = _mm512_broadcast_i64x4(nibbles32(b0 + 2)), q1 = _mm512_broadcast_i64x4(nibbles32(b1 + 2));
        const __m512 d0 = _mm512_set1_ps(f16(b0)), d1 = _mm512_set1_ps(f16(b1));
        const __m512 dx16 = _mm512_loadu_ps(dxt + blk * 16);
        for (int p = 0; p < pairs; p++) {
            const __m512i x = _mm512_loadu_si512((const void *)(xp + (blk * 8 + p) * 64));
            const __m512i bias = _mm512_sub_epi32(zero, _mm512_slli_epi32(dpbusd_acc512(zero, ones, x), 3));
            const __m512 dx = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32((int)(2 * p))), dx16);
            acc[0][p] = _mm512_fmadd_ps(_mm512_mul_ps(d0, dx), _mm512_cvtepi32_ps(dpbusd_acc512(bias, q0, x)), acc[0][p]);
            acc[1][p] = _mm512_fmadd_ps(_mm512_mul_ps(d1, dx), _mm512_cvtepi32_ps(dpbusd_acc512(bias, q1, x)), acc[1][p]);
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int p = 0; p < pairs; p++) {
            y[2 * p * ldy + r] = hsum8(_mm512_castps512_ps256(acc[r][p]));
            if (2 * p + 1 < rows) y[(2 * p + 1) * ldy + r] = hsum8(_mm512_extractf32x8_ps(acc[r][p], 1));
        }
}

/* q4_0_pairs_n for rows (<= 16) activation rows: a constant count of pairs per call, so the accumulators stay in
   registers */
static void q4_0_pairs_rows(const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xp, const float *dxt,
                            int64_t rows, int64_t k, float *y, int64_t ldy) {
    switch ((rows + 1) / 2) {
    case 1: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 1, k, y, ldy); break;
    case 2: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 2, k, y, ldy); break;
    case 3: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 3, k, y, ldy); break;
    case 4: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 4, k, y, ldy); break;
    case 5: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 5, k, y, ldy); break;
    case 6: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 6, k, y, ldy); break;
    case 7: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 7, k, y, ldy); break;
    default: q4_0_pairs_n(w, row_bytes, nr, xp, dxt, rows, 8, k, y, ldy);
    }
}

/* whether Q4_0's products of m activation rows take q4_0_pairs_rows */
static inline int q4_0_pairs_takes(int type, int64_t m) { return type == MLS_Q4_0 && m >= 2; }

/* the activation rows xq [m, k] / xd [m, k / 32] as q4_0_pairs_rows reads them: chunks of 16 rows, xp [chunks][kb][8][64],
   dxt [chunks][kb][16] */
static void q4_0_pairs_pack(const int8_t *xq, const float *xd, int64_t m, int64_t k, int8_t *xp, float *dxt) {
    const int64_t kb = k / 32, chunks = (m + 15) / 16;
    memset(xp, 0, (size_t)(chunks * kb * 8 * 64));
    memset(dxt, 0, sizeof(float) * (size_t)(chunks * kb * 16));
    for (int64_t i = 0; i < m; i++) {
        const int64_t c = i / 16, p = (i % 16) / 2, h = i % 2;
        for (int64_t blk = 0; blk < kb; blk++) {
            memcpy(xp + ((c * kb + blk) * 8 + p) * 64 + h * 32, xq + i * k + blk * 32, 32);
            dxt[(c * kb + blk) * 16 + i % 16] = xd[i * kb + blk];
        }
    }
}

/* whether one-row products of a type run here */
static inline int rows16_takes(int type) { return type == MLS_Q4_K || type == MLS_Q5_K || type == MLS_Q4_0; }

/* nr (<= 16) rows of a type rows16_takes at w times one activation row of its int8 codes (q8_K for the K-quants,
   Q8_0-style for Q4_0) into y[0 .. nr) */
static void rows16_q8k(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq, const float *xd,
                       int64_t k, float *y) {
    if (type == MLS_Q4_K)
        rows16_q45(w, row_bytes, nr, 0, xq, xd, 1, k, y, 0);
    else if (type == MLS_Q5_K)
        rows16_q45(w, row_bytes, nr, 1, xq, xd, 1, k, y, 0);
    else
        rows16_q4_0(w, row_bytes, nr, xq, xd, k, y);
}

/* whether products of 2-3 activation rows of this type take rows16_q8k_rows: Q4_K, Q5_K. One Q4_K weight, GB/s, 2
   threads, against the row kernel (x86/avx2.c q8rows_q4_k; 2816 x 2048, 1024 x 1024; the 2-core AMX Xeon): 2 rows
   13.4-13.9 -> 14.5-16.9, 3 rows 8.3-10.9 -> 11.3-13.0; at 4 and 5 rows the row kernel's four-row chunks stay
   ahead (4: 11.3-13.5 against 10.5-11.7 here with four rows per pass), so they keep it. */
static inline int64_t rows16_most(int type) { return type == MLS_Q4_K || type == MLS_Q5_K ? 3 : 1; }

/* nr (<= 16) rows of a type rows16_most takes at 2-3 rows times m (2, 3) activation rows (q8_K codes xq [m, k],
   scales xd) into y (row stride ldy); each row's result its one-row kernel's bits (five and the row count constants
   in each call) */
static void rows16_q8k_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int8_t *xq,
                            const float *xd, int64_t m, int64_t k, float *y, int64_t ldy) {
    if (type == MLS_Q4_K && m == 3) rows16_q45(w, row_bytes, nr, 0, xq, xd, 3, k, y, ldy);
    if (type == MLS_Q4_K && m == 2) rows16_q45(w, row_bytes, nr, 0, xq, xd, 2, k, y, ldy);
    if (type == MLS_Q5_K && m == 3) rows16_q45(w, row_bytes, nr, 1, xq, xd, 3, k, y, ldy);
    if (type == MLS_Q5_K && m == 2) rows16_q45(w, row_bytes, nr, 1, xq, xd, 2, k, y, ldy);
}
#endif

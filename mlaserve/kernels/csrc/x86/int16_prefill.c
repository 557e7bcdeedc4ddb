/* --------------------- products of many rows with int16 activations for the 32-value block types (AVX512-VNNI)
   Prefill products (more than GEMV_ROWS activation rows) of the weight types whose value is a block scale times an
   integer code per 32 values (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4: avx2.c block_codes16 / block_d), where the CPU has
   AVX512-VNNI and the process no AMX-BF16 tiles. For Q8_0 the rule keeps fp32 grade (plain bf16 or int8
   activations add about its own error), and fp32 runs at the FMA units' ceiling (16 multiply-adds an instruction);
   the others took bf16 decode-then-GEMM, which decodes the whole weight per call. Here each activation is an int16
   code per 32-value block with an fp32 scale, the weight's codes are widened to int16 once per call into 16-row
   panels, and vpdpwssd sums 32 products an instruction, exact in int32; each block's two scales multiply that sum in
   fp32. 16-bit codes add ~2^-16 of a block's largest activation per value (fp32 grade).

   Notation (one product y = x W^T; activation row i, weight row r, 32-value block b, u = 2^-24)
     w = d q                    a weight value: the block's scale d (fp16; MXFP4 a power of two) times its integer
                                code q (|q| <= 128: Q8_0's int8, Q4_0 nibble - 8, Q5_0 5 bits - 16, IQ4_NL's table,
                                MXFP4's doubled e2m1 values), the reference's value exactly
     a_b = max_{k in b} |x_k|   d_x = fl(a_b / 32767), id = fl(32767 / a_b), c_k = rne(fl(x_k id)), |c_k| <= 32767
                                (a_b < QW_TINY: d_x = 0, c = 0; a non-finite x_k: d_x = NaN, so the row is NaN)
     |x_k - d_x c_k| <= e_k = d_x / 2 + 3.01 u |x_k|          (<= 1.02 2^-16 a_b)
     S_b[i, r] = sum_{k in b} q[r, k] c[i, k]                 exact int32: |S_b| <= 32 128 32767 < 2^31
     y[i, r] = sum_b fl(d[r, b] d_x[i, b]) fl(S_b)            one fma per block, in block order
     error: |y - x W^T| <= sum_k |w_k| e_k + (K / 32 + 2) u (1 + 2^-20) sum_k |w_k| (|x_k| + e_k)
            (tests/kernels/test_int16_prefill.py holds it to that against fp64, and the integer sums to its own codes)
   Layout (vpdpwssd: int32 lane += lo16(a) lo16(b) + hi16(a) hi16(b))
     C  [kb, 16 j, 16 r] int32    weight row r's codes, widened, as pairs: j = 2 t holds (q_4t, q_4t+2), j = 2 t + 1
                                  (q_4t+1, q_4t+3) of block b (the order two byte shifts give from a dword)
     D  [kb, 16 r] fp32           their scales
     xc [P, K] int16, xd [P, K / 32] fp32   the activations' codes in the same pair order (per 4 values c_0, c_2,
                                  c_1, c_3: dword j of a block pairs with C[b, j]) and their scales
   A row's result is the same whatever the batch or the threads: its sums and float steps do not depend on the rows
   beside it. */
#if defined(MLS_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MLS_INT16 1
#define MLS_INT16_PANELS 1 /* many rows on unpacked panels: a prompt's products take these (int16.c mls_int16_takes) */
#define QW_R 16      /* weight rows per panel: the int32 lanes of a vector */
#define QW_MR 8      /* activation rows per tile: 8 sums, 8 accumulators in registers */
#define QW_CHUNK 256 /* activation rows per work item: their codes stay in cache while the panels pass */
#define QW_TINY 0x1p-100f

/* one activation row's blocks into codes and scales (the pair order above) */
static void qw_quantize_row(const float *x, int64_t k, int16_t *xc, float *xd) {
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        /* x 0 is NaN for a NaN or an infinity, 0 otherwise */
        const float finite = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(v0, zero), _mm512_mul_ps(v1, zero)));
        if (finite != finite || !(amax >= QW_TINY)) {
            xd[b] = finite != finite ? finite : 0.0f;
            memset(xc + 32 * b, 0, 64);
            continue;
        }
        const __m512 id = _mm512_set1_ps(32767.0f / amax);
        xd[b] = amax / 32767.0f;
        for (int h = 0; h < 2; h++) {
            const __m512i c = _mm512_cvt_roundps_epi32(_mm512_mul_ps(h ? v1 : v0, id),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_storeu_si256((__m256i *)(xc + 32 * b + 16 * h),
                                _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(order, c)));
        }
    }
}

/* the types whose products run here: d times an integer code per 32 values (block_codes16) */
static inline int qw_type(int type) {
    return type == MLS_Q8_0 || type == MLS_Q4_0 || type == MLS_Q5_0 || type == MLS_IQ4_NL || type == MLS_MXFP4;
}

/* a block's 32 codes as int8 in one vector (Q8_0 loaded straight from the block) */
static inline __attribute__((always_inline)) __m256i qw_codes(const uint8_t *b, const int type) {
    if (type == MLS_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    __m128i g[2];
    block_codes16(b, type, g);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(g[0]), g[1], 1);
}

/* nr (<= 16) rows of a block type, row_bytes apart from w, into the panel C [kb * 16], D [kb]; lanes past nr zero.
   Two blocks at a time: each row's 2 x 32 codes as 16 dwords, transposed so that vector j holds dword j of every
   row; type a constant where inlined */
static inline __attribute__((always_inline)) void qw_unpack(const int type, const uint8_t *w, int64_t row_bytes,
                                                            int64_t nr, int64_t k, __m512i *C, __m512 *D) {
    const int64_t kb = k / 32, bytes = block_bytes(type);
    for (int64_t b = 0; b < kb; b += 2) {
        const int two = b + 1 < kb;
        __m512i v[16];
        float d[2][QW_R] __attribute__((aligned(64))) = {{0}};
        for (int r = 0; r < 16; r++) {
            if (r >= nr) {
                v[r] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *p = w + r * row_bytes + bytes * b;
            d[0][r] = block_d(p, type);
            d[1][r] = two ? block_d(p + bytes, type) : 0.0f;
            const __m256i hi = two ? qw_codes(p + bytes, type) : _mm256_setzero_si256();
            v[r] = _mm512_inserti64x4(_mm512_castsi256_si512(qw_codes(p, type)), hi, 1);
        }
        transpose16_epi32(v); /* v[8 h + t]: dword t (values 4 t .. 4 t + 3) of block b + h, lane r */
        for (int h = 0; h <= two; h++) {
            D[b + h] = _mm512_load_ps(d[h]);
            for (int t = 0; t < 8; t++) {
                const __m512i u = v[8 * h + t];
                C[(b + h) * 16 + 2 * t] = _mm512_srai_epi16(_mm512_slli_epi16(u, 8), 8); /* q_4t, q_4t+2 */
                C[(b + h) * 16 + 2 * t + 1] = _mm512_srai_epi16(u, 8);                 /* q_4t+1, q_4t+3 */
            }
        }
    }
}

/* activation rows [0, mr) (codes xc, k apart; scales xd, k / 32 apart) times the panel into y (row stride ldy;
   lanes `live` stored); mr a constant where inlined */
static inline __attribute__((always_inline)) void qw_tile(const __m512i *C, const __m512 *D, const int16_t *xc,
                                                          const float *xd, const int mr, int64_t k, float *y,
                                                          int64_t ldy, __mmask16 live) {
    const int64_t kb = k / 32;
    __m512 acc[QW_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        __m512i S[QW_MR];
        for (int i = 0; i < mr; i++) S[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const __m512i cv = _mm512_load_si512(C + b * 16 + j);
            for (int i = 0; i < mr; i++) {
                int32_t pair;
                memcpy(&pair, xc + i * k + 32 * b + 2 * j, 4);
                S[i] = _mm512_dpwssd_epi32(S[i], cv, _mm512_set1_epi32(pair));
            }
        }
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(D[b], _mm512_set1_ps(xd[i * kb + b])), _mm512_cvtepi32_ps(S[i]), acc[i]);
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + i * ldy, live, acc[i]);
}

/* m activation rows times one unpacked panel (nr live rows): tiles of QW_MR rows, the last one shorter */
static void qw_rows(const __m512i *C, const __m512 *D, const int16_t *xc, const float *xd, int64_t m, int64_t k,
                    float *y, int64_t ldy, int64_t nr) {
    const __mmask16 live = nr >= QW_R ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int64_t i = 0; i < m; i += QW_MR) {
        const int16_t *ci = xc + i * k;
        const float *di = xd + i * (k / 32);
        float *yi = y + i * ldy;
#define QW_TILE(r)                                     \
    case r:                                            \
        qw_tile(C, D, ci, di, r, k, yi, ldy, live);    \
        break;
        switch (m - i < QW_MR ? m - i : QW_MR) {
            QW_TILE(8) QW_TILE(7) QW_TILE(6) QW_TILE(5) QW_TILE(4) QW_TILE(3) QW_TILE(2) QW_TILE(1)
        default: break;
        }
#undef QW_TILE
    }
}

/* ------------------------------------------ few activation rows: the weight rows read where they lie, no panel
   Where a product (or a routed expert's group) has at most QW_FEW activation rows, unpacking the 16-row panel cost
   more than the products on it (the panel path read ~8 GB/s at one row, against the fp32 row kernels' ~17 and this
   path's 21-22; one thread of the 2-core AMD EPYC, measured before this path). Here 16 weight rows are taken
   together as they lie: each row's block codes widened to int16 (32 in a vector) and met by the activation block's
   codes in one vpdpwssd (16 int32 lanes of pair sums), the 16 rows' lane sums reduced into one vector (lane r =
   S_b[i, r], exact in int32 whatever the order), and the block's fp32 step exactly as qw_tile's: lane r of
   acc += fl(d[r, b] d_x[i, b]) fl(S_b). The same integers and the same float operations in the same order, so the
   same bits as the panel path at every row count (tests/kernels/test_int16_prefill.py), and a product may take
   either by its row count. */
/* activation rows up to which the rows are read in place: each row here costs a tree of 45 shuffles per block and 16
   rows, on the panels one vpdpwssd; the unpack pays for itself from ~4 rows (measured at 1 and 16, counted between) */
#define QW_FEW 3

/* lane r = the sum of v[r]'s 16 int32 lanes (45 shuffles and adds for 16 rows) */
static inline __m512i qw_lane_sums(__m512i v[16]) {
    __m512i a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (v2i, v2i+1) sums of dwords (0, 2) and (1, 3) */
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the four rows 4i .. 4i + 3 */
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xDD));
    const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88), _mm512_shuffle_i32x4(b[2], b[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xDD));
}

/* a block's 32 codes widened to int16 (value j in lane j): Q4_0 and Q5_0 straight from their nibbles (the 16 bytes
   widened once, the high nibbles shifted down in the upper half, Q5_0's fifth bit from its 32-bit mask), the rest
   as qw_codes widened; the same integers either way */
static inline __attribute__((always_inline)) __m512i qw_codes16(const uint8_t *b, const int type) {
    if (type != MLS_Q4_0 && type != MLS_Q5_0) return _mm512_cvtepi8_epi16(qw_codes(b, type));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + (type == MLS_Q4_0 ? 2 : 6))));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(bytes), bytes, 1), shift),
                                         _mm512_set1_epi16(0x0F));
    if (type == MLS_Q4_0) return _mm512_sub_epi16(nib, _mm512_set1_epi16(8));
    const __m512i low = _mm512_sub_epi16(nib, _mm512_set1_epi16(16)); /* the fifth bit 0: nib - 16, 1: nib */
    return _mm512_mask_add_epi16(low, (__mmask32)u32(b + 2), low, _mm512_set1_epi16(16));
}

/* the 16 rows' block scales d (block_d) from the dwords at their block starts (lanes past live: 0) */
static inline __attribute__((always_inline)) __m512 qw_scales(const uint8_t *b0, __m512i offs, __mmask16 live,
                                                              const int type) {
    const __m512i raw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs, b0, 1);
    if (type != MLS_MXFP4) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw)); /* the fp16 at the block's start */
    const __m512i e = _mm512_and_si512(raw, _mm512_set1_epi32(0xFF)); /* e8m0_half: 2^(e - 128) */
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, sub));
}

/* nr (<= 16) weight rows at w (row_bytes apart) times activation rows [0, mr) (codes xc in qw_quantize_row's pair
   order, k apart; scales xd) into y (row stride ldy); mr, type constants where inlined. The next 16 rows (the
   following item's, mostly this thread's) stream into L2 beside the reads (x86/avx512.c rows16_prefetch; a
   row-ahead prefetch per row instead read 14-15 GB/s on one thread). */
static inline __attribute__((always_inline)) void qw_few(const int type, const uint8_t *w, int64_t row_bytes,
                                                         int64_t nr, const int16_t *xc, const float *xd, const int mr,
                                                         int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32, bytes = block_bytes(type), step = (16 * row_bytes + kb - 1) / kb;
    const __mmask16 live = nr >= QW_R ? 0xFFFF : (__mmask16)((1u << nr) - 1);
    const __m512i offs = rows16_offsets(row_bytes);
    /* pair order -> natural order: positions 1 and 2 of every 4 swap (an involution) */
    static const int16_t swap12[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                       16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
    const __m512i natural = _mm512_loadu_si512(swap12);
    const char *pf = (const char *)w + 16 * row_bytes;
    __m512 acc[QW_FEW];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        pf = rows16_prefetch(pf, w, row_bytes, b, step);
        __m512i xv[QW_FEW], P[QW_FEW][16];
        for (int i = 0; i < mr; i++) xv[i] = _mm512_permutexvar_epi16(natural, _mm512_loadu_si512(xc + i * k + 32 * b));
        for (int r = 0; r < 16; r++) {
            const __m512i c = r < nr ? qw_codes16(w + r * row_bytes + bytes * b, type) : _mm512_setzero_si512();
            for (int i = 0; i < mr; i++) P[i][r] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c, xv[i]);
        }
        const __m512 D = qw_scales(w + bytes * b, offs, live, type);
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(D, _mm512_set1_ps(xd[i * kb + b])), _mm512_cvtepi32_ps(qw_lane_sums(P[i])), acc[i]);
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + i * ldy, live, acc[i]);
}

/* m (<= QW_FEW) activation rows times nr weight rows read in place; type specialised */
static void qw_few_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc, const float *xd,
                        int64_t m, int64_t k, float *y, int64_t ldy) {
#define QW_FEW_CASE(t)                                                                   \
    case t:                                                                              \
        if (m == 1) qw_few(t, w, row_bytes, nr, xc, xd, 1, k, y, ldy);                   \
        else if (m == 2) qw_few(t, w, row_bytes, nr, xc, xd, 2, k, y, ldy);              \
        else qw_few(t, w, row_bytes, nr, xc, xd, 3, k, y, ldy);                          \
        break;
    switch (type) {
        QW_FEW_CASE(MLS_Q8_0) QW_FEW_CASE(MLS_Q4_0) QW_FEW_CASE(MLS_Q5_0) QW_FEW_CASE(MLS_IQ4_NL)
        default: QW_FEW_CASE(MLS_MXFP4)
    }
#undef QW_FEW_CASE
}

/* the bytes of a thread's panel buffer for rows of k values (qw_run: C [kb, 16] and D [kb] vectors) */
static inline size_t qw_panel_bytes(int64_t k) { return (size_t)(k / 32) * 17 * 64; }

/* nr (<= 16) weight rows at w (row_bytes apart) times m activation rows (codes xc, k apart, and scales xd:
   qw_quantize_row's) into y (row stride ldy): read in place for m <= QW_FEW, else unpacked into the panel buffer
   (qw_panel_bytes) and met by the rows in tiles. The same bits either way. */
static void qw_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc, const float *xd,
                   int64_t m, int64_t k, float *y, int64_t ldy, void *panel) {
    if (m <= QW_FEW) {
        qw_few_rows(type, w, row_bytes, nr, xc, xd, m, k, y, ldy);
        return;
    }
    __m512i *C = (__m512i *)panel;
    __m512 *D = (__m512 *)(C + (k / 32) * 16);
    switch (type) { /* each type's unpack specialised */
    case MLS_Q8_0: qw_unpack(MLS_Q8_0, w, row_bytes, nr, k, C, D); break;
    case MLS_Q4_0: qw_unpack(MLS_Q4_0, w, row_bytes, nr, k, C, D); break;
    case MLS_Q5_0: qw_unpack(MLS_Q5_0, w, row_bytes, nr, k, C, D); break;
    case MLS_IQ4_NL: qw_unpack(MLS_IQ4_NL, w, row_bytes, nr, k, C, D); break;
    default: qw_unpack(MLS_MXFP4, w, row_bytes, nr, k, C, D); break;
    }
    qw_rows(C, D, xc, xd, m, k, y, ldy, nr);
}
#endif

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
#define MLS_INT16_PREFILL 1
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

/* ------------------------------------ Q8_0 on the AMX-INT8 tiles: each int16 code as its high and low byte
   Where the process has the AMX-INT8 tiles, a Q8_0 product of QA_MIN_ROWS activation rows or more takes the same
   integers on the tile unit. An activation code is c = 256 h + l (h = c >> 8 in -128..127, l = c & 255 in 0..255), so
     S_b[r, i] = 256 sum_{k in b} q[r, k] h[i, k] + sum_{k in b} q[r, k] l[i, k]     (TDPBSSD, TDPBSUD: exact int32)
   and the block's float step is qw_tile's: y[i, r] += fl(d[r, b] d_x[i, b]) fl(S_b[r, i]), block by block. The same
   bits as the VNNI panels and rows (tests/kernels/test_int16_prefill.py compares a row's result at every row count),
   with two tile products in place of 512 vpdpwssd and broadcasts per block of 16 weight and 16 activation rows.
   Layout (one 32-value block b: K = 32, half a tile's depth; 16 weight rows r, one group of 16 activation rows i)
     A [16 r, 32]           int8    the weight rows' codes of block b, loaded from the blocks as they lie (a tile
                                    row per weight row, row_bytes apart): no unpack
     B_h, B_l [8, 16 i x 4] int8 / uint8   the activation rows' high and low bytes, 4 consecutive values per int32,
                                    packed once per call (qa_pack: xbh, xbl [group][kb][8][16] int32, each group's
                                    rows padded with zeros to 16), their scales xdt [group][kb][16]
     C_h, C_l [16 r, 16 i]  int32   = A B_h, A B_l; 256 C_h + C_l = S_b
   acc[r] (lanes i) += fl(d[r, b] d_x[i, b]) fl(S_b[r, :]); the 16 x 16 sums are transposed into y's rows at the end. */
#ifdef MLS_AMX
#define MLS_INT16_TILES 1 /* this build runs them (moe/block.c asks) */

/* this thread's tile shapes: A (tile 0) 16 x 32 bytes, B_h, B_l (1, 2) 8 x 64, C_h, C_l (3, 4) 16 x 64 */
static void qa_config(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = t == 1 || t == 2 ? 8 : 16;
        c.colsb[t] = t == 0 ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

/* activation rows from which a Q8_0 product takes the tiles: one weight's GB/s (benchmarks/gemv_bandwidth.py --rows,
   2 threads, 1536 x 2048, 2048 x 1536, 32768 x 2048; the 2-core AMX Xeon of 2026-12-06), tiles / VNNI panels: 16 rows
   10.1-13.5 / 5.4-6.1, 8 rows 11.2-12.4 / 6.8-7.9, 6 rows 10.3-12.1 / 7.5-10.3, 4 rows 10.2-12.5 / 7.6-11.2; 1-3 rows
   keep the weight rows read in place (qw_few: 17-20 GB/s at one row), where a tile pass would cost what 16 rows do.
   The same bits either way. */
#define QA_MIN_ROWS 4

/* whether a product of m rows of this type runs here on the tiles */
static inline int qa_takes(int type, int64_t m) { return type == MLS_Q8_0 && m >= QA_MIN_ROWS && amx_permission() == 1; }

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

/* 16 Q8_0 weight rows at w (row_bytes apart) times one packed group of activation rows into y rows [0, mr) (row
   stride ldy). The next 16 weight rows stream into L2 beside the reads, as qw_few's. */
static void qa_pass(const uint8_t *w, int64_t row_bytes, const int32_t *bh, const int32_t *bl, const float *xdt, int mr,
                    int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32, step = (16 * row_bytes + kb - 1) / kb;
    const __m512i offs = rows16_offsets(row_bytes);
    const char *pf = (const char *)w + 16 * row_bytes;
    int32_t cs[2][256] __attribute__((aligned(64)));
    float d[16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        pf = rows16_prefetch(pf, w, row_bytes, b, step);
        _tile_loadd(0, w + 34 * b + 2, row_bytes);
        _tile_loadd(1, bh + b * 128, 64);
        _tile_loadd(2, bl + b * 128, 64);
        _tile_zero(3);
        _tile_zero(4);
        _tile_dpbssd(3, 0, 1);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(3, cs[0], 64);
        _tile_stored(4, cs[1], 64);
        _mm512_store_ps(d, qw_scales(w + 34 * b, offs, 0xFFFF, MLS_Q8_0));
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

/* 16 Q8_0 weight rows at w times m activation rows packed by qa_pack (groups of 16, kb * 128 int32 of each byte and
   kb * 16 scales apart) into y (row stride ldy) */
static void qa_rows(const uint8_t *w, int64_t row_bytes, const int32_t *bh, const int32_t *bl, const float *xdt,
                    int64_t m, int64_t k, float *y, int64_t ldy) {
    const int64_t kb = k / 32;
    for (int64_t s = 0; 16 * s < m; s++)
        qa_pass(w, row_bytes, bh + s * kb * 128, bl + s * kb * 128, xdt + s * kb * 16,
                m - 16 * s < 16 ? (int)(m - 16 * s) : 16, k, y + 16 * s * ldy, ldy);
}

/* rows [0, m) of codes xc / scales xd (k values each) packed for qa_rows into bh, bl, xdt, one group of 16 rows per
   iteration of the team's loop (called by every thread of a team) */
static void qa_pack_rows(const int16_t *xc, const float *xd, int64_t m, int64_t k, int32_t *bh, int32_t *bl,
                         float *xdt) {
    const int64_t kb = k / 32;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < (m + 15) / 16; g++)
        qa_pack(xc + 16 * g * k, xd + 16 * g * kb, m - 16 * g < 16 ? m - 16 * g : 16, k, bh + g * kb * 128,
                bl + g * kb * 128, xdt + g * kb * 16);
}
#else
static inline int qa_takes(int type, int64_t m) {
    (void)type, (void)m;
    return 0;
}
#endif

/* one call's work list: (group, chunk of QW_CHUNK rows, 16-row panel) items, first[a] group a's first item */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t n, row_bytes, expert_stride, k, panels, ldy;
    const int64_t *experts, *starts, *first;
    const int16_t *xc;
    const float *xd;
    float *y;
    int amx;                  /* Q8_0 items of QA_MIN_ROWS rows or more on the AMX-INT8 tiles (qa_pass) */
    const int64_t *pstart;    /* (amx) each group's first row, its rows padded to multiples of 16 */
    const int32_t *xbh, *xbl; /* (amx) every 16 padded rows' high and low bytes, packed (qa_pack) */
    const float *xdt;         /* (amx) their scales, packed */
} qw_work;

/* item it: its group (*a, moved from the last item's), chunk and panel, on qw_run (mem: the thread's panel) */
static inline void qw_item(const qw_work *q, int64_t it, int64_t *a, void *mem) {
    while (q->first[*a + 1] <= it) (*a)++;
    while (q->first[*a] > it) (*a)--;
    const int64_t g = *a, k = q->k, c = (it - q->first[g]) / q->panels, r0 = (it - q->first[g]) % q->panels * QW_R;
    const int64_t p0 = q->starts[g] + c * QW_CHUNK, left = q->starts[g + 1] - p0;
    const int64_t m = left < QW_CHUNK ? left : QW_CHUNK, nr = q->n - r0 < QW_R ? q->n - r0 : QW_R;
    const int64_t i0 = p0 - q->starts[0];
#ifdef MLS_AMX
    if (q->amx && qa_takes(q->type, m) && nr == QW_R) { /* a last panel of fewer rows: qw_run, the same bits */
        const int64_t kb = k / 32, g0 = (q->pstart[g] + c * QW_CHUNK) / 16; /* QW_CHUNK a multiple of 16 */
        qa_rows(q->w + q->experts[g] * q->expert_stride + r0 * q->row_bytes, q->row_bytes, q->xbh + g0 * kb * 128,
                q->xbl + g0 * kb * 128, q->xdt + g0 * kb * 16, m, k, q->y + p0 * q->ldy + r0, q->ldy);
        return;
    }
#endif
    qw_run(q->type, q->w + q->experts[g] * q->expert_stride + r0 * q->row_bytes, q->row_bytes, nr, q->xc + i0 * k,
           q->xd + i0 * (k / 32), m, k, q->y + p0 * q->ldy + r0, q->ldy, mem);
}

/* Rows [starts[a], starts[a + 1]) of x (row stride ldx) times expert experts[a]'s n rows (w + experts[a] *
   expert_stride, row_bytes apart) into y (row stride ldy). One parallel region: the activations quantized (rows
   split between the threads), then the work list (qw_work), each item's rows read in place or its panel unpacked
   into the thread's buffer and met by the chunk's rows (qw_run). Items run dynamic (a thread may lose its core to a
   neighbour), or, where every group has at most QW_FEW rows (decode), as one contiguous range per thread, so that
   qw_few's prefetch of the next 16 rows serves its own thread. Returns 0, -4 out of memory. */
static int qw_grouped(int type, const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
    const int64_t kb = k / 32, rows = starts[groups] - starts[0], panels = (n + QW_R - 1) / QW_R;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1)); /* each group's first item */
    int16_t *xc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(rows * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(rows * kb) + 64);
    int failed = !first || !xc || !xd, few = 1;
    if (!failed) {
        first[0] = 0;
        for (int64_t a = 0; a < groups; a++) {
            first[a + 1] = first[a] + (starts[a + 1] - starts[a] + QW_CHUNK - 1) / QW_CHUNK * panels;
            few &= starts[a + 1] - starts[a] <= QW_FEW;
        }
    }
    /* Q8_0 on the AMX-INT8 tiles: the codes' bytes packed (qa_pack), each group padded to a multiple of 16 rows */
    int64_t most = 0; /* the most rows of a group */
    for (int64_t a = 0; a < groups; a++) most = starts[a + 1] - starts[a] > most ? starts[a + 1] - starts[a] : most;
    const int amx = !failed && !few && qa_takes(type, most);
    int64_t *pstart = amx ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1)) : NULL;
    if (pstart) {
        pstart[0] = 0;
        for (int64_t a = 0; a < groups; a++) pstart[a + 1] = pstart[a] + (starts[a + 1] - starts[a] + 15) / 16 * 16;
    }
    const int64_t prows = pstart ? pstart[groups] : 0;
    int32_t *xbh = pstart ? (int32_t *)aligned_alloc(64, (size_t)(prows * k) + 64) : NULL;
    int32_t *xbl = pstart ? (int32_t *)aligned_alloc(64, (size_t)(prows * k) + 64) : NULL;
    float *xdt = pstart ? (float *)aligned_alloc(64, sizeof(float) * (size_t)(prows * kb) + 64) : NULL;
    failed |= amx && !(pstart && xbh && xbl && xdt);
    const qw_work q = {type, w, n, row_bytes, expert_stride, k, panels, ldy, experts, starts, first, xc, xd, y,
                       amx, pstart, xbh, xbl, xdt};
#pragma omp parallel num_threads(threads) if (!failed)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                qw_quantize_row(x + (starts[0] + i) * ldx, k, xc + i * k, xd + i * kb);
        }
        int tiles = 0; /* this thread loaded the tile shapes (qa_config) */
        (void)tiles;   /* read only in builds with the tiles */
#ifdef MLS_AMX
        if (!failed && amx) {
#pragma omp for schedule(static)
            for (int64_t g16 = 0; g16 < prows / 16; g16++) { /* each 16 padded rows: their group, rows, packing */
                int64_t a = 0;
                while (pstart[a + 1] <= 16 * g16) a++;
                const int64_t i = starts[a] - starts[0] + 16 * g16 - pstart[a], left = starts[a + 1] - starts[0] - i;
                qa_pack(xc + i * k, xd + i * kb, left < 16 ? left : 16, k, xbh + g16 * kb * 128, xbl + g16 * kb * 128,
                        xdt + g16 * kb * 16);
            }
            qa_config();
            tiles = 1;
        }
#endif
        /* the panel buffer, where an item has more than QW_FEW rows */
        void *mem = failed || few ? NULL : aligned_alloc(64, qw_panel_bytes(k));
        const int ready = !failed && (few || mem);
        if (!ready && !failed) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t items = first && xc && xd ? first[groups] : 0; /* the same count in every thread */
        int64_t a = 0;
        if (few) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                if (ready) qw_item(&q, it, &a, mem);
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t it = 0; it < items; it++)
                if (ready) qw_item(&q, it, &a, mem);
        }
#ifdef MLS_AMX
        if (tiles) _tile_release();
#endif
        free(mem);
    }
    free(first);
    free(xc);
    free(xd);
    free(pstart);
    free(xbh);
    free(xbl);
    free(xdt);
    return failed ? -4 : 0;
}
#endif

/* ---------------------------------------------------------------- the decode steps' int16 products
   The one-call decode layer and MoE block (decode_layer.c, moe/block.c) take these products where their activation
   setting has MLS_ACT_INT16 and a weight's type is one of the above that the setting's int8 cap leaves in fp32
   (under activations "int8_6bit_int16": Q8_0, Q5_0, MXFP4), as the per-op path does (kernels/int16_prefill.py
   takes_rest): the same kernels at every row count, so a request's result does not depend on its batch. */
#ifdef MLS_INT16_PREFILL
static inline int qw_in(int type, int64_t setting) {
    return (setting & MLS_ACT_INT16) && !q8rows_in(type, setting) && qw_type(type);
}

/* rows x [m, k] (row stride ldx) -> codes xc [m, k] and scales xd [m, k / 32] */
static inline void qw_quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int16_t *xc, float *xd) {
    for (int64_t i = 0; i < m; i++) qw_quantize_row(x + i * ldx, k, xc + i * k, xd + i * (k / 32));
}
#else /* no AVX512-VNNI: no type takes them, and these are never called */
#define QW_R 16
#define QW_FEW 3
static inline int qa_takes(int type, int64_t m) {
    (void)type, (void)m;
    return 0;
}
static inline int qw_in(int type, int64_t setting) {
    (void)type, (void)setting;
    return 0;
}
static inline size_t qw_panel_bytes(int64_t k) { return (size_t)k; }
static inline void qw_quantize_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int16_t *xc, float *xd) {
    (void)x, (void)m, (void)k, (void)ldx, (void)xc, (void)xd;
}
static inline void qw_run(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, const int16_t *xc,
                          const float *xd, int64_t m, int64_t k, float *y, int64_t ldy, void *panel) {
    (void)type, (void)w, (void)row_bytes, (void)nr, (void)xc, (void)xd, (void)m, (void)k, (void)y, (void)ldy;
    (void)panel;
}
#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) dequantize(W)^T for rows w [n] (row_bytes apart) of a
   32-value block type (qw_type), with int16 activations on AVX512-VNNI (above): 0, -1 a build without AVX512-VNNI,
   -2 k not a multiple of 32, -3 not such a type, -4 out of memory */
int mls_int16_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
                   int64_t row_bytes, float *y, int64_t ldy, int threads) {
#ifdef MLS_INT16_PREFILL
    if (k % 32) return -2;
    if (!qw_type(type)) return -3;
    if (m == 0 || n == 0) return 0;
    const int64_t expert = 0, starts[2] = {0, m};
    return qw_grouped(type, x, ldx, k, w, n, row_bytes, 0, &expert, starts, 1, y, ldy, threads);
#else
    (void)type, (void)x, (void)m, (void)k, (void)ldx, (void)w, (void)n, (void)row_bytes, (void)y, (void)ldy;
    (void)threads;
    return -1;
#endif
}

/* the grouped form (routed experts, heads): rows [starts[a], starts[a + 1]) of x [P, k] times expert experts[a]'s
   rows (w + experts[a] * expert_stride), into y [P, ldy]; codes as mls_int16_gemm */
int mls_int16_grouped(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
#ifdef MLS_INT16_PREFILL
    if (k % 32) return -2;
    if (!qw_type(type)) return -3;
    if (n == 0 || groups == 0) return 0;
    return qw_grouped(type, x, k, k, w, n, row_bytes, expert_stride, experts, starts, groups, y, ldy, threads);
#else
    (void)type, (void)x, (void)k, (void)w, (void)n, (void)row_bytes, (void)expert_stride, (void)experts;
    (void)starts, (void)groups, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* whether this build runs a type's products here: 1 yes, 0 no (not such a type, or no AVX512-VNNI) */
int mls_int16_takes(int type) {
#ifdef MLS_INT16_PREFILL
    return qw_type(type);
#else
    (void)type;
    return 0;
#endif
}

int mls_int16_in(int type, int64_t setting) { return qw_in(type, setting); }

int64_t mls_int16_tile_rows(int type) {
#if defined(MLS_INT16_PREFILL) && defined(MLS_AMX)
    return qa_takes(type, QA_MIN_ROWS) ? QA_MIN_ROWS : 0;
#else
    (void)type;
    return 0;
#endif
}

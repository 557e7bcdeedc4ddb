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

/* Rows [starts[a], starts[a + 1]) of x (row stride ldx) times expert experts[a]'s n rows (w + experts[a] *
   expert_stride, row_bytes apart) into y (row stride ldy). One parallel region: the activations quantized (rows
   split between the threads), then a work list of (group, chunk of QW_CHUNK rows, 16-row panel) items (dynamic: a
   thread may lose its core to a neighbour), each panel unpacked into the thread's buffer and met by the chunk's
   rows. Returns 0, -4 out of memory. */
static int qw_grouped(int type, const float *x, int64_t ldx, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                      int64_t expert_stride, const int64_t *experts, const int64_t *starts, int64_t groups, float *y,
                      int64_t ldy, int threads) {
    const int64_t kb = k / 32, rows = starts[groups] - starts[0], panels = (n + QW_R - 1) / QW_R;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(groups + 1)); /* each group's first item */
    int16_t *xc = (int16_t *)malloc(sizeof(int16_t) * (size_t)(rows * k) + 64);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(rows * kb) + 64);
    int failed = !first || !xc || !xd;
    if (!failed) {
        first[0] = 0;
        for (int64_t a = 0; a < groups; a++)
            first[a + 1] = first[a] + (starts[a + 1] - starts[a] + QW_CHUNK - 1) / QW_CHUNK * panels;
    }
#pragma omp parallel num_threads(threads) if (!failed)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++)
                qw_quantize_row(x + (starts[0] + i) * ldx, k, xc + i * k, xd + i * kb);
        }
        void *mem = failed ? NULL : aligned_alloc(64, (size_t)kb * 17 * 64);
        if (!mem && !failed) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t items = first && xc && xd ? first[groups] : 0; /* the same count in every thread */
        int64_t a = 0;
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            if (!mem) continue;
            while (first[a + 1] <= it) a++;
            while (first[a] > it) a--;
            const int64_t c = (it - first[a]) / panels, r0 = (it - first[a]) % panels * QW_R;
            const int64_t p0 = starts[a] + c * QW_CHUNK, left = starts[a + 1] - p0;
            const int64_t m = left < QW_CHUNK ? left : QW_CHUNK, nr = n - r0 < QW_R ? n - r0 : QW_R;
            __m512i *C = (__m512i *)mem;
            __m512 *D = (__m512 *)(C + kb * 16);
            const uint8_t *wr = w + experts[a] * expert_stride + r0 * row_bytes;
            switch (type) { /* each type's unpack specialised */
            case MLS_Q8_0: qw_unpack(MLS_Q8_0, wr, row_bytes, nr, k, C, D); break;
            case MLS_Q4_0: qw_unpack(MLS_Q4_0, wr, row_bytes, nr, k, C, D); break;
            case MLS_Q5_0: qw_unpack(MLS_Q5_0, wr, row_bytes, nr, k, C, D); break;
            case MLS_IQ4_NL: qw_unpack(MLS_IQ4_NL, wr, row_bytes, nr, k, C, D); break;
            default: qw_unpack(MLS_MXFP4, wr, row_bytes, nr, k, C, D); break;
            }
            const int64_t i0 = p0 - starts[0];
            qw_rows(C, D, xc + i0 * k, xd + i0 * kb, m, k, y + p0 * ldy + r0, ldy, nr);
        }
        free(mem);
    }
    free(first);
    free(xc);
    free(xd);
    return failed ? -4 : 0;
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

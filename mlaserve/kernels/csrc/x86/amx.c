/* ---------------------------------------------------------------- AMX-INT8 tiles: the K-quants' int8 products of many rows
   For the products int8.c runs with int8 activations (q8_K-style) on Q4_K and Q6_K weights, when a call has at least
   AMX_MIN_ROWS activation rows (batched decode of 16+ sequences, prefill). The CPU's tile unit multiplies a 16 x 64
   byte tile by a 16 x 64 byte tile into 16 x 16 int32 sums in one instruction, about 8x the int8 multiply-adds per
   cycle of a 512-bit vpdpbusd; each weight row is unpacked once per call for all activation rows.

   Notation (one pass: 16 weight rows r, 16 activation rows i; a "unit" = the values sharing one integer scale sc:
   Q4_K 32 (a sub-block, sc 0..63), Q6_K 16 (sc -128..127); codes q: Q4_K 0..15, Q6_K q - 32 in -32..31):
     sc = sum_p 8^p s_p   the scale in base-8 digits ("planes" p): Q4_K 2 digits 0..7, Q6_K 3 digits -3..4, so
                          that q * s_p fits the tiles' bytes (Q4_K <= 105 unsigned; Q6_K -128..124 signed)
     A_p [16, k]   int8   q * s_p of each value's unit (unpacked once per call; rows past n zero)
     B [k / 4, 64] int8   the activation rows' codes, 4 consecutive values of a row per int32 (the tiles' VNNI
                          layout, packed once per call; rows past m zero)
     C_p [16, 16]  int32  = sum over a super-block's 256 values of A_p B: 4 tile products of 64 values (TDPBUSD for
                          Q4_K, TDPBSSD for Q6_K), exact
     S = sum_p 8^p C_p = sum_units sc * (sum of q x over the unit), the VNNI kernel's integer sum (|S| < 2^28)
     Q4_K:  y[i, r] += (d_w[r] * d_x[i]) * S[r, i];  y[i, r] -= (dmin_w[r] * d_x[i]) * M[r, i]
            (M = sum_j mn[r, j] bsum[i, j]: the sub-block mins times the activation's code sums, int16 pairs, exact)
     Q6_K:  y[i, r] += (d_w[r] * d_x[i]) * S[r, i]
   The integer sums are exact and the float operations are x86/avx2.c's q8k_q45_mr / q8k_q6k_mr's (and
   ref/int8.c's), in the same order per row, so each y comes out bit for bit as theirs.

   Linux hands the tile registers to a process only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
   amx_permission asks once and keeps the answer (mls_int8_tiles reports it for the kernel plan). Each thread loads
   the tile configuration before its first tile instruction and releases the tiles when done. */
#if defined(MLS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define MLS_AMX 1
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16     /* a tile's rows: weight rows per pass; also the activation rows (C's 16 int32 columns) */
#define AMX_MIN_ROWS 16 /* activation rows from which a product takes the tiles (fewer leave most of B empty) */
#define AMX_PLANES 3    /* most scale digits (Q6_K) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 the process may use the tiles, -errno the kernel refused them (asked once; a repeated ask is harmless) */
static int amx_permission(void) {
    static int state;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -(errno ? errno : EPERM);
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* the types of x86/amx_units.c (one integer scale per 32 or 16 values that no byte plane holds): amx_gemm hands them on */
static inline int amx_unit_type(int type) {
    return type == MLS_IQ4_XS || type == MLS_IQ2_XXS || type == MLS_IQ3_XXS || type == MLS_IQ3_S || type == MLS_IQ1_S ||
           type == MLS_Q5_K || type == MLS_IQ2_XS || type == MLS_IQ2_S || type == MLS_IQ1_M;
}
static int amx_unit_gemm(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd,
                         int64_t m, int64_t k, float *y, int64_t ldy, int threads);

static inline int amx_type(int type) { return type == MLS_Q4_K || type == MLS_Q6_K || amx_unit_type(type); }

/* whether a product of m activation rows on this type runs on the tiles */
static inline int amx_takes(int type, int64_t m) { return amx_type(type) && m >= AMX_MIN_ROWS && amx_permission() == 1; }

typedef struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* tiles 0..2: C_p; 3: B; 4..6: A_p; each 16 rows of 64 bytes */
static void amx_configure(void) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = AMX_ROWS;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* One block of up to 16 weight rows, unpacked: the planes A_p, per super-block d_w (and Q4_K's dmin_w and its 8
   integer mins as 4 int16 pairs) */
typedef struct {
    int8_t *a;    /* [planes, 16, k] */
    int32_t *mn;  /* [16, k / 256 * 4] (Q4_K): mins 2j | 2j + 1 << 16 */
    float *d;     /* [16, k / 256] */
    float *dmin;  /* [16, k / 256] (Q4_K) */
} amx_rows_t;

static inline int amx_planes(int type) { return type == MLS_Q6_K ? 3 : 2; }

/* sc -> its base-8 digits: Q4_K (0..63) 0..7 each; Q6_K (-128..127) -3..4 each (the residue mod 8 in -3..4) */
static inline void amx_digits(int32_t sc, int q6, int8_t s[AMX_PLANES]) {
    for (int p = 0; p < AMX_PLANES; p++) {
        const int32_t dgt = q6 ? ((sc + 3) & 7) - 3 : sc & 7;
        s[p] = (int8_t)dgt;
        sc = (sc - dgt) / 8;
    }
}

/* a unit's u codes (int8 lanes of v, u = 32: all; u = 16: half h of v) times its scale's digits into the planes */
static inline void amx_put(int8_t *a, int64_t plane, const __m256i codes, const int8_t s[AMX_PLANES], int planes) {
    for (int p = 0; p < planes; p++) {
        /* q * s_p in int16 (exact, |.| <= 128), back to bytes (within int8 by the digits' range) */
        const __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes)), _mm256_set1_epi16(s[p]));
        const __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1)), _mm256_set1_epi16(s[p]));
        const __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8);
        _mm256_storeu_si256((__m256i *)(a + p * plane), v);
    }
}

static void amx_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, amx_rows_t *o) {
    const int64_t kb = k / 256, plane = AMX_ROWS * k;
    const int q6 = type == MLS_Q6_K, planes = amx_planes(type);
    memset(o->a, 0, (size_t)(planes * plane));
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *b = w + r * row_bytes;
        int8_t *a = o->a + r * k;
        for (int64_t blk = 0; blk < kb; blk++) {
            int8_t s[AMX_PLANES];
            if (!q6) {
                const uint8_t *q = b + blk * 144;
                int32_t sc[8], mn[8];
                k_scales_int(q + 4, sc, mn);
                for (int j = 0; j < 4; j++) o->mn[r * kb * 4 + blk * 4 + j] = (mn[2 * j] & 0xFFFF) | (mn[2 * j + 1] << 16);
                o->d[r * kb + blk] = f16(q);
                o->dmin[r * kb + blk] = f16(q + 2);
                const __m256i m4 = _mm256_set1_epi8(0x0F);
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
                    amx_digits(sc[2 * c], 0, s);
                    amx_put(a + blk * 256 + 64 * c, plane, _mm256_and_si256(raw, m4), s, 2);
                    amx_digits(sc[2 * c + 1], 0, s);
                    amx_put(a + blk * 256 + 64 * c + 32, plane, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), s, 2);
                }
            } else {
                const uint8_t *q = b + blk * 210;
                const int8_t *sc = (const int8_t *)(q + 192);
                o->d[r * kb + blk] = f16(q + 208);
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
                            _mm256_storeu_si256((__m256i *)(a + p * plane + blk * 256 + t), v);
                        }
                    }
                }
            }
        }
    }
}

/* Activation rows [0, mr) (mr <= 16) in the tiles' layout: xp [k / 4, 16] int32 (4 codes of a row each), dx
   [k / 256, 16] their scales, bsum [k / 256 * 4, 16] their per-32 code sums as int16 pairs (Q4_K); rows past mr zero */
static void amx_pack(const int8_t *xq, const float *xd, int64_t mr, int64_t k, int32_t *xp, float *dx, int32_t *bsum) {
    const int64_t kb = k / 256, slots = k / 32;
    memset(xp, 0, sizeof(int32_t) * (size_t)(k / 4 * AMX_ROWS));
    memset(dx, 0, sizeof(float) * (size_t)(kb * AMX_ROWS));
    memset(bsum, 0, sizeof(int32_t) * (size_t)(kb * 4 * AMX_ROWS));
    for (int64_t i = 0; i < mr; i++) {
        const int8_t *row = xq + i * k;
        for (int64_t c = 0; c < k / 4; c++) memcpy(xp + c * AMX_ROWS + i, row + 4 * c, 4);
        for (int64_t blk = 0; blk < kb; blk++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            dx[blk * AMX_ROWS + i] = meta->d;
            for (int j = 0; j < 4; j++)
                bsum[(blk * 4 + j) * AMX_ROWS + i] = (meta->bsum[2 * j] & 0xFFFF) | ((int32_t)meta->bsum[2 * j + 1] << 16);
        }
    }
}

/* One super-block blk of 16 unpacked weight rows times 16 packed activation rows, added to acc [16 weight rows, 16
   activation rows] (the rows' running sums over the super-blocks before blk, in their order) */
static void amx_superblock(int type, const amx_rows_t *W, int64_t blk, const int32_t *xp, const float *dx,
                           const int32_t *bsum, int64_t k, float *acc) {
    const int q6 = type == MLS_Q6_K;
    const int64_t kb = k / 256, plane = AMX_ROWS * k;
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
    const __m512 d_x = _mm512_loadu_ps(dx + blk * AMX_ROWS);
    for (int r = 0; r < AMX_ROWS; r++) {
        __m512i S = _mm512_add_epi32(_mm512_load_si512(cbuf[0] + 16 * r), _mm512_slli_epi32(_mm512_load_si512(cbuf[1] + 16 * r), 3));
        if (q6) S = _mm512_add_epi32(S, _mm512_slli_epi32(_mm512_load_si512(cbuf[2] + 16 * r), 6));
        __m512 y = _mm512_load_ps(acc + 16 * r);
        y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->d[r * kb + blk]), d_x), _mm512_cvtepi32_ps(S)));
        if (!q6) {
            const int32_t *mn = W->mn + r * kb * 4 + blk * 4;
            __m512i M = _mm512_madd_epi16(_mm512_set1_epi32(mn[0]), _mm512_loadu_si512(bsum + blk * 4 * AMX_ROWS));
            for (int j = 1; j < 4; j++)
                M = _mm512_add_epi32(M, _mm512_madd_epi16(_mm512_set1_epi32(mn[j]), _mm512_loadu_si512(bsum + (blk * 4 + j) * AMX_ROWS)));
            y = _mm512_sub_ps(y, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->dmin[r * kb + blk]), d_x), _mm512_cvtepi32_ps(M)));
        }
        _mm512_store_ps(acc + 16 * r, y);
    }
}

/* y [m, n] (row stride ldy) = X W^T for quantized activations xq [m, k] / xd and weight rows w [n] (row_bytes
   apart), on the tiles. Returns 0, -4 when memory runs out. */
static int amx_gemm(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd,
                    int64_t m, int64_t k, float *y, int64_t ldy, int threads) {
    if (amx_unit_type(type)) return amx_unit_gemm(type, w, n, row_bytes, xq, xd, m, k, y, ldy, threads);
    const int64_t groups = (m + AMX_ROWS - 1) / AMX_ROWS, blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t kb = k / 256, slots = k / 32;
    const size_t xp_n = (size_t)(k / 4 * AMX_ROWS), dx_n = (size_t)(kb * AMX_ROWS), bs_n = (size_t)(kb * 4 * AMX_ROWS);
    const size_t per_group = xp_n + dx_n + bs_n; /* int32 / float slots */
    char *packed = (char *)aligned_alloc(64, ((size_t)groups * per_group * 4 + 63) / 64 * 64);
    if (!packed) return -4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        int32_t *xp = (int32_t *)packed + g * per_group;
        const int64_t mr = m - g * AMX_ROWS < AMX_ROWS ? m - g * AMX_ROWS : AMX_ROWS;
        amx_pack(xq + g * AMX_ROWS * k, xd + g * AMX_ROWS * slots, mr, k, xp, (float *)(xp + xp_n), xp + xp_n + dx_n);
    }
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        const size_t bytes = sizeof(float) * AMX_ROWS * 16 * (size_t)groups + (size_t)(AMX_PLANES * AMX_ROWS * k) +
                             sizeof(int32_t) * (size_t)(AMX_ROWS * kb * 4) + 2 * sizeof(float) * (size_t)(AMX_ROWS * kb);
        char *mem = (char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!mem) {
#pragma omp atomic write
            rc = -4;
        }
        amx_rows_t W;
        float *acc = (float *)mem;
        if (mem) {
            W.a = (int8_t *)(acc + AMX_ROWS * 16 * groups);
            W.mn = (int32_t *)(W.a + AMX_PLANES * AMX_ROWS * k);
            W.d = (float *)(W.mn + AMX_ROWS * kb * 4);
            W.dmin = W.d + AMX_ROWS * kb;
            amx_configure();
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t bi = 0; bi < blocks; bi++) {
            if (!mem) continue;
            const int64_t r0 = bi * AMX_ROWS, nr = n - r0 < AMX_ROWS ? n - r0 : AMX_ROWS;
            amx_unpack(type, w + r0 * row_bytes, row_bytes, nr, k, &W);
            memset(acc, 0, sizeof(float) * AMX_ROWS * 16 * (size_t)groups);
            /* super-blocks outside, activation groups inside: a super-block's planes (16 rows x 256 values each) stay
               in L1 while every group's activations stream past them */
            for (int64_t blk = 0; blk < kb; blk++)
                for (int64_t g = 0; g < groups; g++) {
                    const int32_t *xp = (const int32_t *)packed + g * per_group;
                    amx_superblock(type, &W, blk, xp, (const float *)(xp + xp_n), xp + xp_n + dx_n, k, acc + g * AMX_ROWS * 16);
                }
            for (int64_t g = 0; g < groups; g++) {
                const int64_t i0 = g * AMX_ROWS, mr = m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS;
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t i = 0; i < mr; i++) y[(i0 + i) * ldy + r0 + r] = acc[g * AMX_ROWS * 16 + 16 * r + i];
            }
        }
        if (mem) _tile_release();
        free(mem);
    }
    free(packed);
    return rc;
}
#endif

/* whether this build has the tiles and the process may use them: 1 yes, 0 a build without AMX-INT8 (or not on
   Linux), -errno the kernel refused the tile state */
int mls_int8_tiles(void) {
#ifdef MLS_AMX
    return amx_permission();
#else
    return 0;
#endif
}

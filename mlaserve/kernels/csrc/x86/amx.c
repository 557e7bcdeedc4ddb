/* ---------------------------------------------------------------- AMX-INT8 tiles: the K-quants' int8 products of many rows
   For the products int8.c runs with int8 activations (q8_K-style) on Q4_K and Q6_K weights, when a call has at least
   AMX_MIN_ROWS activation rows (batched decode of 16+ sequences, prefill). The CPU's tile unit multiplies a 16 x 64
   byte tile by a 16 x 64 byte tile into 16 x 16 int32 sums in one instruction, about 8x the int8 multiply-adds per
   cycle of a 512-bit vpdpbusd; each weight row is unpacked to int8 codes once per call for all activation rows.

   Notation (one pass: 16 weight rows r, 16 activation rows i; a "unit" = the u values sharing one integer scale:
   Q4_K u = 32 (a sub-block), Q6_K u = 16):
     A [16, u]      int8  the weight rows' codes of one unit (Q4_K: 0..15, unsigned; Q6_K: q - 32, signed), from
                          codes [16, k] (unpacked once per call, rows past n zero)
     B [u / 4, 64]  int8  the activation rows' codes of the unit, 4 consecutive values of a row per int32 (the
                          tiles' VNNI layout: xp [k / 4, 16] int32, packed once per call, rows past m zero)
     C [16, 16]     int32 = A B exactly (TDPBUSD for Q4_K, TDPBSSD for Q6_K)
     S [16, 16]     int32 = sum over the super-block's units of sc[r, unit] * C (|S| < 2^28, as the VNNI kernel)
     Q4_K:  y[i, r] += (d_w[r] * d_x[i]) * S[r, i];  y[i, r] -= (dmin_w[r] * d_x[i]) * M[r, i]
            (M = sum_j mn[r, j] bsum[i, j], the sub-block mins times the activation's code sums, in int32)
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

static inline int amx_type(int type) { return type == MLS_Q4_K || type == MLS_Q6_K; }

/* whether a product of m activation rows on this type runs on the tiles */
static inline int amx_takes(int type, int64_t m) { return amx_type(type) && m >= AMX_MIN_ROWS && amx_permission() == 1; }

typedef struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* tiles 0, 1: C; 2, 3: A (16 rows of u bytes); 4, 5: B (u / 4 rows of 64 bytes): two units in flight */
static void amx_configure(int unit) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t >= 4 ? (uint8_t)(unit / 4) : AMX_ROWS;
        c.colsb[t] = t == 2 || t == 3 ? (uint16_t)unit : 64;
    }
    _tile_loadconfig(&c);
}

/* One block of up to 16 weight rows, unpacked: codes [16, k], per unit its integer scale, per super-block d_w
   (and Q4_K's dmin_w and its 8 integer mins) */
typedef struct {
    uint8_t *codes;
    int32_t *sc;  /* [16, k / unit] */
    int32_t *mn;  /* [16, k / 32] (Q4_K) */
    float *d;     /* [16, k / 256] */
    float *dmin;  /* [16, k / 256] (Q4_K) */
} amx_rows_t;

static void amx_unpack(int type, const uint8_t *w, int64_t row_bytes, int64_t nr, int64_t k, amx_rows_t *o) {
    const int64_t kb = k / 256, units = type == MLS_Q6_K ? k / 16 : k / 32;
    memset(o->codes, 0, (size_t)(AMX_ROWS * k));
    memset(o->sc, 0, sizeof(int32_t) * (size_t)(AMX_ROWS * units));
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *b = w + r * row_bytes;
        uint8_t *codes = o->codes + r * k;
        for (int64_t blk = 0; blk < kb; blk++) {
            if (type == MLS_Q4_K) {
                const uint8_t *q = b + blk * 144;
                k_scales_int(q + 4, o->sc + r * units + blk * 8, o->mn + r * (k / 32) + blk * 8);
                o->d[r * kb + blk] = f16(q);
                o->dmin[r * kb + blk] = f16(q + 2);
                for (int c = 0; c < 4; c++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
                    const __m256i m4 = _mm256_set1_epi8(0x0F);
                    _mm256_storeu_si256((__m256i *)(codes + blk * 256 + 64 * c), _mm256_and_si256(raw, m4));
                    _mm256_storeu_si256((__m256i *)(codes + blk * 256 + 64 * c + 32),
                                        _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
                }
            } else {
                const uint8_t *q = b + blk * 210;
                for (int u = 0; u < 16; u++) o->sc[r * units + blk * 16 + u] = ((const int8_t *)(q + 192))[u];
                o->d[r * kb + blk] = f16(q + 208);
                for (int h = 0; h < 2; h++) {
                    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
                    const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
                    for (int g = 0; g < 4; g++)
                        _mm256_storeu_si256((__m256i *)(codes + blk * 256 + 128 * h + 32 * g), q6k_codes(ql0, ql1, qh, g));
                }
            }
        }
    }
}

/* Activation rows [i0, i0 + mr) (mr <= 16) in the tiles' layout: xp [k / 4, 16] int32 (4 codes of a row each),
   dx [k / 256, 16] their scales, bsum [k / 32, 16] their per-32 code sums (Q4_K); rows past mr zero */
static void amx_pack(const int8_t *xq, const float *xd, int64_t mr, int64_t k, int32_t *xp, float *dx, int32_t *bsum) {
    const int64_t kb = k / 256, slots = k / 32;
    memset(xp, 0, sizeof(int32_t) * (size_t)(k / 4 * AMX_ROWS));
    memset(dx, 0, sizeof(float) * (size_t)(kb * AMX_ROWS));
    memset(bsum, 0, sizeof(int32_t) * (size_t)(slots * AMX_ROWS));
    for (int64_t i = 0; i < mr; i++) {
        const int8_t *row = xq + i * k;
        for (int64_t c = 0; c < k / 4; c++) memcpy(xp + c * AMX_ROWS + i, row + 4 * c, 4);
        for (int64_t blk = 0; blk < kb; blk++) {
            const q8k_meta *meta = (const q8k_meta *)(xd + i * slots + blk * Q8K_SLOTS);
            dx[blk * AMX_ROWS + i] = meta->d;
            for (int j = 0; j < 8; j++) bsum[(blk * 8 + j) * AMX_ROWS + i] = meta->bsum[j];
        }
    }
}

/* S[r] += sc[r] * C[r] for the 16 rows of a stored C tile */
static inline void amx_scale_add(__m512i S[AMX_ROWS], const int32_t *cbuf, const int32_t *sc, int64_t units) {
    for (int r = 0; r < AMX_ROWS; r++)
        S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(_mm512_load_si512(cbuf + 16 * r), _mm512_set1_epi32(sc[r * units])));
}

/* One pass: 16 unpacked weight rows x 16 packed activation rows -> acc [16 weight rows, 16 activation rows] */
static void amx_pass(int type, const amx_rows_t *W, const int32_t *xp, const float *dx, const int32_t *bsum, int64_t k,
                     float *acc) {
    const int q6 = type == MLS_Q6_K;
    const int64_t unit = q6 ? 16 : 32, per = 256 / unit, units = k / unit, kb = k / 256;
    int32_t cbuf[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    __m512 y[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) y[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < kb; blk++) {
        __m512i S[AMX_ROWS];
        for (int r = 0; r < AMX_ROWS; r++) S[r] = _mm512_setzero_si512();
        for (int64_t u = blk * per; u < (blk + 1) * per; u += 2) {
            const int64_t c0 = u * unit, c1 = c0 + unit;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(2, W->codes + c0, k);
            _tile_loadd(4, xp + c0 / 4 * AMX_ROWS, 64);
            _tile_loadd(3, W->codes + c1, k);
            _tile_loadd(5, xp + c1 / 4 * AMX_ROWS, 64);
            if (q6) {
                _tile_dpbssd(0, 2, 4);
                _tile_dpbssd(1, 3, 5);
            } else {
                _tile_dpbusd(0, 2, 4);
                _tile_dpbusd(1, 3, 5);
            }
            _tile_stored(0, cbuf[0], 64);
            _tile_stored(1, cbuf[1], 64);
            amx_scale_add(S, cbuf[0], W->sc + u, units);
            amx_scale_add(S, cbuf[1], W->sc + u + 1, units);
        }
        const __m512 d_x = _mm512_loadu_ps(dx + blk * AMX_ROWS);
        for (int r = 0; r < AMX_ROWS; r++) {
            y[r] = _mm512_add_ps(y[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->d[r * kb + blk]), d_x),
                                                     _mm512_cvtepi32_ps(S[r])));
            if (!q6) {
                const int32_t *mn = W->mn + r * (k / 32) + blk * 8;
                __m512i M = _mm512_setzero_si512();
                for (int j = 0; j < 8; j++)
                    M = _mm512_add_epi32(M, _mm512_mullo_epi32(_mm512_set1_epi32(mn[j]),
                                                               _mm512_loadu_si512(bsum + (blk * 8 + j) * AMX_ROWS)));
                y[r] = _mm512_sub_ps(y[r], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(W->dmin[r * kb + blk]), d_x),
                                                         _mm512_cvtepi32_ps(M)));
            }
        }
    }
    for (int r = 0; r < AMX_ROWS; r++) _mm512_storeu_ps(acc + 16 * r, y[r]);
}

/* y [m, n] (row stride ldy) = X W^T for quantized activations xq [m, k] / xd and weight rows w [n] (row_bytes
   apart), on the tiles. Returns 0, -4 when memory runs out. */
static int amx_gemm(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const int8_t *xq, const float *xd,
                    int64_t m, int64_t k, float *y, int64_t ldy, int threads) {
    const int64_t groups = (m + AMX_ROWS - 1) / AMX_ROWS, blocks = (n + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t kb = k / 256, slots = k / 32, unit = type == MLS_Q6_K ? 16 : 32;
    const size_t xp_n = (size_t)(k / 4 * AMX_ROWS), dx_n = (size_t)(kb * AMX_ROWS), bs_n = (size_t)(slots * AMX_ROWS);
    char *packed = (char *)aligned_alloc(64, ((size_t)groups * (xp_n + dx_n + bs_n) * 4 + 63) / 64 * 64);
    if (!packed) return -4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        int32_t *xp = (int32_t *)packed + g * (xp_n + dx_n + bs_n);
        const int64_t mr = m - g * AMX_ROWS < AMX_ROWS ? m - g * AMX_ROWS : AMX_ROWS;
        amx_pack(xq + g * AMX_ROWS * k, xd + g * AMX_ROWS * slots, mr, k, xp, (float *)(xp + xp_n), xp + xp_n + dx_n);
    }
    int rc = 0;
#pragma omp parallel num_threads(threads)
    {
        const size_t units = (size_t)(k / unit);
        char *mem = (char *)aligned_alloc(64, ((size_t)AMX_ROWS * ((size_t)k + 4 * units + 4 * (size_t)slots + 8 * (size_t)kb) +
                                              sizeof(float) * AMX_ROWS * 16 + 63) / 64 * 64);
        if (!mem) {
#pragma omp atomic write
            rc = -4;
        }
        amx_rows_t W;
        float *acc = (float *)mem;
        if (mem) {
            W.codes = (uint8_t *)(acc + AMX_ROWS * 16);
            W.sc = (int32_t *)(W.codes + AMX_ROWS * k);
            W.mn = W.sc + AMX_ROWS * units;
            W.d = (float *)(W.mn + AMX_ROWS * slots);
            W.dmin = W.d + AMX_ROWS * kb;
            amx_configure((int)unit);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t bi = 0; bi < blocks; bi++) {
            if (!mem) continue;
            const int64_t r0 = bi * AMX_ROWS, nr = n - r0 < AMX_ROWS ? n - r0 : AMX_ROWS;
            amx_unpack(type, w + r0 * row_bytes, row_bytes, nr, k, &W);
            for (int64_t g = 0; g < groups; g++) {
                const int32_t *xp = (const int32_t *)packed + g * (xp_n + dx_n + bs_n);
                const int64_t i0 = g * AMX_ROWS, mr = m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS;
                amx_pass(type, &W, xp, (const float *)(xp + xp_n), xp + xp_n + dx_n, k, acc);
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t i = 0; i < mr; i++) y[(i0 + i) * ldy + r0 + r] = acc[16 * r + i];
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

/* The reference decoders: one row of K values from its stored blocks, with exactly the float operations of
   the Python dequantizers (mlaserve/gguf/quants.py, mlaserve/quant/fp8_block.py, fp4_group.py), in the same
   order, so the decoded values are bit-identical. Every ISA file's decoders are held to these, and the type
   table (types.c) takes them where the build has no ISA decoder (hence "unused" in the other builds). */

__attribute__((unused)) static void row_q8_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 34, y += 32) {
        const float d = f16(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
    }
}

__attribute__((unused)) static void row_q4_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 18, y += 32) {
        const float d = f16(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((q[j] & 0x0F) - 8);
            y[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

/* MXFP4 (gguf/quants.py _mxfp4): ggml's doubled e2m1 values times the halved e8m0 scale, low nibbles first */
static const int8_t MXFP4_KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

__attribute__((unused)) static void row_mxfp4(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 17, y += 32) {
        const float d = e8m0_half(b[0]);
        const uint8_t *q = b + 1;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)MXFP4_KVALUES[q[j] & 0x0F];
            y[j + 16] = d * (float)MXFP4_KVALUES[q[j] >> 4];
        }
    }
}

__attribute__((unused)) static void row_q4_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 20, y += 32) {
        const float d = f16(b), m = f16(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(q[j] & 0x0F) + m;
            y[j + 16] = d * (float)(q[j] >> 4) + m;
        }
    }
}


__attribute__((unused)) static void row_q5_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 22, y += 32) {
        const float d = f16(b);
        const uint32_t qh = u32(b + 2);
        const uint8_t *q = b + 6;
        for (int j = 0; j < 16; j++) {
            int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
            int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

__attribute__((unused)) static void row_q5_1(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 24, y += 32) {
        const float d = f16(b), m = f16(b + 2);
        const uint32_t qh = u32(b + 4);
        const uint8_t *q = b + 8;
        for (int j = 0; j < 16; j++) {
            int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
            int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

__attribute__((unused)) static void row_q2_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 84, y += 256) {
        const uint8_t *sc = b, *qs = b + 16;
        const float d = f16(b + 80), dmin = f16(b + 82);
        float dl[16], ml[16];
        for (int j = 0; j < 16; j++) {
            dl[j] = d * (float)(sc[j] & 0x0F);
            ml[j] = dmin * (float)(sc[j] >> 4);
        }
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, s = (t >> 5) & 3, l = t & 31;
            int q = (qs[h * 32 + l] >> (2 * s)) & 3;
            y[t] = dl[t >> 4] * (float)q - ml[t >> 4];
        }
    }
}

__attribute__((unused)) static void row_q3_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 110, y += 256) {
        const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
        const float d = f16(b + 108);
        float dl[16];
        for (int j = 0; j < 16; j++) {
            int lo = (sc[j & 7] >> (4 * (j >> 3))) & 0x0F;
            int hi = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
            dl[j] = d * (float)((lo | (hi << 4)) - 32);
        }
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, s = (t >> 5) & 3, l = t & 31;
            int ql = (qs[h * 32 + l] >> (2 * s)) & 3;
            int qh = (hm[l] >> (t >> 5)) & 1;
            y[t] = dl[t >> 4] * (float)(ql - ((qh ^ 1) << 2));
        }
    }
}

/* Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes (ggml get_scale_min_k4) */
static void k_scale_min(const uint8_t *s, float d, float dmin, float *dd, float *dm) {
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
            mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        }
        dd[j] = d * (float)sc;
        dm[j] = dmin * (float)mn;
    }
}

/* the same 6-bit scales and mins as integers (the int8-activation kernels apply them to integer sums) */
static inline void k_scales_int(const uint8_t *s, int32_t sc[8], int32_t mn[8]) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        }
    }
}

__attribute__((unused)) static void row_q4_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 144, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                for (int l = 0; l < 32; l++)
                    y[j * 32 + l] = dd[j] * (float)((qs[c * 32 + l] >> (4 * h)) & 0x0F) - dm[j];
            }
    }
}

__attribute__((unused)) static void row_q5_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 176, y += 256) {
        float dd[8], dm[8];
        k_scale_min(b + 4, f16(b), f16(b + 2), dd, dm);
        const uint8_t *qh = b + 16, *ql = b + 48;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                for (int l = 0; l < 32; l++) {
                    int q = ((ql[c * 32 + l] >> (4 * h)) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                    y[j * 32 + l] = dd[j] * (float)q - dm[j];
                }
            }
    }
}

__attribute__((unused)) static void row_q6_k(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        float dd[16];
        for (int j = 0; j < 16; j++) dd[j] = d * (float)sc[j];
        for (int t = 0; t < 256; t++) {
            int h = t >> 7, r = t & 127;
            int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0F;
            int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
            y[t] = dd[t >> 4] * (float)((lo | (hi << 4)) - 32);
        }
    }
}

/* float8 e4m3fn -> fp32, every code (exact) */
static float E4M3[256];
static int e4m3_ready = 0;

static void e4m3_init(void) {
    for (int c = 0; c < 256; c++) {
        int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
        float v;
        if (e == 15 && m == 7) {
            uint32_t nan = 0x7fc00000u;
            memcpy(&v, &nan, 4);
        } else if (e == 0) {
            v = (float)m / 512.0f; /* m * 2^-9 */
        } else {
            v = (1.0f + (float)m / 8.0f);
            for (int x = e; x > 7; x--) v *= 2.0f;
            for (int x = e; x < 7; x++) v *= 0.5f;
        }
        E4M3[c] = s ? -v : v;
    }
    e4m3_ready = 1;
}

/* one fp8 row: scale row srow [kb] with blocks of bk columns */
__attribute__((unused)) static void row_fp8(const uint8_t *q, const float *srow, int64_t bk, float *y, int64_t k) {
    for (int64_t c0 = 0, blk = 0; c0 < k; c0 += bk, blk++) {
        const float s = srow[blk];
        const int64_t c1 = c0 + bk < k ? c0 + bk : k;
        for (int64_t c = c0; c < c1; c++) y[c] = E4M3[q[c]] * s;
    }
}


/* e2m1 codes -> values (mlaserve/quant/fp4_group.py E2M1_VALUES) times the row's group scales:
   value * scale, one rounding, as the reference's table lookup times the expanded scale */
static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__attribute__((unused)) static void row_e2m1(const uint8_t *q, const float *srow, int64_t group, float *y, int64_t k) {
    for (int64_t c = 0; c < k / 2; c++) {
        const uint8_t b = q[c];
        y[2 * c] = E2M1[b & 15] * srow[(2 * c) / group];
        y[2 * c + 1] = E2M1[b >> 4] * srow[(2 * c + 1) / group];
    }
}

/* compressed-tensors' pack-quantized INT4 (mlaserve/quant/int4_group.py): the int32 words read as their
   little-endian bytes hold the columns in order, two per byte (low nibble first), each stored as q + 8; the
   value is q * the row's group scale, one rounding, as the reference's unpack times the expanded scale */
__attribute__((unused)) static void row_int4(const uint8_t *q, const float *srow, int64_t group, float *y, int64_t k) {
    for (int64_t c = 0; c < k / 2; c++) {
        const uint8_t b = q[c];
        y[2 * c] = (float)((int)(b & 15) - 8) * srow[(2 * c) / group];
        y[2 * c + 1] = (float)((int)(b >> 4) - 8) * srow[(2 * c + 1) / group];
    }
}

/* The INT4 decode-and-dot without SIMD: per 32 values the codes (exact small integers) dotted with each
   activation row, then the group's scale applied to that partial sum (as the SIMD kernels do, x86/avx2.c
   fused_int4); rows in chunks of INT4_REF_ROWS so the accumulators are a fixed array. group % 32 == 0. */
#define INT4_REF_ROWS 8
__attribute__((unused)) static void ref_fused_int4(const uint8_t *b, const float *srow, int64_t group,
                                                   const float *x, int64_t ldx, int64_t m, int64_t k, float *y,
                                                   int64_t ldy) {
    for (int64_t i0 = 0; i0 < m; i0 += INT4_REF_ROWS) {
        const int64_t mr = m - i0 < INT4_REF_ROWS ? m - i0 : INT4_REF_ROWS;
        float acc[INT4_REF_ROWS] = {0};
        for (int64_t c0 = 0; c0 < k; c0 += 32) {
            float w[32];
            for (int j = 0; j < 16; j++) {
                const uint8_t v = b[c0 / 2 + j];
                w[2 * j] = (float)((int)(v & 15) - 8);
                w[2 * j + 1] = (float)((int)(v >> 4) - 8);
            }
            const float d = srow[c0 / group];
            for (int64_t i = 0; i < mr; i++) {
                const float *xi = x + (i0 + i) * ldx + c0;
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += w[j] * xi[j];
                acc[i] += d * s;
            }
        }
        for (int64_t i = 0; i < mr; i++) y[(i0 + i) * ldy] = acc[i];
    }
}

/* F32 rows (ggml type 0: small matrices a GGUF keeps unquantized), for the one-call layers: the row as it is */
static void row_f32(const uint8_t *b, float *y, int64_t k) { memcpy(y, b, sizeof(float) * (size_t)k); }

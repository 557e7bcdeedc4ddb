/* The i-quant and ternary reference decoders (IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
   IQ1_M, TQ1_0, TQ2_0): one row of K values from its blocks, with exactly the float operations of
   mlaserve/gguf/quants.py's dequantizers (gguf-py's), in the same order, so the values are bit-identical.
   Block layouts (ggml-common.h; byte offsets): see quants.py. A grid entry's byte j is its value j; a sign bit j
   set negates value j; (d * s) is formed first, then times the value (grid value, then sign: exact). */

#include "iq_grids.h"

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define IQ1_DELTA 0.125f

/* ggml's ksigns_iq2xs[i]: the 7 stored sign bits i and their parity as bit 7 (an even number of minus signs) */
static inline uint8_t ksigns(uint32_t i) { return (uint8_t)(i | ((uint32_t)(__builtin_popcount(i) & 1) << 7)); }

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* 8 grid values (bytes of one uint64 entry, read as unsigned) times db, with the 8 sign bits */
static inline void grid8(float db, uint64_t entry, uint8_t signs, float *y) {
    for (int j = 0; j < 8; j++) {
        const float v = db * (float)(uint8_t)(entry >> (8 * j));
        y[j] = (signs >> j) & 1 ? -v : v;
    }
}

/* 4 + 4 grid values of two uint32 entries (the IQ3 grids) */
static inline void grid4x2(float db, uint32_t e1, uint32_t e2, uint8_t signs, float *y) {
    for (int j = 0; j < 4; j++) {
        const float v1 = db * (float)(uint8_t)(e1 >> (8 * j)), v2 = db * (float)(uint8_t)(e2 >> (8 * j));
        y[j] = (signs >> j) & 1 ? -v1 : v1;
        y[j + 4] = (signs >> (j + 4)) & 1 ? -v2 : v2;
    }
}

__attribute__((unused)) static void row_iq4_nl(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 32; i++, b += 18, y += 32) {
        const float d = f16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)IQ4NL_VALUES[b[2 + j] & 0x0F];
            y[j + 16] = d * (float)IQ4NL_VALUES[b[2 + j] >> 4];
        }
    }
}

__attribute__((unused)) static void row_iq4_xs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 136) {
        const float d = f16(b);
        const uint16_t sh = u16(b + 2);
        for (int ib = 0; ib < 8; ib++, y += 32) {
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            const uint8_t *q = b + 8 + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * (float)IQ4NL_VALUES[q[j] & 0x0F];
                y[j + 16] = dl * (float)IQ4NL_VALUES[q[j] >> 4];
            }
        }
    }
}

__attribute__((unused)) static void row_iq2_xxs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 66) {
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = u32(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++, y += 8) grid8(db, IQ2XXS_GRID[q[l]], ksigns((aux >> (7 * l)) & 127), y);
        }
    }
}

__attribute__((unused)) static void row_iq2_xs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 74) {
        const float d = f16(b);
        for (int g = 0; g < 32; g++, y += 8) {
            const uint16_t q = u16(b + 2 + 2 * g);
            const int s = (b[66 + g / 4] >> (4 * ((g / 2) % 2))) & 0x0F; /* scale of group pair g / 2 */
            const float db = d * (0.5f + (float)s) * 0.25f;
            grid8(db, IQ2XS_GRID[q & 511], ksigns(q >> 9), y);
        }
    }
}

__attribute__((unused)) static void row_iq2_s(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 82) {
        const float d = f16(b);
        for (int g = 0; g < 32; g++, y += 8) {
            const int idx = b[2 + g] | (((b[66 + g / 4] >> (2 * (g % 4))) & 3) << 8);
            const int s = (b[74 + g / 4] >> (4 * ((g / 2) % 2))) & 0x0F;
            const float db = d * (0.5f + (float)s) * 0.25f;
            grid8(db, IQ2S_GRID[idx], b[34 + g], y);
        }
    }
}

__attribute__((unused)) static void row_iq3_xxs(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 98) {
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = u32(b + 66 + 4 * ib);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++, y += 8)
                grid4x2(db, IQ3XXS_GRID[q[2 * l]], IQ3XXS_GRID[q[2 * l + 1]], ksigns((aux >> (7 * l)) & 127), y);
        }
    }
}

__attribute__((unused)) static void row_iq3_s(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 110) {
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const int s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
            const float db = d * (float)(1 + 2 * s);
            for (int l = 0; l < 4; l++, y += 8) {
                const int e = 8 * ib + 2 * l; /* the group's two grid entries e, e + 1 */
                const int i1 = b[2 + e] | (((b[66 + e / 8] >> (e % 8)) & 1) << 8);
                const int i2 = b[3 + e] | (((b[66 + (e + 1) / 8] >> ((e + 1) % 8)) & 1) << 8);
                grid4x2(db, IQ3S_GRID[i1], IQ3S_GRID[i2], b[74 + 4 * ib + l], y);
            }
        }
    }
}

/* IQ1_S / IQ1_M: dl * (grid value + delta), the grid's int8 values -1 / 0 / 1 */
static inline void grid1(float dl, uint64_t entry, float delta, float *y) {
    for (int j = 0; j < 8; j++) y[j] = dl * ((float)(int8_t)(uint8_t)(entry >> (8 * j)) + delta);
}

__attribute__((unused)) static void row_iq1_s(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 50) {
        const float d = f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const uint16_t qh = u16(b + 34 + 2 * ib);
            const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
            const float delta = qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA;
            for (int l = 0; l < 4; l++, y += 8)
                grid1(dl, IQ1S_GRID[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], delta, y);
        }
    }
}

__attribute__((unused)) static void row_iq1_m(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 56) {
        uint16_t s[4];
        for (int w = 0; w < 4; w++) s[w] = u16(b + 48 + 2 * w);
        const uint16_t dbits = (s[0] >> 12) | ((s[1] & 0xF000) >> 8) | ((s[2] & 0xF000) >> 4) | (s[3] & 0xF000);
        const uint8_t dbytes[2] = {(uint8_t)dbits, (uint8_t)(dbits >> 8)};
        const float d = f16(dbytes);
        for (int g = 0; g < 32; g++, y += 8) {
            const int h = g / 2; /* the half sub-block of 16 values: scale 3 bits of word h / 4 */
            const float dl = d * (float)(2 * ((s[h / 4] >> (3 * (h % 4))) & 7) + 1);
            const int nib = (b[32 + g / 2] >> (4 * (g % 2))) & 0x0F;
            grid1(dl, IQ1S_GRID[b[g] | ((nib & 7) << 8)], nib & 8 ? -IQ1_DELTA : IQ1_DELTA, y);
        }
    }
}

/* TQ1_0: five base-3 digits per byte in fixed point: digit n of byte q is ((uint8)(q * 3^n) * 3) >> 8 */
static inline float tq1_value(float d, uint8_t q, uint8_t pow3) {
    const uint8_t t = (uint8_t)(q * pow3);
    return d * (float)((((uint16_t)t * 3) >> 8) - 1);
}

__attribute__((unused)) static void row_tq1_0(const uint8_t *b, float *y, int64_t k) {
    static const uint8_t POW3[5] = {1, 3, 9, 27, 81};
    for (int64_t i = 0; i < k / 256; i++, b += 54, y += 256) {
        const float d = f16(b + 52);
        for (int n = 0; n < 5; n++)
            for (int m = 0; m < 32; m++) y[n * 32 + m] = tq1_value(d, b[m], POW3[n]);
        for (int n = 0; n < 5; n++)
            for (int m = 0; m < 16; m++) y[160 + n * 16 + m] = tq1_value(d, b[32 + m], POW3[n]);
        for (int n = 0; n < 4; n++)
            for (int m = 0; m < 4; m++) y[240 + n * 4 + m] = tq1_value(d, b[48 + m], POW3[n]);
    }
}

__attribute__((unused)) static void row_tq2_0(const uint8_t *b, float *y, int64_t k) {
    for (int64_t i = 0; i < k / 256; i++, b += 66, y += 256) {
        const float d = f16(b + 64);
        for (int j = 0; j < 2; j++)
            for (int l = 0; l < 4; l++)
                for (int m = 0; m < 32; m++) y[j * 128 + l * 32 + m] = d * (float)(((b[32 * j + m] >> (2 * l)) & 3) - 1);
    }
}

/* ---------------------------------------------------------------- the grid i-quants as integers (int8.c)
   For the int8-activation kernels: a sub-block's 32 codes w as int8 and the integer multipliers ls of its two
   16-value halves, so that value = d * factor * ls * w exactly (ls = 2 s + 1, IQ3_S 1 + 2 s; IQ1: w = 8 g +- 1,
   the grid value and the delta's sign, as 8 (g +- 1/8)): factor IQ2_* 1/8, IQ3_XXS 1/4, IQ3_S 1, IQ1_* 1/8 (a
   power of two: the kernels apply it once, to the row's sum). Used by both builds (ls, d; the codes by the
   scalar one: the SIMD one reads them with its own readers, x86/avx2.c, held to these by the tests). */
static inline float iq_int_factor(int type) {
    return type == MLS_IQ3_XXS ? 0.25f : type == MLS_IQ3_S ? 1.0f : 0.125f;
}

static inline float iq_int_d(const uint8_t *b, int type) {
    if (type != MLS_IQ1_M) return f16(b);
    const uint16_t s0 = u16(b + 48), s1 = u16(b + 50), s2 = u16(b + 52), s3 = u16(b + 54);
    const uint16_t dbits = (s0 >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000);
    const uint8_t dbytes[2] = {(uint8_t)dbits, (uint8_t)(dbits >> 8)};
    return f16(dbytes);
}

static inline void iq_ls(const uint8_t *b, int type, int ib, int32_t ls[2]) {
    switch (type) {
    case MLS_IQ2_XXS: ls[0] = ls[1] = 2 * (int32_t)(u32(b + 2 + 8 * ib + 4) >> 28) + 1; break;
    case MLS_IQ3_XXS: ls[0] = ls[1] = 2 * (int32_t)(u32(b + 66 + 4 * ib) >> 28) + 1; break;
    case MLS_IQ2_XS:
    case MLS_IQ2_S: {
        const uint8_t sc = b[(type == MLS_IQ2_XS ? 66 : 74) + ib];
        ls[0] = 2 * (sc & 0x0F) + 1, ls[1] = 2 * (sc >> 4) + 1;
        break;
    }
    case MLS_IQ3_S: ls[0] = ls[1] = 1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F); break;
    case MLS_IQ1_S: ls[0] = ls[1] = 2 * ((u16(b + 34 + 2 * ib) >> 12) & 7) + 1; break;
    default: { /* IQ1_M */
        const uint16_t sw = u16(b + 48 + 2 * (ib / 2));
        const int sh = 6 * (ib % 2);
        ls[0] = 2 * ((sw >> sh) & 7) + 1, ls[1] = 2 * ((sw >> (sh + 3)) & 7) + 1;
    }
    }
}

static inline void signed8(uint64_t entry, uint8_t signs, int8_t *w) {
    for (int j = 0; j < 8; j++) {
        const int v = (uint8_t)(entry >> (8 * j));
        w[j] = (int8_t)((signs >> j) & 1 ? -v : v);
    }
}

static inline void iq1_8(uint64_t entry, int negative, int8_t *w) {
    for (int j = 0; j < 8; j++) w[j] = (int8_t)(8 * (int8_t)(uint8_t)(entry >> (8 * j)) + (negative ? -1 : 1));
}

__attribute__((unused)) static void iq_sub_int(const uint8_t *b, int type, int ib, int8_t w[32]) {
    for (int l = 0; l < 4; l++) {
        int8_t *g = w + 8 * l;
        switch (type) {
        case MLS_IQ2_XXS: {
            const uint8_t *q = b + 2 + 8 * ib;
            signed8(IQ2XXS_GRID[q[l]], ksigns((u32(q + 4) >> (7 * l)) & 127), g);
            break;
        }
        case MLS_IQ3_XXS: {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint64_t e = IQ3XXS_GRID[q[2 * l]] | (uint64_t)IQ3XXS_GRID[q[2 * l + 1]] << 32;
            signed8(e, ksigns((u32(b + 66 + 4 * ib) >> (7 * l)) & 127), g);
            break;
        }
        case MLS_IQ2_XS: {
            const uint16_t q = u16(b + 2 + 2 * (4 * ib + l));
            signed8(IQ2XS_GRID[q & 511], ksigns(q >> 9), g);
            break;
        }
        case MLS_IQ2_S: {
            const int gi = 4 * ib + l, idx = b[2 + gi] | (((b[66 + ib] >> (2 * l)) & 3) << 8);
            signed8(IQ2S_GRID[idx], b[34 + gi], g);
            break;
        }
        case MLS_IQ3_S: {
            const int e = 8 * ib + 2 * l;
            const uint8_t qh = b[66 + ib];
            const int i1 = b[2 + e] | (((qh >> (2 * l)) & 1) << 8), i2 = b[3 + e] | (((qh >> (2 * l + 1)) & 1) << 8);
            signed8(IQ3S_GRID[i1] | (uint64_t)IQ3S_GRID[i2] << 32, b[74 + 4 * ib + l], g);
            break;
        }
        case MLS_IQ1_S: {
            const uint16_t qh = u16(b + 34 + 2 * ib);
            iq1_8(IQ1S_GRID[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], qh >> 15, g);
            break;
        }
        default: { /* IQ1_M */
            const int nib = (u16(b + 32 + 2 * ib) >> (4 * l)) & 0x0F;
            iq1_8(IQ1S_GRID[b[4 * ib + l] | ((nib & 7) << 8)], nib >> 3, g);
        }
        }
    }
}

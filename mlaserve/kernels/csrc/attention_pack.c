/* ---------------------------------------------------------------- a prompt's bf16 attention: its queries packed
   The left operand of the decompressed attention's scores (kernels/bf16_attention.py: q_b = bf(scale q), a block of
   queries of a group of heads, padded to whole tile blocks) written in one pass from the layer's own query halves
   where they lie: each (request, query) row read through its token row, scaled, rounded and stored, the padding
   zeroed. torch composed it from a concatenation of q_nope and q_pe, an indexed gather of the segment's rows, the
   scale's product and a padded bf16 copy: five passes over [T, H, dn + dr] fp32 and four temporaries of that size.

   Notation: rows [b, nq] the token rows of the block's queries; q0 [T, g, d0] (q_nope) and q1 [T, g, d1] (q_pe)
   with token strides st0 / st1 and head strides sh0 / sh1 in floats (the values of a head contiguous);
   out [b g, mp, dp] bf16: out[bi g + gi, i] = [bf(scale q0[t, gi]) | bf(scale q1[t, gi]) | 0] for t = rows[bi, i],
   i < nq; rows i >= nq zero. The product scale * x is fp32's (-ffp-contract=off) and the rounding torch's
   (rows16.c f32_to_bf16: nearest, ties to even), so the bits of (q * scale).bfloat16(); a NaN stays a NaN (the
   quiet 0x7FC0, torch's scalar cast; its vector cast writes 0xFFFF). */
static inline void pack_query_part(const float *x, int64_t d, float scale, uint16_t *o) {
    for (int64_t j = 0; j < d; j++) o[j] = f32_to_bf16(x[j] * scale);
}

int mls_pack_queries_bf16(const float *q0, int64_t d0, int64_t st0, int64_t sh0, const float *q1, int64_t d1,
                          int64_t st1, int64_t sh1, const int64_t *rows, int64_t b, int64_t nq, int64_t g, float scale,
                          uint16_t *out, int64_t mp, int64_t dp, int threads) {
    if (nq > mp || d0 + d1 > dp) return -2;
    const int64_t n = b * g * mp;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 64)
    for (int64_t r = 0; r < n; r++) {
        const int64_t e = r / mp, i = r % mp, bi = e / g, gi = e % g;
        uint16_t *o = out + r * dp;
        if (i >= nq) {
            memset(o, 0, sizeof(uint16_t) * (size_t)dp);
            continue;
        }
        const int64_t t = rows[bi * nq + i];
        pack_query_part(q0 + t * st0 + gi * sh0, d0, scale, o);
        pack_query_part(q1 + t * st1 + gi * sh1, d1, scale, o + d0);
        memset(o + d0 + d1, 0, sizeof(uint16_t) * (size_t)(dp - d0 - d1));
    }
    return 0;
}

/* ---------------------------------------------------------------- a prompt's bf16 attention: its operands packed
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

/* The right operands, K^T and V per group of heads, in the pair layouts mls_bf16_bmm reads (kernels/bf16_attention.py
   pack_keys / pack_values), each in one pass from the expansion's bf16 output where it lies: torch composed each from
   a zeroed padded copy, the halves copied in, then a transposing copy (and for V a pass zeroing non-finite values).
   Entries e = bi g + gi; strides in elements (s*b, s*g, s*l: request, head, key; a head's values contiguous; a
   k_pe shared by the heads has s*g 0).
     keys   out int32 [b g, lp / 16, dp / 2, 16]: key l = 16 blk + j, pair p = (K[l, 2p], K[l, 2p + 1]) as bf16 bits,
            K[l] = [k_nope[l] (bf16, dn) | bf(k_pe[l]) (fp32, dr) | 0], keys l >= n zero
     values out int32 [b g, lp / 2, dvp]: (V[2p, c], V[2p + 1, c]) as bf16 bits, keys >= n and columns >= dv zero;
            finite: a non-finite value 0 (torch's nan_to_num_(0, 0, 0): a masked row's probability is 0, and
            0 x NaN = NaN)
   k_pe's rounding is rows16.c f32_to_bf16 (torch's, a NaN stays a NaN). */
static inline uint16_t key_value(const uint16_t *kn, int64_t dn, const float *kp, int64_t dr, int64_t d) {
    if (d < dn) return kn[d];
    return d < dn + dr ? f32_to_bf16(kp[d - dn]) : 0;
}

int mls_pack_keys_bf16(const uint16_t *kn, int64_t dn, int64_t snb, int64_t sng, int64_t snl, const float *kp,
                       int64_t dr, int64_t spb, int64_t spg, int64_t spl, int64_t b, int64_t g, int64_t n,
                       int32_t *out, int64_t lp, int64_t dp, int threads) {
    if (n > lp || lp % 16 || dp % 2 || dn + dr > dp) return -2;
    const int64_t blocks = b * g * (lp / 16), half = dp / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 8)
    for (int64_t it = 0; it < blocks; it++) {
        const int64_t e = it / (lp / 16), l0 = it % (lp / 16) * 16, bi = e / g, gi = e % g;
        int32_t *o = out + it * half * 16;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t l = l0 + j;
            if (l >= n) {
                for (int64_t p = 0; p < half; p++) o[p * 16 + j] = 0;
                continue;
            }
            const uint16_t *rn = kn + bi * snb + gi * sng + l * snl;
            const float *rp = kp + bi * spb + gi * spg + l * spl;
            for (int64_t p = 0; p < half; p++) {
                const uint32_t lo = key_value(rn, dn, rp, dr, 2 * p), hi = key_value(rn, dn, rp, dr, 2 * p + 1);
                o[p * 16 + j] = (int32_t)(lo | hi << 16);
            }
        }
    }
    return 0;
}

static inline uint32_t value_bits(uint16_t v, int finite) { return finite && (v & 0x7F80) == 0x7F80 ? 0 : v; }

int mls_pack_values_bf16(const uint16_t *v, int64_t dv, int64_t svb, int64_t svg, int64_t svl, int64_t b, int64_t g,
                         int64_t n, int finite, int32_t *out, int64_t lp, int64_t dvp, int threads) {
    if (n > lp || lp % 2 || dv > dvp) return -2;
    const int64_t rows = b * g * (lp / 2);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t it = 0; it < rows; it++) {
        const int64_t e = it / (lp / 2), l = it % (lp / 2) * 2, bi = e / g, gi = e % g;
        int32_t *o = out + it * dvp;
        memset(o, 0, sizeof(int32_t) * (size_t)dvp);
        const uint16_t *r0 = v + bi * svb + gi * svg + l * svl, *r1 = r0 + svl;
        for (int64_t c = 0; l < n && c < dv; c++) {
            const uint32_t hi = l + 1 < n ? value_bits(r1[c], finite) : 0;
            o[c] = (int32_t)(value_bits(r0[c], finite) | hi << 16);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- DeepSeek-V4's FFN sublayer of a step in one call
   After a decoder layer's attention (models/deepseek_v4/model.py V4DecoderLayer, hyper.c's notation): the
   attention's new streams, the FFN's hyper-connection, its norm, the MoE block and the layer's output streams,
     h1  [S, N, D] = hc_post(h; post_a, comb_a, y)      y [S, D] the attention's output (mls_hc_post)
     post_f, comb_f, x = hc_pre(h1; fn, base, scale)    (mls_hc_pre)
     xn  [S, D]    = RMSNorm(x; g, eps_g)               (mls_rms_norm)
     m   [S, D]    = MoE(xn; ids)                       (mls_moe_block: ids the step's token ids, hash routing)
     out [S, N, D] = hc_post(h1; post_f, comb_f, m)
   The per-op native path's five C calls on the same values in the same order, so the same bits; one call where
   that path also ran ~15 tensor ops and their Python between the calls (~0.1 ms a layer at a one-token step of
   the 4-layer benchmark model, a 2-core AMX Xeon). -> 0, -1 hc_pre / hc_post's refusal (streams), the MoE
   block's codes (-1 .. -5), -4 memory. */
int mls_v4_ffn(const float *h, int64_t s, int64_t n, int64_t d, const float *post_a, const float *comb_a,
               const float *y, const float *fn, const float *base, const float *scale, float eps, float norm_eps,
               int iters, const float *g, float eps_g, const mls_moe_block_t *moe, const int64_t *ids, float *out,
               int threads) {
    const size_t snd = (size_t)(s * n * d), sd = (size_t)(s * d);
    float *h1 = (float *)malloc(sizeof(float) * (snd + (size_t)(s * n + s * n * n) + 3 * sd) + 1);
    if (!h1) return -4;
    float *post_f = h1 + snd, *comb_f = post_f + s * n, *x = comb_f + s * n * n, *xn = x + sd, *m = xn + sd;
    int rc = mls_hc_post(h, s, n, d, post_a, comb_a, y, h1, threads);
    if (!rc) rc = mls_hc_pre(h1, s, n, d, fn, base, scale, eps, norm_eps, iters, post_f, comb_f, x, threads);
    if (!rc) rc = mls_rms_norm(x, s, d, d, g, eps_g, xn, d, threads);
    if (!rc) rc = mls_moe_block(moe, xn, s, ids, m, 0, 0, threads);
    if (!rc) rc = mls_hc_post(h1, s, n, d, post_f, comb_f, m, out, threads);
    free(h1);
    return rc;
}

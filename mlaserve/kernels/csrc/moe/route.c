/* ---------------------------------------------------------------- MoE at decode (few tokens)
   The router and the routed experts of a step with few (token, expert) pairs, each one call, so that
   a decode step does not pay ~50 small tensor ops per MoE layer. Same arithmetic as models/moe.py
   (Gate) and GGUFExperts: float rounding may differ in the last bits (expf vs torch's vectorized exp,
   summation order), which the tests bound. */

/* indices of the k largest of v[0..n) into idx (ties: the lower index first); n <= 1024 */
static void topk_desc(const float *v, int64_t n, int64_t k, int64_t *idx) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= idx[q] == i;
            if (!taken && (best < 0 || v[i] > v[best])) best = i;
        }
        idx[j] = best;
    }
}

/* the scores of one token's logits l [e] elementwise: sigmoid, or DeepSeek-V4's sqrt(softplus) (torch's softplus:
   the identity above 20, log1p(exp) below) */
static void route_scores(const float *l, int64_t e, int scoring, float *scores) {
    if (scoring == MLS_SCORE_SQRT_SOFTPLUS)
        for (int64_t i = 0; i < e; i++) scores[i] = sqrtf(l[i] > 20.0f ? l[i] : log1pf(expf(l[i])));
    else
        for (int64_t i = 0; i < e; i++) scores[i] = 1.0f / (1.0f + expf(-l[i]));
}

/* the chosen experts' weights w [k] from their scores: normalised if norm (over sum + 1e-20), times scale */
static void route_weights(const float *scores, const int64_t *idx, int64_t k, int norm, float scale, float *w) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) sum += (w[j] = scores[idx[j]]);
    for (int64_t j = 0; j < k; j++) w[j] = (norm ? w[j] / (sum + 1e-20f) : w[j]) * scale;
}

/* logits [T, E] (x @ W_gate^T, fp32) -> topk_w [T, k] fp32, topk_idx [T, k]. scoring: softmax | sigmoid
   (+ correction bias for the choice only); method: greedy | group max (V2, dropped groups score 0) |
   group sum of top-2 (V3 noaux_tc, dropped groups -inf). Weights: the unbiased scores of the chosen
   experts, normalised if norm, times scale. Returns -3 for more than 1024 experts. */
int mls_moe_route(const float *logits, int64_t t, int64_t e, const float *bias, int scoring, int method,
                  int64_t n_group, int64_t topk_group, int64_t k, int norm, float scale, float *out_w,
                  int64_t *out_idx) {
    if (e < 1 || e > 1024 || k < 1 || k > e) return -3;
    if (method != MLS_TOPK_GREEDY &&
        (n_group < 1 || n_group > 64 || e % n_group || topk_group < 1 || topk_group > n_group))
        return -3;
    float scores[1024], choice[1024], gscore[64];
    int64_t gidx[64];
    for (int64_t r = 0; r < t; r++) {
        const float *l = logits + r * e;
        if (scoring == MLS_SCORE_SOFTMAX) {
            float mx = l[0], sum = 0.0f;
            for (int64_t i = 1; i < e; i++) mx = l[i] > mx ? l[i] : mx;
            for (int64_t i = 0; i < e; i++) sum += (scores[i] = expf(l[i] - mx));
            for (int64_t i = 0; i < e; i++) choice[i] = scores[i] = scores[i] / sum;
        } else {
            route_scores(l, e, scoring, scores);
            for (int64_t i = 0; i < e; i++) choice[i] = bias ? scores[i] + bias[i] : scores[i];
        }
        if (method != MLS_TOPK_GREEDY) {
            const int64_t per = e / n_group;
            for (int64_t g = 0; g < n_group; g++) {
                const float *c = choice + g * per;
                if (method == MLS_TOPK_GROUP_TOP2) {
                    int64_t two[2];
                    topk_desc(c, per, per < 2 ? per : 2, two);
                    gscore[g] = per < 2 ? c[two[0]] : c[two[0]] + c[two[1]];
                } else {
                    float mx = c[0];
                    for (int64_t i = 1; i < per; i++) mx = c[i] > mx ? c[i] : mx;
                    gscore[g] = mx;
                }
            }
            topk_desc(gscore, n_group, topk_group, gidx);
            const float fill = method == MLS_TOPK_GROUP_TOP2 ? -INFINITY : 0.0f;
            for (int64_t g = 0; g < n_group; g++) {
                int kept = 0;
                for (int64_t q = 0; q < topk_group; q++) kept |= gidx[q] == g;
                if (!kept)
                    for (int64_t i = 0; i < per; i++) choice[g * per + i] = fill;
            }
        }
        int64_t *idx = out_idx + r * k;
        topk_desc(choice, e, k, idx);
        route_weights(scores, idx, k, norm, scale, out_w + r * k);
    }
    return 0;
}

/* Hash routing (DeepSeek-V4's first layers): token r's experts are tid2eid[ids[r]] [k] (a table of vocab rows), its
   weights their scores (scoring: sigmoid or sqrt_softplus) as mls_moe_route's. -> 0, -5 a token id outside the
   table or a table entry outside the experts (named by the caller: never routed to a wrong expert), -3 bad sizes. */
static int moe_route_hashed(const float *logits, int64_t t, int64_t e, int scoring, const int64_t *tid2eid,
                            int64_t vocab, const int64_t *ids, int64_t k, int norm, float scale, float *out_w,
                            int64_t *out_idx) {
    if (e < 1 || e > 1024 || k < 1 || k > e || !ids || scoring == MLS_SCORE_SOFTMAX) return -3;
    float scores[1024];
    for (int64_t r = 0; r < t; r++) {
        if (ids[r] < 0 || ids[r] >= vocab) return -5;
        int64_t *idx = out_idx + r * k;
        for (int64_t j = 0; j < k; j++)
            if ((idx[j] = tid2eid[ids[r] * k + j]) < 0 || idx[j] >= e) return -5;
        route_scores(logits + r * e, e, scoring, scores);
        route_weights(scores, idx, k, norm, scale, out_w + r * k);
    }
    return 0;
}

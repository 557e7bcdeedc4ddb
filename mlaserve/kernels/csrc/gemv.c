/* Products of stored weight rows with a few activation rows (decode), and their decoding (prefill: decode once,
   then the BLAS GEMM). Each weight row is decoded into an fp32 row buffer (ref/decode.c's values, bit for bit)
   and dotted with each activation row, or, for the types with a fused kernel (types.c), dotted block by block
   where it lies: only the summation order of the dot products differs from "dequantize, then GEMM". */

/* Where a row's fp8 scales are: rows come in `parts` of part_rows rows (gate and up of an expert
   keep separate scale grids), each part's grid [ceil(part_rows / bn), kb] part_stride apart. */
typedef struct {
    const float *scale;
    int64_t bn, kb, bk, part_rows, part_stride;
} fp8_scales;

static inline const float *fp8_row_scales(const fp8_scales *f, const float *base, int64_t n) {
    int64_t part = n / f->part_rows, r = n % f->part_rows;
    return base + part * f->part_stride + (r / f->bn) * f->kb;
}

/* one row into buf: the type's decoder, with the row's scales where they lie apart */
static inline void decode_row(const mls_type_t *ty, const uint8_t *w, const fp8_scales *f, const float *sbase,
                              int64_t n, float *buf, int64_t k) {
    if (ty->decode_scaled)
        ty->decode_scaled(w, fp8_row_scales(f, sbase, n), f->bk, buf, k);
    else
        ty->decode(w, buf, k);
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W [N] rows of row_bytes */
int mls_gemm(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t n,
             int64_t row_bytes, const float *scale, int64_t bn, int64_t kb, int64_t bk, int64_t part_rows,
             float *y, int64_t ldy, int threads) {
    const mls_type_t *ty = type_of(type);
    if (!ty->decode && !ty->decode_scaled) return -1;
    if (k > MAX_K) return -2;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
#ifdef MLS_DECODE_THEN_DOT /* a build for benchmarks/iquant_kernel.py: every type's rows decoded, then dotted */
    const fused_fn fused = 0;
#else
    const fused_fn fused = ty->fused;
#endif
    if (fused) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r++) fused(w + r * row_bytes, x, ldx, m, k, y + r, ldy);
        return 0;
    }
    const scaled_fused_fn fs = ty->fused_scaled;
    if (fs) { /* scales apart, one per bk columns (bn = 1: per row): the kernel takes whole 32-column chunks */
        if (bn != 1 || bk % 32 || k % bk) return -2;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r++) fs(w + r * row_bytes, fp8_row_scales(&f, scale, r), bk, x, ldx, m, k, y + r, ldy);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            prefetch_row(w + r * row_bytes, row_bytes);
            decode_row(ty, w + r * row_bytes, &f, scale, r, buf, k);
            for (int64_t i = 0; i < m; i++) y[i * ldy + r] = dot(buf, x + i * ldx, k);
        }
        free(buf);
    }
    return 0;
}

/* Routed experts. x [P, K] holds the (token, expert) pairs sorted by expert; group a is rows
   [starts[a], starts[a+1]) and uses expert experts[a]: W + experts[a] * expert_stride (bytes),
   fp8 scales + experts[a] * scale_expert_stride (floats). y [P, N]. */
int mls_grouped_gemm(int type, const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                     int64_t expert_stride, const float *scale, int64_t scale_expert_stride, int64_t bn,
                     int64_t kb, int64_t bk, int64_t part_rows, const int64_t *experts, const int64_t *starts,
                     int64_t groups, float *y, int threads) {
    const mls_type_t *ty = type_of(type);
    if (!ty->decode && !ty->decode_scaled) return -1;
    if (k > MAX_K) return -2;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
    const int64_t items = groups * n;
    const fused_fn fused = ty->fused;
    if (fused) { /* items of ROW_RUN rows: one index division per run, not per row (rows may be short) */
        const int64_t runs = (n + ROW_RUN - 1) / ROW_RUN;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < groups * runs; it++) {
            const int64_t a = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
            const int64_t p0 = starts[a], m = starts[a + 1] - p0;
            const uint8_t *we = w + experts[a] * expert_stride;
            for (int64_t r = r0; r < r1; r++) fused(we + r * row_bytes, x + p0 * k, k, m, k, y + p0 * n + r, n);
        }
        return 0;
    }
    const scaled_fused_fn fs = ty->fused_scaled;
    if (fs) { /* as mls_gemm's; each expert's scales scale_expert_stride floats apart */
        if (bn != 1 || bk % 32 || k % bk) return -2;
        const int64_t runs = (n + ROW_RUN - 1) / ROW_RUN;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < groups * runs; it++) {
            const int64_t a = it / runs, r0 = (it % runs) * ROW_RUN, r1 = r0 + ROW_RUN < n ? r0 + ROW_RUN : n;
            const int64_t p0 = starts[a], m = starts[a + 1] - p0;
            const uint8_t *we = w + experts[a] * expert_stride;
            const float *sbase = scale + experts[a] * scale_expert_stride;
            for (int64_t r = r0; r < r1; r++)
                fs(we + r * row_bytes, fp8_row_scales(&f, sbase, r), bk, x + p0 * k, k, m, k, y + p0 * n + r, n);
        }
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t a = it / n, r = it % n, e = experts[a];
            const float *sbase = scale ? scale + e * scale_expert_stride : 0;
            prefetch_row(w + e * expert_stride + r * row_bytes, row_bytes);
            decode_row(ty, w + e * expert_stride + r * row_bytes, &f, sbase, r, buf, k);
            for (int64_t p = starts[a]; p < starts[a + 1]; p++) y[p * n + r] = dot(buf, x + p * k, k);
        }
        free(buf);
    }
    return 0;
}

/* out [N, K] fp32 = the decoded rows (prefill: decode once, then the BLAS GEMM) */
int mls_dequantize(int type, const uint8_t *w, int64_t n, int64_t row_bytes, const float *scale, int64_t bn,
                   int64_t kb, int64_t bk, int64_t part_rows, int64_t k, float *out, int threads) {
    const mls_type_t *ty = type_of(type);
    if (!ty->decode && !ty->decode_scaled) return -1;
    if (type == MLS_FP8_E4M3 && !e4m3_ready) e4m3_init();
    fp8_scales f = {scale, bn, kb, bk, part_rows, ((part_rows + bn - 1) / bn) * kb};
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++) {
        prefetch_row(w + r * row_bytes, row_bytes);
        decode_row(ty, w + r * row_bytes, &f, scale, r, out + r * k, k);
    }
    return 0;
}


/* out [A, N, K] fp32 = the decoded rows of experts experts[0..A) of a stack (expert e's N rows of row_bytes
   start at w + e * expert_stride): a prefill's active experts, decoded where they lie (no gathered copy).
   Expert j's rows go to out + j * out_expert_stride floats (N * K: packed; 2N * K with out and out + N * K:
   a layer's gate and up stacks decoded into the halves of one [A, 2N, K] buffer, as one fused stack was). */
int mls_dequantize_experts(int type, const uint8_t *w, int64_t expert_stride, const int64_t *experts, int64_t a,
                           int64_t n, int64_t row_bytes, int64_t k, float *out, int64_t out_expert_stride,
                           int threads) {
    row_fn fn = ggml_row(type);
    if (!fn) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t it = 0; it < a * n; it++) {
        const uint8_t *row = w + experts[it / n] * expert_stride + (it % n) * row_bytes;
        prefetch_row(row, row_bytes);
        fn(row, out + (it / n) * out_expert_stride + (it % n) * k, k);
    }
    return 0;
}

/* bf16 out: the decoded fp32 rows rounded to the nearest bf16 (ties to even; NaN -> 0x7FC0), the bits torch's
   .to(torch.bfloat16) gives: what the bf16 prefill GEMMs read (kernels/bf16_prefill.py), written once instead of
   fp32 rows then a conversion pass. Each thread decodes a row into its own fp32 buffer. */
static inline void bf16_row(const float *src, uint16_t *dst, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        uint32_t u;
        memcpy(&u, &src[i], 4);
        uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        dst[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : r;
    }
}

/* mls_dequantize_experts, out [A, N, K] bf16 bits (expert j's rows at out + j * out_expert_stride) */
int mls_dequantize_experts_bf16(int type, const uint8_t *w, int64_t expert_stride, const int64_t *experts, int64_t a,
                                int64_t n, int64_t row_bytes, int64_t k, uint16_t *out, int64_t out_expert_stride,
                                int threads) {
    row_fn fn = ggml_row(type);
    if (!fn) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)k);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < a * n; it++) {
            if (!buf) continue;
            const uint8_t *row = w + experts[it / n] * expert_stride + (it % n) * row_bytes;
            prefetch_row(row, row_bytes);
            fn(row, buf, k);
            bf16_row(buf, out + (it / n) * out_expert_stride + (it % n) * k, k);
        }
        free(buf);
    }
    return failed ? -4 : 0;
}

/* mls_dequantize for ggml types, out [N, K] bf16 bits: the one-expert case of mls_dequantize_experts_bf16
   (expert 0 of a stack of one, packed output), the same rows per thread */
int mls_dequantize_bf16(int type, const uint8_t *w, int64_t n, int64_t row_bytes, int64_t k, uint16_t *out,
                        int threads) {
    const int64_t only = 0;
    return mls_dequantize_experts_bf16(type, w, 0, &only, 1, n, row_bytes, k, out, n * k, threads);
}

/* ---------------------------------------------------------------- a linear's rows, for the one-call layers
   (moe/block.c, decode_layer.c): a type's kernels looked up once, then mls_gemm's per-row operations. */
typedef struct {
    row_fn fn;
    fused_fn fz;
    int64_t row_bytes; /* for the prefetch of decoded (not fused) rows; 0: none */
} lin_kernel;

static inline lin_kernel lin_for(int64_t type) {
    lin_kernel l = {ggml_row((int)type), fused_row((int)type), 0};
    return l;
}

static inline lin_kernel lin_rows(int64_t type, int64_t row_bytes) {
    lin_kernel l = lin_for(type);
    l.row_bytes = row_bytes;
    return l;
}

/* y[i * ldy] (i < m) = the weight row at w (k values) . x[i * ldx]: mls_gemm's per-row operations */
static inline void lin_row(lin_kernel l, const uint8_t *w, const float *x, int64_t ldx, int64_t m, int64_t k,
                           float *y, int64_t ldy, float *buf) {
    if (l.fz) { /* it prefetches itself */
        l.fz(w, x, ldx, m, k, y, ldy);
        return;
    }
    prefetch_row(w, l.row_bytes);
    l.fn(w, buf, k);
    for (int64_t i = 0; i < m; i++) y[i * ldy] = dot(buf, x + i * ldx, k);
}

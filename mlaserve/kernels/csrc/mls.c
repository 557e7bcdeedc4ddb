/* The native kernels' one translation unit: the files below, in this order, compiled together.

   One unit, not one object per file, because the kernels share small static inline helpers (fp16 scales,
   code extraction, horizontal sums, the dot product) that must inline into every inner loop, and the entry
   points call each other (the decode layer runs the MoE block, the glue and the products): one unit gives each
   loop the code it had as a single file, with no exported internals and no link-time optimisation to rely on.
   Each file below holds one concern and uses only what is included before it. */

#include "common.h"

#include "ref/decode.c"   /* the reference decoders (exact, scalar) */
#include "ref/iquants.c"  /* the i-quant and ternary reference decoders, with their grids */
#include "x86/avx2.c"     /* AVX2 decoders, fused decode-and-dot, int8 row kernels */
#include "x86/avx512.c"   /* the AVX-512 fused kernels */
#include "x86/rows16_q8k.c" /* AVX-512: 1-3 activation rows times 16 weight rows side by side (int8) */
#include "x86/rows8_q8k.c"  /* AVX2: the same with 8 weight rows; the callers' rows16_in / rows16_run */
#include "x86/amx.c"        /* AMX-INT8 tiles for int8 products of many rows: the driver, the hook contract */
#include "x86/amx_planes.c" /* its hook for Q4_K, Q6_K (scales as base-8 digit planes) */
#include "x86/amx_units.c"  /* its hook for the types with one integer scale per 32 or 16 values */
#include "x86/amx_bf16.c"   /* AMX-BF16 tiles: Q8_0 products of many rows, activations as bf16 pairs */
#include "x86/avx512_bf16.c"    /* AVX512-BF16: the attention's bf16 products without tiles, its softmax */
#include "x86/amx_bf16_bmm.c" /* AMX-BF16 tiles: batched bf16 products with fp32 sums (prefill attention) */
#include "ref/int8.c"     /* the int8 row kernels without SIMD */
#include "dot.c"          /* the fp32 dot product, F32 rows */
#include "types.c"        /* the type table: each type's block and kernels */
#include "gemv.c"         /* products and decoding of stored rows */
#include "x86/panels.c"   /* AVX-512: fp32 products of many rows on decoded weight panels (exact prefill) */
#include "x86/vnni_panels.c" /* AVX512-VNNI: int8 products of many rows on 16-row weight panels */
#include "x86/avx2_panels.c" /* AVX2 without it: the same on 8-row panels */
#include "x86/int16_prefill.c" /* AVX512-VNNI: Q8_0, Q4_0, ... products of many rows, int16 activations */
#include "x86/int16_rows.c"    /* AVX2 without it: the same products of few rows (decode) */
#include "x86/amx_int16.c"  /* AMX-INT8 tiles: the int16 products of Q8_0, each code as its two bytes */
#include "int16.c"          /* the int16 products' calls: work lists, the decode steps' helpers, the interface */
#include "int8.c"         /* the same with int8 activations */
#include "moe/route.c"    /* the MoE router */
#include "moe/experts.c"  /* routed experts, pair by pair */
#include "moe/block_setup.c" /* the MoE block's ways, buffers, routing and packed inputs */
#include "moe/block.c"    /* a decode step's MoE block in one call */
#include "rows16.c"      /* 16-bit cache rows: widening reads, rounding writes (kv_cache_dtype) */
#include "attention.c"    /* the latent MQA over paged rows */
#include "attention_pack.c" /* a prompt's bf16 attention: its operands packed in one pass */
#include "glue.c"         /* RMSNorm, a step's latent rows and query rope */
#include "hyper.c"        /* mHC: a hyper-connection's mixing weights and its sublayer input */
#include "v4_ffn.c"       /* DeepSeek-V4's FFN sublayer of a step (hyper-connections, norm, MoE block) */
#include "indexer.c"      /* the DSA indexer of a decode step: index keys, scores, top-k */
#include "rows8.c"        /* the 8-bit cache's quantizer (kv_cache_dtype) */
#include "decode_layer.c" /* a decoder layer's decode step in one call */
#include "layout.c"       /* the shared structs' layout, the ABI version */

"""Shared helpers of the torch backend's kernels: bounded query blocks and fast row gathers."""

from __future__ import annotations

import torch

# Bound on one attention call's query-proportional temporaries. A 2048-token prompt chunk at 32K
# context would otherwise hold ~4 GB of fp32 scores per softmax copy (16 heads). 64 MiB: a 2048-token
# prompt of the standard model peaks 0.07 GiB lower than with 256 MiB and is no slower (smaller blocks
# stay in cache), measured on a 2-core AVX2 CPU.
WORKSPACE_BYTES = 64 * 2**20


# Queries per block of a causal prompt's attention (the decompressed path): each block reads the keys up to its
# last query only (SegmentTensors.key_ends), so a prompt in blocks of 128 skips most of the masked half of its
# scores. 128 measured level with 32 and 64: the standard model's Q4_K_M / Q8_0 files prefill a 512-token prompt
# 10-14% faster than in one block, a 2048-token one 33-39% (2-core Xeon with AVX-512 and AMX, 2 threads).
CAUSAL_BLOCK = 128


def query_blocks(n_queries: int, bytes_per_query: int, most: int | None = None) -> list[slice]:
    """Consecutive slices of the query axis whose temporaries fit in WORKSPACE_BYTES (>= 1 query each), of at most
    `most` queries where given."""
    step = max(1, WORKSPACE_BYTES // max(1, bytes_per_query))
    step = step if most is None else min(step, most)
    return [slice(a, min(a + step, n_queries)) for a in range(0, n_queries, step)]


def head_blocks(n_heads: int, bytes_per_head: int) -> list[slice]:
    """Consecutive slices of the head axis whose temporaries fit in WORKSPACE_BYTES (>= 1 head each): the
    decompressed path's K / V expanded from the latent rows are [L, H, dn + dv] per request, sized by the context
    times every head (the standard model at 4096 tokens: ~0.2 GiB in fp32 with the copies; DeepSeek-V3's 128
    heads, 8x that), so they are built for a group of heads at a time. Heads are independent: each head's result
    is the one of a single group."""
    step = max(1, WORKSPACE_BYTES // max(1, bytes_per_head))
    return [slice(a, min(a + step, n_heads)) for a in range(0, n_heads, step)]


def score_bytes(rows_per_query: int, length: int) -> int:
    """Temporaries per query of one softmax attention: ~3 [rows, L] tensors of <= 4 bytes (the scores,
    a transposed or fp32 copy, the probabilities)."""
    return 3 * 4 * rows_per_query * length


def gather_rows(table, slots: torch.Tensor) -> torch.Tensor:
    """table[slots] for a table of rows along its first axis (cache rows; a step's queries [N, H, D] at their
    segment's token rows q_index): index_select on the flattened slots is faster on CPU than advanced indexing
    with a multi-dimensional index (the step's largest copy at long context; [8, 128] token rows of [1024, 16, 192]
    fp32 queries 0.79 -> 0.44 ms, 2 threads of an AMX Xeon; a 1-D index is as fast either way).
    A cache state kept in 8 bits (cache/quantized_rows.py QuantizedRows, kv_cache_dtype) gathers its codes and
    returns the rows dequantized in the compute dtype: every reader of the cache gets its rows here."""
    if not isinstance(table, torch.Tensor):
        return table.rows(slots)
    return torch.index_select(table, 0, slots.reshape(-1)).view(*slots.shape, *table.shape[1:])


def drop_unread_rows(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rows [N, L, C] gathered per query (its own selected rows), mask [N, 1, L]: the rows the query may not
    read set to zero, in place. A masked row gets probability 0, but 0 x NaN = NaN: a non-finite value there
    would reach the product, so rows are excluded by selection, never by a zero weight. Rows a query reads
    are untouched (bitwise)."""
    return rows.masked_fill_(~mask.any(dim=1)[..., None], 0)


def finite_values(x: torch.Tensor, causal: bool, inplace: bool = False) -> torch.Tensor:
    """The operand of P @ x (latent rows, or V) for a segment with several queries per request (`causal`): a
    query masks its own request's later rows with probability 0, and 0 x NaN = NaN would carry a later
    non-finite row into an earlier query. A row a query does read reaches it through its score (NaN or inf
    scores make that query's softmax NaN), so its values may be zeroed here. One-query segments (decode)
    mask only padding, which reads the zero pad row: x as it is, no copy. inplace: x is a fresh tensor used for
    nothing else (V of the decompressed path), so no second copy is made."""
    if not causal:
        return x
    return x.nan_to_num_(0.0, 0.0, 0.0) if inplace else x.nan_to_num(0.0, 0.0, 0.0)

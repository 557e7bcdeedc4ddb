"""What a load asks of the checkpoint's headers and of the machine before any weight is read, for resolve(): whether
the checkpoint carries DSA indexer weights (and how wide their stored values are), holds GGUF blocks, stores its
matrices in bfloat16, and whether the native kernels build (no tensor is read)."""

from __future__ import annotations


def has_indexer_weights(names: list[str]) -> bool:
    return any(".self_attn.indexer." in n for n in names)


# the per-token DSA indexer's projections of the query and the key (wq_b, wk): what its scores are made of
INDEXER_PROJECTIONS = (".self_attn.indexer.wq_b.", ".self_attn.indexer.wk.")


def indexer_bits(source) -> tuple[int, str] | None:
    """(the widest bits per stored value among the block types of the indexer's query and key projections, that
    type's name: kernels/bf16_prefill.WEIGHT_BITS) in a GGUF; float ones (F16 / BF16 / F32, which a converter leaves
    where rows do not fill whole blocks) are passed over. None where the checkpoint is not a GGUF, has no per-token
    indexer, or keeps those projections in float."""
    from mlaserve.kernels.bf16_prefill import WEIGHT_BITS

    if not hasattr(source, "gguf_type"):
        return None
    types = {source.gguf_type(n) for n in source.names() if any(p in n for p in INDEXER_PROJECTIONS)}
    blocks = [(WEIGHT_BITS.get(t, 32), t) for t in types if t not in ("F16", "BF16", "F32")]
    return max(blocks) if blocks else None


def native_probe() -> tuple[bool, str]:
    from mlaserve.kernels import native

    status = native.status()
    if not status.available:
        return False, status.detail
    return True, f"{native.isa()} kernels, {status.detail}"  # the ISA the build chose (csrc/common.h), for the record


def stored_bf16(source) -> bool:
    """Every matrix (2+ dims) of the checkpoint is stored in bfloat16 (norms and biases may be F32), so that
    dtype=auto may compute in bfloat16 without rounding a stored weight (from headers; no tensor is read)."""
    stored = source.gguf_type if hasattr(source, "gguf_type") else getattr(source, "stored_type", None)
    if stored is None:
        return False
    return all(stored(n) == "BF16" for n in source.names() if len(source.shape(n)) >= 2)


def has_gguf_blocks(source) -> bool:
    """A GGUF with block-quantized tensors (Q8_0, Q4_K, ...), not only float ones."""
    if not hasattr(source, "gguf_type"):
        return False
    return any(source.gguf_type(n) not in ("F32", "F16", "BF16") for n in source.names())

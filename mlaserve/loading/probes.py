"""What a load asks of the checkpoint's headers and of the machine before any weight is read, for resolve(): whether
the checkpoint carries DSA indexer weights, holds GGUF blocks, stores its matrices in bfloat16, and whether the
native kernels build (no tensor is read)."""

from __future__ import annotations


def has_indexer_weights(names: list[str]) -> bool:
    return any(".self_attn.indexer." in n for n in names)


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

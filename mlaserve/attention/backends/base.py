"""What an attention backend does: the four operations of MLA over the paged latent cache.

A backend is chosen per segment by the router (`Segment.backend`, recorded in the ledger) and
looked up in the registry (`attention.backends.get_backend`). Shapes as in `attention/reference.py`;
every method returns its segment's padded [B, Q, H, dv] output (or [B, Q, k] positions), and the
caller keeps the valid rows. A new kernel (quantized, CUDA) implements this protocol, registers a
name, and is tested against the reference in tests/identities/test_attention_backends.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from mlaserve.attention.metadata import SegmentTensors


class AttentionBackend(Protocol):
    name: str
    # whether the absorbed path reads the dense W_UK / W_UV views even when a GGUF's attn_k_b / attn_v_b blocks are
    # kept (`heads`): a layer whose kv_b_proj is not held (quant/transient_kv_b.py) then decodes it for the step
    reads_dense_heads: bool
    # whether decompressed() runs a prompt's scores and P V in bf16 (AMX-BF16 tiles or AVX512-BF16) when asked (`tiles`, the layer's
    # plan: MLAAttention.attention_bf16); a backend without them is never asked
    decompressed_tiles: bool

    def index_scoring(self, key_dtype: torch.dtype) -> str:
        """How index_topk scores over keys of this dtype ("fp32" or "bf16_then_fp32"): a label for the
        route, decided before the step runs."""

    def absorbed(
        self, q_nope, q_pe, cache, w_uk, w_uv, seg: SegmentTensors, scale: float, allowed=None, heads=None
    ) -> torch.Tensor:
        """MQA over the latent rows: W_UK folded into the query, W_UV applied after. heads: W_UK / W_UV
        also kept as GGUF blocks (quant.ggml_heads.GGUFHeads), which a fast backend may multiply
        instead of the dense views; the reference ignores it (the oracle reads the dense kv_b_proj)."""

    def decompressed(
        self, q_nope, q_pe, cache, kv_b, seg: SegmentTensors, scale: float, dn: int, allowed=None, tiles=False
    ) -> torch.Tensor:
        """MHA: the rows up-projected through kv_b [H * (dn + dv), r], causal attention. tiles: the scores and P V
        as bf16 products with fp32 sums (kernels/bf16_attention.py); only asked of a backend whose
        decompressed_tiles is True."""

    def sparse_absorbed(
        self, q_nope, q_pe, cache, w_uk, w_uv, seg: SegmentTensors, scale: float, index, valid, heads=None
    ) -> torch.Tensor:
        """MQA over only each query's selected positions index/valid [B, Q, k]."""

    def index_topk(self, q_idx, w, keys, seg: SegmentTensors, topk: int) -> torch.Tensor:
        """The DSA top-k positions [B, Q, min(topk, L)] of sum_h w_h ReLU(q_h . key) (set, not order)."""

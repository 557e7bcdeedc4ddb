"""kv_b_proj not held: a GGUF layer whose W_UK / W_UV are kept as attn_k_b / attn_v_b blocks (GGUFHeads)
decodes the dense matrix only for a step that reads it (the decompressed path), and drops it after the layer.

Notation: H heads, dn = qk_nope_head_dim, dv = v_head_dim, r = kv_lora_rank.
  kv_b_proj  [H * (dn + dv), r]   per head: its dn W_UK rows (attn_k_b transposed), then its dv W_UV rows
  k_b        [H, r, R_dn] uint8   attn_k_b's blocks (GGUFHeads.k_b), rows of dn values
  v_b        [H, dv, R_r] uint8   attn_v_b's blocks (GGUFHeads.v_b), rows of r values
The decode is the load-time rebuild's (gguf.read.checkpoint._join_kv_b over the native decoder, which is the
reference dequantizer bit for bit), so a step reads the same values the dense holder held. Held dense instead
(an nn.Linear) where a reader needs it at every step: the reference attention backend's absorbed path, the
torch kernels (no GGUFHeads), MTP layers.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.gguf.quants import dequantize
from mlaserve.gguf.read.checkpoint import _join_kv_b
from mlaserve.kernels.ggml import dense_native

TRANSIENT = "transient: decoded per prefill step from attn_k_b / attn_v_b (the decompressed path), dropped after"


class TransientKvB(nn.Module):
    """In place of kv_b_proj's nn.Linear: no parameter. `weight` is a meta tensor of the dense shape and dtype
    (the absorbed path takes only W_UK / W_UV's shapes from it; reading its values fails loudly)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.empty(out_features, in_features, dtype=dtype, device="meta")

    def decode(self, heads: nn.Module, bf16: bool = False) -> torch.Tensor:
        """heads: the layer's GGUFHeads -> kv_b_proj's weight [H * (dn + dv), r] in the model's dtype (bf16: the
        same values rounded to bf16, for a bf16 expansion), a new tensor (the caller drops it after its step)."""
        h, r, dn = heads.heads, heads.r, heads.dn
        k_b = _decode(heads.k_b, heads.type_k, (h, r, dn))  # [H, r, dn]
        v_b = _decode(heads.v_b, heads.type_v, (h, heads.v_b.shape[1], r))  # [H, dv, r]
        w = _join_kv_b(k_b, v_b)
        if w.shape != self.weight.shape:
            raise RuntimeError(
                f"kv_b_proj decoded from attn_k_b / attn_v_b is {tuple(w.shape)}, not {tuple(self.weight.shape)}"
            )
        return w.to(device=heads.k_b.device, dtype=torch.bfloat16 if bf16 else self.weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TRANSIENT}"


def _decode(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The loader's decoder (model_loader._decode_natively: the native one, else the reference) on a CPU tensor."""
    flat = raw.reshape(-1)
    if flat.device.type == "cpu":
        out = dense_native(flat, ggml_type, shape)
        if out is not None:
            return out
    return dequantize(flat, ggml_type, shape)


def drop_dense(model: nn.Module, layers: tuple[int, ...], dtype: torch.dtype) -> None:
    """Before the fill (on the meta device): each listed layer's kv_b_proj replaced by a TransientKvB, so its
    dense weight is never allocated."""
    for layer in layers:
        attn = model.model.layers[layer].self_attn
        old = attn.kv_b_proj
        attn.kv_b_proj = TransientKvB(old.in_features, old.out_features, dtype)

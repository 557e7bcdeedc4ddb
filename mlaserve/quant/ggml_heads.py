"""W_UK and W_UV kept as a GGUF's attn_k_b / attn_v_b blocks (GGUFHeads): the absorbed path's per-head products
read them quantized, and the kernel plan's rules for a prompt's K / V expansion and attention (bf16, the AMX-BF16
tiles) are decided here from their types and the latent weight's.

Notation: H heads, r kv_lora_rank, dn qk_nope_head_dim, dv v_head_dim, R_k bytes of a stored row of k columns
  k_b [H, r, R_dn]  per head the [r, dn] matrix: q_lat[h] = k_b[h] @ q_nope[h]
  v_b [H, dv, R_r]  per head the [dv, r] matrix: o[h] = v_b[h] @ o_lat[h]
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import bf16_attention, bf16_prefill, ggml, int16_prefill, native, registry
from mlaserve.quant.ggml_linear import plan_note


class GGUFHeads(registry.KernelSwitch, nn.Module):
    """W_UK and W_UV of absorbed attention kept as the file's attn_k_b / attn_v_b blocks, so that a decode
    step reads them quantized (a fourth of the fp32 bytes for Q8_0) instead of the dense kv_b_proj
    rebuilt from them (held for the reference backend; else decoded per prefill step: quant/transient_kv_b.py);
    k_b and v_b as in the notation above.
    Heads are the groups of a grouped product (kernels.ggml.expert_linear): group h is head h's rows."""

    KERNEL_OP = "heads"
    KERNELS = ggml.KERNELS
    KERNEL_CALLS = {"per_head": {"native": "_per_head_native", "torch": "_per_head_torch"}}
    # decode: rows per head up to GEMV_ROWS straight to the grouped GEMV; more: kernels.ggml.expert_linear_native
    NATIVE_ROWS, NATIVE_UNIT, NATIVE_FALLBACK = ggml.GEMV_ROWS, "rows per head", "native decode, then grouped GEMMs"

    def __init__(
        self,
        k_b: torch.Tensor,
        type_k: int,
        v_b: torch.Tensor,
        type_v: int,
        dn: int,
        r: int,
        type_latent: int | None = None,
    ) -> None:
        super().__init__()
        self.type_k, self.type_v, self.dn, self.r, self.kernel, self.int8 = type_k, type_v, dn, r, "torch", False
        # the ggml type of the weight whose product the expanded latent rows are (the layer's kv_a_proj_with_mqa,
        # kept in its blocks), None where that weight is a float one
        self.type_latent = type_latent
        self.bf16_k = self.bf16_v = False  # prefill products in bf16, per matrix (set_prefill_bf16)
        # whether the setting admits plain bf16 for both matrices, and for the latent weight (set_prefill_bf16)
        self.admits_bf16 = self.latent_admits_bf16 = False
        self.k_b = nn.Parameter(k_b, requires_grad=False)
        self.v_b = nn.Parameter(v_b, requires_grad=False)
        self.heads = k_b.shape[0]
        self._group_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _per_head_native(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, bf16: int) -> torch.Tensor:
        """x [N, H, k] -> [N, H, out]: head h's rows times head h's matrix, by the C kernels (bf16: the matrix's
        many-rows products in bf16, the plan's choice for it)."""
        n, h = x.shape[0], self.heads
        xs = x.float().transpose(0, 1).reshape(h * n, k)  # grouped by head
        if n <= self.NATIVE_ROWS and int16_prefill.takes_rest(ggml_type, self.int8):  # decode, int16 activations
            heads, offs = self._offsets(n, x.device)
            y = int16_prefill.grouped(xs.contiguous(), (w,), ggml_type, k, heads, offs)
        elif n <= self.NATIVE_ROWS:  # decode: straight to the grouped GEMV
            heads, starts = self._groups(n)
            y = native.grouped_gemm(ggml_type, xs.contiguous(), w, k, heads, starts, int8=self.int8)
        else:
            y = ggml.expert_linear_native(xs, w, ggml_type, k, *self._offsets(n, x.device), self.int8, bf16)
        return y.view(h, n, -1).transpose(0, 1)

    def _per_head_torch(self, x: torch.Tensor, w: torch.Tensor, ggml_type: int, k: int, bf16: int) -> torch.Tensor:
        """The reference of _per_head_native: one grouped GEMM over the dequantized heads (exact: bf16 is the
        native path's only, and the plan sets it only there)."""
        n, h = x.shape[0], self.heads
        xs = x.float().transpose(0, 1).reshape(h * n, k)
        y = ggml.expert_linear_torch(xs, w, ggml_type, k, *self._offsets(n, x.device))
        return y.view(h, n, -1).transpose(0, 1)

    def _offsets(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(heads [H], offs [H] int32): the groups of n rows per head, as kernels.ggml.expert_linear takes them."""
        h = self.heads
        return torch.arange(h, device=device), torch.arange(1, h + 1, device=device, dtype=torch.int32) * n

    def _groups(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(heads [H], starts [H + 1]) int64 for n rows per head, kept per n (small tensors a decode step
        would otherwise build twice per layer)."""
        if n not in self._group_index:
            h = self.heads
            self._group_index[n] = (torch.arange(h), torch.arange(h + 1) * n)
        return self._group_index[n]

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, dn] -> q_nope W_UK: [N, H, r] in q_nope's dtype."""
        return self.per_head(q_nope, self.k_b, self.type_k, self.dn, self.bf16_k).to(q_nope.dtype)

    def expand(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [..., H, r] -> o_lat W_UV^T: [..., H, dv] in o_lat's dtype."""
        lead = o_lat.shape[:-2]
        y = self.per_head(o_lat.reshape(-1, self.heads, self.r), self.v_b, self.type_v, self.r, self.bf16_v)
        return y.reshape(*lead, self.heads, -1).to(o_lat.dtype)

    def set_prefill_bf16(self, cap: int) -> None:
        """The KernelPlan's bf16 prefill setting, decided once per matrix."""
        self.bf16_k, self.bf16_v = bf16_prefill.takes_bf16(self.type_k, cap), bf16_prefill.takes_bf16(self.type_v, cap)
        self.admits_bf16 = all(bf16_prefill.admits_bf16(t, cap) for t in (self.type_k, self.type_v))
        self.latent_admits_bf16 = self.type_latent is not None and bf16_prefill.admits_bf16(self.type_latent, cap)

    def expansion_bf16(self) -> bool:
        """Whether the decompressed path's K / V expansion (latent rows times the dense kv_b rebuilt from both
        matrices) runs in bf16: where the plan's setting admits plain bf16 for both matrices' prefill products (the
        rule, for this product of the same weights; their own products may take int16 activations instead, finer and
        faster on such CPUs: kernels/int16_prefill.py). Q8_0 and fp32 keep it fp32."""
        return self.admits_bf16

    def attention_tiles(self) -> bool:
        """Whether the decompressed attention's scores and P V run as bf16 products on the AMX-BF16 tiles or, where
        the process has none, AVX512-BF16 dot products (kernels/bf16_attention.unit; MLAAttention.attention_bf16 adds
        the step's condition). Where the process has either, and either
        - the K / V expansion runs in bf16 (expansion_bf16): K's nope half and V are bf16 values then, the tiles
          round only q, k_pe and P; or
        - the latent rows it expands are the product of a weight for which the plan's setting admits plain bf16 (the
          layer's kv_a_proj_with_mqa, 6 bits or fewer under auto): every K and V value then carries that weight's own
          quantization error, and the tiles' bf16 rounding of the expansion's operands and of K and V adds errors
          of the grade the first case accepts (2^-9 relative each; tests/kernels/test_bf16_attention.py: on a file
          where only this case holds they move each prompt position's logits by 0.78% (median) against the file's
          own 22%)."""
        if not bf16_attention.granted():
            return False
        return self.expansion_bf16() or self.latent_admits_bf16

    def native_detail(self) -> str:
        note = plan_note({"k_b": self.type_k, "v_b": self.type_v}, self.int8, (self.bf16_k, self.bf16_v), grouped=True)
        # MLAAttention.expansion_bf16 / attention_bf16: in every step no backend of which reads the dense halves
        tiles = f", its attention on the {bf16_attention.unit_detail()}" if self.attention_tiles() else ""
        if self.expansion_bf16():
            return f"{note}; the decompressed K / V expansion in bf16{tiles}"
        if tiles:
            latent = GGML_TYPES[self.type_latent].name
            return f"{note}; the decompressed attention on the {bf16_attention.unit_detail()} (its latent rows from a {latent} weight in bf16 prefill)"
        return note

    def extra_repr(self) -> str:
        return f"heads={self.heads}, k_b={GGML_TYPES[self.type_k].name}, v_b={GGML_TYPES[self.type_v].name}"

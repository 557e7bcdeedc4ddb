"""A MoE layer's decode step in one native call (GGUFMoEBlock, kernels/csrc/moe/block.c) where its routed experts
are GGUF block holders (quant/ggml_linear.py GGUFExperts) or INT4 pack-quantized experts, and the kernel plan's
"moe_block" op that attaches it (registered here: native, else per_op).
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.kernels import native, native_layers, registry
from mlaserve.models.layers import SwiGLU
from mlaserve.models.moe import MoE
from mlaserve.quant.ggml_linear import BLOCK_TOKENS, GGUFExperts, native_rows, rows_args
from mlaserve.quant.int4_experts import INT4Experts


class GGUFMoEBlock:
    """A MoE layer's decode step in one native call (kernels/csrc/moe/block.c mls_moe_block): the gate's logits, the router,
    the routed experts grouped by expert, the shared expert and their sum, instead of ~10 native calls and ~30
    tensor ops. Attached by the loader (attach_moe_blocks) where the routed experts are a ggml-block holder (int8
    activations where the per-op path has them) or INT4 pack-quantized experts (quant/int4_experts.py: their
    decode-and-dot, scales beside the words), run by the native kernels, and the shared expert ggml blocks or
    fp32 rows; MoE.forward calls it. Its contract: steps
    of up to BLOCK_TOKENS contiguous fp32 tokens; it hands any other step to the layer's per-op path (its declared
    fallback and reference, tests/kernels/test_moe_block.py). For the same routing
    its routed sum equals GGUFExperts' native one bit for bit; the gate's logits and the shared expert's silu
    round as fp32 does in another order."""

    max_tokens = BLOCK_TOKENS

    def __init__(self, moe: MoE) -> None:
        gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
        cfg = gate.cfg
        bias = gate.e_score_correction_bias
        a = native_layers.MoEBlockArgs()
        g, u, dn = _gate_up_stacks(ex)  # rows of bytes (ggml blocks) or of int32 words (INT4)
        d, inter = dn.shape[1], g.shape[1]
        a.d, a.e, a.kk, a.inter = d, cfg.n_routed_experts, cfg.num_experts_per_tok, inter
        a.gate_w, a.bias = gate.weight.data_ptr(), bias.data_ptr() if bias is not None else None
        a.scoring, a.method = native.SCORING[cfg.scoring_func], native.TOPK_METHOD[cfg.topk_method]
        a.n_group, a.topk_group, a.norm, a.scale = (
            cfg.n_group,
            cfg.topk_group,
            int(cfg.norm_topk_prob),
            cfg.routed_scaling_factor,
        )
        a.gate, a.up, a.down = g.data_ptr(), u.data_ptr(), dn.data_ptr()
        a.gu_expert_stride, a.gu_row_bytes = g.stride(0) * g.element_size(), g.shape[2] * g.element_size()
        a.dn_expert_stride, a.dn_row_bytes = dn.stride(0) * dn.element_size(), dn.shape[2] * dn.element_size()
        keep = [gate.weight, bias, g, u, dn]
        if isinstance(ex, INT4Experts):
            a.type_gu = a.type_dn = native.INT4_PACKED
            s_gu, s_dn = ex.gate_up_proj_scale, ex.down_proj_scale  # [E, 2, I, D/g], [E, D, I/g] fp32
            a.gu_scale, a.dn_scale, a.group = s_gu.data_ptr(), s_dn.data_ptr(), ex.group
            a.gu_scale_stride, a.dn_scale_stride = s_gu[0].numel(), s_dn[0].numel()
            keep += [s_gu, s_dn]
        else:
            a.type_gu, a.type_dn = ex.type_gate_up, ex.type_down
        if sh is not None:
            a.shared_inter = sh.gate_proj.out_features
            g, u, dn = (rows_args(m) for m in (sh.gate_proj, sh.up_proj, sh.down_proj))
            a.type_sg, a.type_su, a.type_sd = g.type, u.type, dn.type
            a.sg, a.su, a.sd = g.w, u.w, dn.w
            a.sg_row_bytes, a.su_row_bytes, a.sd_row_bytes = g.row_bytes, u.row_bytes, dn.row_bytes
            keep += [m.weight for m in (sh.gate_proj, sh.up_proj, sh.down_proj)]
        a.int8 = native.act_setting(getattr(ex, "int8", False))  # INT4 experts have no int8-activation kernel
        self.args, self._tensors = a, tuple(keep)  # the tensors the C struct points into stay alive with it
        self.fallback = moe.per_op

    @staticmethod
    def unfit(moe: MoE) -> str | None:
        """Why this MoE layer cannot run as one native block, or None."""
        gate, ex, sh = moe.gate, moe.experts, moe.shared_experts
        if moe.expert_shard is not None:
            return "expert parallel: this rank's experts' partial sum is all-reduced between the ops (per op)"
        if (
            not isinstance(ex, (GGUFExperts, INT4Experts))
            or not registry.runs_native(ex)
            or ex.impl != "grouped_mm"
            or not registry.runs_native(gate)
        ):
            return "routed experts or router not ggml blocks / INT4 experts with the native kernels"
        int8 = getattr(ex, "int8", False)
        parts = (sh.gate_proj, sh.up_proj, sh.down_proj) if isinstance(sh, SwiGLU) else ()
        if sh is not None and not (parts and all(native_rows(m, int8) for m in parts)):
            return "shared expert not ggml blocks with the native kernels and the routed experts' activations"
        g, u, dn = _gate_up_stacks(ex)
        tensors = [gate.weight, g, u, dn, *(m.weight for m in parts)]
        bias = gate.e_score_correction_bias
        if any(t.device.type != "cpu" for t in tensors) or gate.weight.dtype != torch.float32:
            return "weights not on the CPU, or the gate not fp32"
        if not gate.weight.is_contiguous() or (
            bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())
        ):
            return "gate weight / correction bias not contiguous fp32"
        if any(w.stride(2) != 1 or w.stride(1) != w.shape[2] for w in (g, u, dn)) or g.stride(0) != u.stride(0):
            return "expert rows not contiguous, or gate and up stacks of different expert strides"
        if isinstance(ex, INT4Experts) and not (
            ex.gate_up_proj_scale.is_contiguous() and ex.down_proj_scale.is_contiguous()
        ):
            return "INT4 expert scales not contiguous"
        return None  # the router's own limits: the gate runs native only where Gate.native_unfit passed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_tokens or x.dtype != torch.float32 or not x.is_contiguous():
            return self.fallback(x)  # prefill (or an input outside the C call's contract): the per-op path
        return native_layers.moe_block(self.args, x)


def _gate_up_stacks(ex: GGUFExperts | INT4Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, R], up [E, I, R], down): GGUFExperts' own stacks; INT4Experts' fused gate_up_proj's halves
    (views: the C struct reads each at its address, the same expert stride)."""
    if isinstance(ex, GGUFExperts):
        return ex.gate_proj, ex.up_proj, ex.down_proj
    i = ex.gate_up_proj.shape[1] // 2
    return ex.gate_up_proj[:, :i], ex.gate_up_proj[:, i:], ex.down_proj


def _moe_block_fits(moe: MoE, ctx: registry.KernelContext) -> str | None:
    return registry.needs_native(ctx) or GGUFMoEBlock.unfit(moe)


def _attach_block(moe: MoE, ctx: registry.KernelContext) -> None:
    moe.native_block = GGUFMoEBlock(moe)


def _per_op_block(moe: MoE, ctx: registry.KernelContext) -> None:
    moe.native_block = None


def _block_contract(moe: MoE) -> str:
    return f"one call for steps of up to {GGUFMoEBlock.max_tokens} fp32 tokens, else per_op"


registry.register("moe_block", "native", _moe_block_fits, _attach_block, _block_contract)
registry.register("moe_block", "per_op", registry.always, _per_op_block)


def attach_moe_blocks(model: nn.Module) -> int:
    """After the fill and the kernel choice: every MoE layer that fits gets its GGUFMoEBlock. -> how many."""
    n = 0
    for module in model.modules():
        if isinstance(module, MoE) and GGUFMoEBlock.unfit(module) is None:
            module.native_block = GGUFMoEBlock(module)
            n += 1
    return n

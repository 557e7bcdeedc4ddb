"""A MoE layer's decode step in one native call (GGUFMoEBlock, kernels/csrc/moe/block.c) where its routed experts
are GGUF block holders (quant/ggml_linear.py GGUFExperts) or INT4 pack-quantized experts, and the kernel plan's
"moe_block" op that attaches it (registered here: native, else per_op). Two layer kinds take it: the MLA families'
MoE (models/moe.py: softmax / sigmoid scores, group-limited top-k) and DeepSeek-V4's V4MoEBlock
(models/deepseek_v4/moe.py: sqrt(softplus) scores, greedy top-k or hash routing by token id, the SwiGLU clamped at
swiglu_limit), each read into the C struct's router fields by `_router`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mlaserve.kernels import native, native_layers, registry
from mlaserve.models.deepseek_v4.moe import SharedExpert, V4MoEBlock
from mlaserve.models.layers import SwiGLU
from mlaserve.models.moe import MoE
from mlaserve.quant.ggml_linear import BLOCK_TOKENS, GGUFExperts, native_rows, rows_args
from mlaserve.quant.int4_experts import INT4Experts


@dataclass(frozen=True)
class BlockRouter:
    """A MoE layer's router as the C struct reads it (mls_moe_block_t's router fields)."""

    weight: torch.Tensor  # [E, D] fp32
    bias: torch.Tensor | None  # [E] fp32: the choice's correction bias, or None
    tid2eid: torch.Tensor | None  # [vocab, k] int64: hash routing by token id, or None (learned)
    scoring: str  # native.SCORING
    method: str  # native.TOPK_METHOD
    n_group: int
    topk_group: int
    k: int
    norm: bool
    scale: float
    limit: float  # swiglu_limit of the routed and shared experts (inf: the plain SwiGLU)
    native: bool  # whether the layer's router itself runs the native kernels (a V4 router has one implementation)


def _router(moe: MoE | V4MoEBlock) -> BlockRouter:
    gate = moe.gate
    limit = getattr(moe.experts, "swiglu_limit", math.inf)
    if isinstance(moe, V4MoEBlock):  # always renormalised (norm_topk_prob is not read), no groups
        hashed = gate.hashed
        bias, table = (None, gate.tid2eid) if hashed else (gate.e_score_correction_bias, None)
        return BlockRouter(gate.weight, bias, table, "sqrt_softplus", "greedy", 1, 1, gate.top_k, True,
                           gate.scaling, limit, True)  # fmt: skip
    c = gate.cfg
    return BlockRouter(gate.weight, gate.e_score_correction_bias, None, c.scoring_func, c.topk_method, c.n_group,
                       c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor, limit,
                       registry.runs_native(gate))  # fmt: skip


def _shared_parts(sh: nn.Module | None) -> tuple[nn.Module, ...]:
    """The shared expert's (gate_proj, up_proj, down_proj) where it is a SwiGLU of linear holders (the MLA
    families' SwiGLU, DeepSeek-V4's SharedExpert), else ()."""
    return (sh.gate_proj, sh.up_proj, sh.down_proj) if isinstance(sh, (SwiGLU, SharedExpert)) else ()


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

    def __init__(self, moe: MoE | V4MoEBlock) -> None:
        ex, sh, r = moe.experts, moe.shared_experts, _router(moe)
        a = native_layers.MoEBlockArgs()
        g, u, dn = _gate_up_stacks(ex)  # rows of bytes (ggml blocks) or of int32 words (INT4)
        d, inter = dn.shape[1], g.shape[1]
        a.d, a.e, a.kk, a.inter = d, r.weight.shape[0], r.k, inter
        a.gate_w, a.bias = r.weight.data_ptr(), r.bias.data_ptr() if r.bias is not None else None
        a.scoring, a.method = native.SCORING[r.scoring], native.TOPK_METHOD[r.method]
        a.n_group, a.topk_group, a.norm, a.scale = r.n_group, r.topk_group, int(r.norm), r.scale
        a.limit = r.limit
        if r.tid2eid is not None:
            a.tid2eid, a.vocab = r.tid2eid.data_ptr(), r.tid2eid.shape[0]
        self.hashed = r.tid2eid is not None  # the call hands the step's token ids to the C router
        a.gate, a.up, a.down = g.data_ptr(), u.data_ptr(), dn.data_ptr()
        a.gu_expert_stride, a.gu_row_bytes = g.stride(0) * g.element_size(), g.shape[2] * g.element_size()
        a.dn_expert_stride, a.dn_row_bytes = dn.stride(0) * dn.element_size(), dn.shape[2] * dn.element_size()
        keep = [r.weight, r.bias, r.tid2eid, g, u, dn]
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
            g, u, dn = (rows_args(m) for m in _shared_parts(sh))
            a.type_sg, a.type_su, a.type_sd = g.type, u.type, dn.type
            a.sg, a.su, a.sd = g.w, u.w, dn.w
            a.sg_row_bytes, a.su_row_bytes, a.sd_row_bytes = g.row_bytes, u.row_bytes, dn.row_bytes
            keep += [m.weight for m in (sh.gate_proj, sh.up_proj, sh.down_proj)]
        a.int8 = native.act_setting(getattr(ex, "int8", False))  # INT4 experts have no int8-activation kernel
        self.args, self._tensors = a, tuple(keep)  # the tensors the C struct points into stay alive with it
        self.fallback = moe.per_op

    @staticmethod
    def unfit(moe: MoE | V4MoEBlock) -> str | None:
        """Why this MoE layer cannot run as one native block, or None."""
        ex, sh, r = moe.experts, moe.shared_experts, _router(moe)
        if moe.expert_shard is not None:
            return "expert parallel: this rank's experts' partial sum is all-reduced between the ops (per op)"
        if (
            not isinstance(ex, (GGUFExperts, INT4Experts))
            or not registry.runs_native(ex)
            or ex.impl != "grouped_mm"
            or not r.native
        ):
            return "routed experts or router not ggml blocks / INT4 experts with the native kernels"
        int8 = getattr(ex, "int8", False)
        parts = _shared_parts(sh)
        if sh is not None and not (parts and all(native_rows(m, int8) for m in parts)):
            return "shared expert not ggml blocks with the native kernels and the routed experts' activations"
        shared_limit = getattr(sh, "limit", None)
        if sh is not None and (math.inf if shared_limit is None else shared_limit) != r.limit:
            return f"the shared expert's swiglu_limit differs from the routed experts' ({r.limit})"
        g, u, dn = _gate_up_stacks(ex)
        tensors = [r.weight, g, u, dn, *(m.weight for m in parts)]
        bias, table = r.bias, r.tid2eid
        if any(t.device.type != "cpu" for t in tensors) or r.weight.dtype != torch.float32:
            return "weights not on the CPU, or the gate not fp32"
        if not r.weight.is_contiguous() or (
            bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous())
        ):
            return "gate weight / correction bias not contiguous fp32"
        if table is not None and (table.dtype != torch.int64 or not table.is_contiguous() or table.shape[1] != r.k):
            return "hash-routing table not contiguous int64 [vocab, k]"
        if any(w.stride(2) != 1 or w.stride(1) != w.shape[2] for w in (g, u, dn)) or g.stride(0) != u.stride(0):
            return "expert rows not contiguous, or gate and up stacks of different expert strides"
        if isinstance(ex, INT4Experts) and not (
            ex.gate_up_proj_scale.is_contiguous() and ex.down_proj_scale.is_contiguous()
        ):
            return "INT4 expert scales not contiguous"
        return None  # the router's own limits: the gate runs native only where Gate.native_unfit passed

    def __call__(self, x: torch.Tensor, *token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D]; token_ids: DeepSeek-V4's layers pass the step's [T] (its hash layers route by them)."""
        if x.shape[0] > self.max_tokens or x.dtype != torch.float32 or not x.is_contiguous():
            return self.fallback(x, *token_ids)  # prefill (or an input outside the C call's contract): the per-op path
        ids = token_ids[0].to(torch.int64).contiguous() if self.hashed else None
        return native_layers.moe_block(self.args, x, ids=ids)


def _gate_up_stacks(ex: GGUFExperts | INT4Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, R], up [E, I, R], down): GGUFExperts' own stacks; INT4Experts' fused gate_up_proj's halves
    (views: the C struct reads each at its address, the same expert stride)."""
    if isinstance(ex, GGUFExperts):
        return ex.gate_proj, ex.up_proj, ex.down_proj
    i = ex.gate_up_proj.shape[1] // 2
    return ex.gate_up_proj[:, :i], ex.gate_up_proj[:, i:], ex.down_proj


def _moe_block_fits(moe: MoE | V4MoEBlock, ctx: registry.KernelContext) -> str | None:
    return registry.needs_native(ctx) or GGUFMoEBlock.unfit(moe)


def _attach_block(moe: MoE | V4MoEBlock, ctx: registry.KernelContext) -> None:
    moe.native_block = GGUFMoEBlock(moe)


def _per_op_block(moe: MoE | V4MoEBlock, ctx: registry.KernelContext) -> None:
    moe.native_block = None


def _block_contract(moe: MoE | V4MoEBlock) -> str:
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

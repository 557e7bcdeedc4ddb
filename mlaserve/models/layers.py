"""Small building blocks: RMSNorm, rotary embeddings (interleaved and half-split, YaRN), SwiGLU MLP, the token
embedding table.

Notation
  T   tokens in the step (flat, no batch dimension)
  d   rope width (qk_rope_head_dim), pairs d/2
  x   [T, ..., d] the rotary slice of a query or key
Interleaved rope rotates pairs (x0, x1), (x2, x3), ...; half-split rotates (x_i, x_{i+d/2}).
Interleaved output is written de-interleaved ([even', odd']), as transformers does: every dot
product between two rotated vectors is unchanged, so queries and cached keys agree.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config.model import RopeConfig
from mlaserve.kernels import native_layers, registry
from mlaserve.kernels.registry import KernelContext, KernelSwitch


class RMSNorm(KernelSwitch, nn.Module):
    KERNEL_OP = "norm"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("native", "torch")  # native: one C call (kernels/native.py rms_norm) for fp32 on the CPU
    KERNEL_CALLS = {"norm": {"native": "_norm_native", "torch": "_norm_torch"}}

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = "torch"  # the reference; the loader sets the engine's kernels (binds self.norm)

    def native_unfit(self) -> str | None:
        """The native norm's load-time check: an fp32 weight on the CPU (the KernelPlan records the reason)."""
        w = self.weight
        return None if w.dtype == torch.float32 and w.device.type == "cpu" else "norm weight not fp32 on the CPU"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def _norm_native(self, x: torch.Tensor) -> torch.Tensor:
        """One C call; its contract on the step's input: fp32 rows of unit stride (else the reference)."""
        if not _native_fits(x):
            return self._norm_torch(x)
        # torch composes an fp32 rms_norm from ~6 ops (~30 us for one decode row here, 49 per step of
        # the standard model); the C call is one, equal up to the rounding of the sum of squares
        return native_layers.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def _norm_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The reference. Normalise in fp32, scale in the model dtype. In fp32 the weight goes into the same op:
        x * rsqrt(mean(x^2) + eps) * w, the reference's products in its order (bit for bit), one op instead of
        two (half the time of a decode-step norm)."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def embedding(vocab: int, dim: int) -> nn.Embedding:
    """nn.Embedding(vocab, dim) [V, D] whose random init runs only on a real device. The loader builds models on
    the meta device, where nn.Embedding's normal_ is torch's Python reference (torch._refs), whose first call
    imports torch._dynamo: 16 s and +0.14 GiB RSS (+0.08 anonymous) measured on an idle CPU, for a table the
    loader then fills. On a real device the same normal_ draws the same values as nn.Embedding's own init."""
    table = nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim))
    if table.weight.device.type != "meta":
        with torch.no_grad():
            nn.init.normal_(table.weight)
    return table


def _native_fits(x: torch.Tensor) -> bool:
    """The native fp32 glue kernels' contract on a step's input (the weight was checked at load): fp32 CPU
    rows, unit stride along the last dim."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM-5.3-Flash's (and DeepSeek-V4's) clamps: silu(min(gate, L)) * clamp(up, -L, L)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_into(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """swiglu (limit None) or clamped_swiglu computed in gate's memory, up clamped in its own: the same values (each
    op rounds once either way). gate and up must be the caller's own fresh tensors. Why: at a 2,048-token prefill
    step a dense MLP of intermediate 10944 held gate, up, silu(gate) and their product at once, 85.5 MiB each."""
    if limit is not None:
        gate.clamp_(max=limit)
        up.clamp_(min=-limit, max=limit)
    return F.silu(gate, inplace=True).mul_(up)


def activation(limit: float | None):
    """The SwiGLU product a config names, chosen once at construction: clamped at `limit` (swiglu_limit), or plain."""
    return swiglu if limit is None else functools.partial(clamped_swiglu, limit=limit)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts (limit: the clamps, activation()).

    A long step (prefill) may run in parts of `row_part` rows (the KernelPlan's mlp_rows: where every projection
    reads its weight's blocks in place, so a part costs no second decode of a weight): each row's products are the
    same in a part as in the whole step, and the step's gate and up outputs ([T, I] fp32 each: 90 MB apiece at
    2,048 tokens of a 10,944-wide dense MLP, the peak of such a step) shrink to a part's."""

    KERNEL_OP = "mlp_rows"  # kernels/registry.py chooses `row_part` at load (the KernelPlan)

    def __init__(self, hidden: int, inter: int, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = activation(limit)
        self.limit = limit
        self.row_part: int | None = None  # rows per call of a longer step (the plan's), None: the whole step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.row_part
        if rows is not None and x.numel() > rows * x.shape[-1] and not self._hooked():
            return self._in_parts(x, rows)
        return self._whole(x)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        # out of place where autograd keeps the inputs, or a forward hook may have kept the projections' outputs
        if gate.requires_grad or up.requires_grad or self.gate_proj._forward_hooks or self.up_proj._forward_hooks:
            h = self.act(gate, up)
        else:
            h = swiglu_into(gate, up, self.limit)
        # the names dropped before the down projection: up's [T, I] (and gate's, where h is a new tensor) is freed
        # instead of held beside the down projection's own temporaries (42 MiB at 1,024 tokens of a 10,944-wide MLP)
        del gate, up
        return self.down_proj(h)

    def _hooked(self) -> bool:
        """A hook on a projection sees its whole step's tensors: such a step runs whole."""
        return any(p._forward_hooks or p._forward_pre_hooks for p in (self.gate_proj, self.up_proj, self.down_proj))

    def _in_parts(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The step's rows in the fewest parts of at most `rows` each, their sizes within one row of each other,
        written into one output."""
        flat = x.reshape(-1, x.shape[-1])
        t = flat.shape[0]
        size, extra = divmod(t, -(-t // rows))
        out = torch.empty(t, self.down_proj.out_features, dtype=x.dtype, device=x.device)
        a = 0
        while a < t:
            b = a + size + (extra > 0)
            extra -= 1
            out[a:b] = self._whole(flat[a:b])
            a = b
        return out.view(*x.shape[:-1], -1)

    def part_rows(self) -> int:
        """Rows per part: the part's fp32 input, gate and up outputs and output within ROW_PART_BYTES, at least
        ROW_PART_MIN rows (the products' rates level from there)."""
        per_row = 4 * (2 * self.gate_proj.in_features + 2 * self.gate_proj.out_features)
        return max(ROW_PART_MIN, ROW_PART_BYTES // per_row)


# A SwiGLU's parts (SwiGLU.part_rows): the activations of the routed experts' chunks (kernels/ggml.py
# MOE_CHUNK_BYTES); 256 rows and more keep the int8 / int16 prefill products at their rate (benchmarks/README.md,
# the panels' and int16 products' rows).
ROW_PART_BYTES = 32 << 20
ROW_PART_MIN = 256


def _row_parts_fit(mlp: SwiGLU, ctx: KernelContext) -> str | None:
    rows = mlp.part_rows()
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = getattr(mlp, name)
        reads = getattr(proj, "prefill_reads_in_place", None)  # GGUF block holders (quant/ggml_linear.py)
        if reads is None:
            return f"{name}: {type(proj).__name__} (its own products per call)"
        why = reads(rows)
        if why is not None:
            return f"{name} at {rows} rows: {why}"
    return None


def _set_row_part(mlp: SwiGLU, ctx: KernelContext) -> None:
    mlp.row_part = mlp.part_rows()


def _row_part_note(mlp: SwiGLU) -> str:
    return f"steps of over {mlp.row_part} rows in parts of at most that (each projection reads its blocks in place)"


def _whole_steps(mlp: SwiGLU, ctx: KernelContext) -> None:
    mlp.row_part = None


registry.register("mlp_rows", "row_parts", _row_parts_fit, _set_row_part, _row_part_note)
registry.register("mlp_rows", "whole", registry.always, _whole_steps)


def rope_inv_freq(rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [d/2], YaRN-corrected when configured (same arithmetic as transformers)."""
    d = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d)
    if rope.rope_type != "yarn":
        return 1.0 / pos_freqs
    low, high = _yarn_correction_range(rope)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp  # 1 where the dim keeps its original frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_correction_range(rope: RopeConfig) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        ctx = rope.original_max_position_embeddings
        return (rope.dim * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rope.dim - 1)


class RotaryEmbedding(nn.Module):
    """cos/sin per position, computed on demand from positions (no length cap)."""

    def __init__(self, rope: RopeConfig, interleaved: bool | None = None) -> None:
        super().__init__()
        self.interleaved = rope.interleaved if interleaved is None else interleaved
        self.scale = rope.attention_factor
        # A plain attribute, not a buffer: it is derived from the config, never loaded, and must
        # survive building the module on the meta device.
        self.inv_freq = rope_inv_freq(rope)
        # NoPE (Kimi-Linear's MLA): the rope slice is kept and never rotated. cos 1, sin 0 make every rotation the
        # identity bit for bit (x * 1 - y * 0 = x), so the torch and native latent writes need no other path
        self.identity = rope.rope_type == "none"

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] -> cos, sin each [T, d/2] (fp32 angles, cast to the compute dtype like the reference)."""
        if self.identity:
            shape = (positions.shape[0], self.inv_freq.shape[0])
            return torch.ones(shape, dtype=dtype, device=positions.device), torch.zeros(
                shape, dtype=dtype, device=positions.device
            )
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, self.interleaved)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., d]; cos/sin [T, d/2] broadcast over the middle dims."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

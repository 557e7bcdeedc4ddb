"""Holders of GGUF weights kept in llama.cpp's block formats (Q8_0, Q4_0, Q4_K, ...): the same
interface as FP8Linear / FP8Experts (quant/linear.py), with the matmuls behind kernels/ggml.py.

Notation: K in features, N out features, R = row_bytes(type, K) bytes of a stored row (a row is
a whole number of blocks, so it is an independent byte range); D hidden, I expert intermediate,
E experts, V vocabulary.
  GGUFLinear     weight [N, R] uint8: the file's bytes of the [N, K] matrix
  GGUFExperts    gate_proj [E, I, R_D], up_proj [E, I, R_D], down_proj [E, D, R_I]: the file's three stacks
                 (ffn_gate_exps, ffn_up_exps, ffn_down_exps), each kept where it lies in the mapped file (no
                 fused [E, 2I] copy: the kernels take gate and up at their own addresses); gate/up share one
                 ggml type, down may have another (Q4_K_M files mix them)
  GGUFEmbedding  weight [V, R] uint8; a lookup dequantizes only the rows it reads
The attention's attn_k_b / attn_v_b holder is quant/ggml_heads.py's GGUFHeads; a MoE layer of these holders runs a
decode step as one native call through quant/ggml_moe_block.py's GGUFMoEBlock.
Every product runs in fp32 (kernels.ggml: exact dequantized weights, fp32 accumulation) and is
rounded to the activation dtype, so with dtype float32 a holder equals F.linear over its
dequantize() up to fp32 summation order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.gguf.quants import GGML_TYPE_IDS, GGML_TYPES
from mlaserve.kernels import (
    bf16_pairs,
    bf16_prefill,
    ggml,
    int16_prefill,
    native,
    native_layers,
    panels,
    registry,
    row_product,
    triton_linear,
)
from mlaserve.models.moe import ROUTE_TOKENS, Experts

# Decode steps of up to this many tokens run a MoE layer with a GGUFMoEBlock as one native call; more tokens
# (prefill) take the per-op path, whose decode-then-GEMM products are faster there.
BLOCK_TOKENS = ggml.GEMV_ROWS
# the block always routes with the native router, which the per-op path (its reference) uses up to ROUTE_TOKENS
assert BLOCK_TOKENS <= ROUTE_TOKENS, "the MoE block would route steps the per-op path routes in torch"


def _raw(shape: tuple[int, ...], device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device), requires_grad=False)


def _describe(ggml_type: int) -> tuple[str, tuple[int, int]]:
    t = GGML_TYPES[ggml_type]
    return f"gguf {t.name}", (1, t.block_size)


def int8_detail(types: tuple[int, ...], int8: bool | int) -> str | None:
    """What the kernel plan says of a holder's activations: the types of its weights that take int8 activations
    under its setting, and the instructions (native.int8_isa), and those that take int16 activations at every
    decode row count (int16_prefill.takes_rest); None where none does (float products)."""
    taken = sorted({GGML_TYPES[t].name for t in types if native.takes_int8(t, int8)})
    rest = sorted({GGML_TYPES[t].name for t in types if int16_prefill.takes_rest(t, int8)})
    int16 = (
        f"int16 activations for {', '.join(rest)} at every decode row count ({int16_prefill.detail()}, fp32 grade)"
        if rest
        else None
    )
    if not taken:
        return int16
    on_tiles = tuple(n for n in taken if n in native.INT8_TILE_TYPES.values())
    tiles = native.int8_tiles(on_tiles) if on_tiles else ""
    said = f"int8 activations for {', '.join(taken)} ({native.int8_isa()})"
    # the tiles where the build has them: in use, or the kernel's refusal (a CPU without them says nothing)
    said = f"{said}, {tiles}" if tiles and native.NO_TILES_IN_BUILD not in tiles else said
    return f"{said}; {int16}" if int16 else said


def bf16_detail(types: tuple[int, ...], bf16: tuple[int, ...]) -> str | None:
    """What the kernel plan says of a holder's prefill products: the types of its weights whose many-rows products
    run in bf16 (bf16_prefill.units: the CPU's bf16 units), on the AMX-BF16 tiles with the activations as bf16
    pairs (kernels/bf16_pairs.py) or with int16 activations (kernels/int16_prefill.py); None where none does (fp32
    GEMMs)."""
    pairs = f"{bf16_pairs.tiles_detail()}: exact codes, activations as bf16 pairs, fp32 grade"
    int16 = f"{int16_prefill.detail()}: exact codes, activations as int16 codes per 32 values, fp32 grade"
    said = []
    for mode, what in (
        (bf16_prefill.BF16, f"bf16 prefill GEMMs for {{}} ({bf16_prefill.units()})"),
        (bf16_prefill.BF16_PAIRS, f"bf16-pair prefill for {{}} ({pairs})"),
        (bf16_prefill.INT16, f"int16-activation prefill for {{}} ({int16})"),
    ):
        taken = sorted({GGML_TYPES[t].name for t, b in zip(types, bf16, strict=True) if b == mode})
        if taken:
            said.append(what.format(", ".join(taken)))
    return "; ".join(said) or None


def tiles_detail(types: tuple[int, ...], tiles: tuple[bool, ...]) -> str | None:
    """What the kernel plan says of a holder's prefill products kept int8: the types of its weights whose products of
    up to ggml.tile_rows(type) rows (per active expert) stay int8 on the AMX-INT8 tiles, or, where the process has
    no tiles, at every row count on the int8 panels (native.panel_rows) or up to ggml.ROW_KERNEL_ROWS per active
    expert on the row kernels, instead of decode-then-GEMM, and what runs above; None where none does."""
    taken = {t for t, b in zip(types, tiles, strict=True) if b}
    if not taken:
        return None
    if not native.tiles_granted():
        said = []
        panel = sorted(GGML_TYPES[t].name for t in taken if native.panel_rows(t))
        rows = sorted(GGML_TYPES[t].name for t in taken if not native.panel_rows(t))  # routed experts only
        if panel:
            said.append(
                f"int8 prefill at every row count for {', '.join(panel)} ({native.int8_panels(tuple(panel))}, the "
                "row kernels below; measured faster than decode-then-GEMM in bf16 or fp32 at every count, each "
                "panel kind on one CPU: kernels/ggml.PANEL_INT8_ROWS)"
            )
        int16 = [name for name in rows if GGML_TYPE_IDS[name] not in native.ROW_KERNEL_TYPES]
        rows = [name for name in rows if name not in int16]
        if rows:
            said.append(
                f"int8 prefill on the row kernels for {', '.join(rows)} up to {ggml.ROW_KERNEL_ROWS} rows per active "
                "expert (no amx-int8 tiles here; measured crossover with the experts decoded for a bf16 GEMM: "
                "kernels/ggml.ROW_KERNEL_ROWS), decode-then-GEMM above"
            )
        if int16:
            said.append(
                f"int16 prefill on the row products for {', '.join(int16)} up to {ggml.ROW_KERNEL_ROWS} rows per "
                "active expert (no int16 panels here: int16_prefill.takes_expert_rows, measured faster than the "
                "experts decoded for an fp32 GEMM), decode-then-GEMM above"
            )
        return "; ".join(said)
    by_rows: dict[int, list[str]] = {}
    for t in sorted(taken, key=lambda t: GGML_TYPES[t].name):
        by_rows.setdefault(ggml.tile_rows(t), []).append(GGML_TYPES[t].name)
    spans = " and ".join(f"{', '.join(names)} up to {rows} rows" for rows, names in sorted(by_rows.items()))
    return (
        f"int8 prefill on amx-int8 tiles for {spans} per product "
        "(measured crossover with bf16 decode-then-GEMM: kernels/ggml.tile_rows), decode-then-GEMM above"
    )


def plan_note(
    types: dict[str, int],
    int8: bool | int,
    bf16: tuple[bool, ...] = (),
    tiles: tuple[bool, ...] = (),
    grouped: bool = False,
) -> str:
    """A holder's kernel-plan note: what its products run (fused or not) and, where any takes them, its int8
    activations, its int8 prefill on the tiles, its bf16 prefill GEMMs and its fp32 prefill on decoded panels
    (grouped: routed experts, heads, at every row count; else up to ggml.PANEL_ROWS) (bf16, tiles: per part of
    `types`, in order)."""
    kinds = tuple(types.values())
    said = [
        int8_detail(kinds, int8),
        tiles_detail(kinds, tiles) if tiles else None,
        bf16_detail(kinds, bf16) if bf16 else None,
        panels_detail(kinds, bf16, grouped),
    ]
    return "; ".join([_types_detail(types), *(s for s in said if s)])


def panels_detail(types: tuple[int, ...], bf16: tuple[int, ...], grouped: bool) -> str | None:
    """What the kernel plan says of a holder's exact prefill products (the types left in fp32 by the bf16 setting):
    on decoded panels where the build has them (kernels/panels.py), a dense weight's up to ggml.PANEL_ROWS rows, else
    None (decode, then the BLAS)."""
    modes = bf16 or (bf16_prefill.FP32,) * len(types)
    taken = sorted({GGML_TYPES[t].name for t, b in zip(types, modes, strict=True) if b == bf16_prefill.FP32})
    if not taken or not panels.available():
        return None
    span = "" if grouped else f" up to {ggml.PANEL_ROWS} rows (decode-then-BLAS above)"
    return f"fp32 prefill for {', '.join(taken)} on decoded panels{span} ({panels.UNIT})"


def _types_detail(types: dict[str, int]) -> str:
    """native.product_detail of one type, or of each part's where the parts differ ("gate_up ...; down ...")."""
    if len(set(types.values())) == 1:
        t = next(iter(types.values()))
        return native.product_detail(t, GGML_TYPES[t].name)
    return "; ".join(f"{part} {native.product_detail(t, GGML_TYPES[t].name)}" for part, t in types.items())


class GGUFLinear(registry.KernelSwitch, nn.Module):
    """y = x W^T (+ b), W kept as the file's ggml blocks."""

    KERNEL_OP = "linear"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ("triton", *ggml.KERNELS)  # what `kernel` may be set to (triton: Q8_0 / Q4_K, triton_unfit)
    KERNEL_CALLS = {"matmul": {"triton": "_matmul_triton", "native": "_matmul_native", "torch": "_matmul_torch"}}
    NATIVE_ROWS, NATIVE_FALLBACK = ggml.GEMV_ROWS, "native decode, then BLAS"  # kernels.ggml.linear_native

    def __init__(self, in_features: int, out_features: int, ggml_type: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        self.kernel = "torch"  # the reference until the loader sets the engine's kernels (binds self.matmul)
        self.int8 = False  # int8 activations: False, or the cap of kernels/native.takes_int8 (set by the KernelPlan)
        self.bf16 = False  # prefill (many-rows) products in bf16 (set by the KernelPlan: set_prefill_bf16)
        self.tiles = False  # prefill products of <= ggml.tile_rows rows int8 on the tiles (set_prefill_tiles)
        self.weight = _raw((out_features, ggml.row_bytes(ggml_type, in_features)), device)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml.dense(self.weight, self.ggml_type, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.matmul(x2)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _matmul_native(self, x2: torch.Tensor) -> torch.Tensor:
        w, t, k = self.weight, self.ggml_type, self.in_features
        if x2.shape[0] <= ggml.GEMV_ROWS:  # linear_native's decode products, their choice bound once per weight
            return self._row_product(w)(x2.float().contiguous())
        return ggml.linear_native(x2, w, t, k, self.int8, self.bf16, self.tiles)

    def _row_product(self, w: torch.Tensor) -> row_product.RowProduct:
        """The decode-sized product bound for the weight and activation setting this call sees (bound again
        when either changed since: the loader fills the weight after the plan, tests switch settings)."""
        key = (w.data_ptr(), self.int8)
        if self.__dict__.get("_rows_key") != key:
            self.__dict__["_rows"] = row_product.bind(w, self.ggml_type, self.in_features, self.int8)
            self.__dict__["_rows_key"] = key
        return self.__dict__["_rows"]

    def _matmul_torch(self, x2: torch.Tensor) -> torch.Tensor:
        return ggml.linear_torch(x2, self.weight, self.ggml_type, self.in_features)

    def _matmul_triton(self, x2: torch.Tensor) -> torch.Tensor:
        return triton_linear.gguf_linear(x2, self.weight, self.triton_format(), self.in_features)

    def triton_unfit(self) -> str | None:
        """The Triton kernels cover Q8_0 and Q4_K blocks (kernels/triton/); other types stay with the others."""
        name = GGML_TYPES[self.ggml_type].name
        covered = [f for f in triton_linear.MODULES if f != "fp8"]
        return None if name in covered else f"gguf {name}: the Triton kernels cover {' and '.join(covered)}"

    def triton_format(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    def describe(self) -> tuple[str, tuple[int, int]]:
        return _describe(self.ggml_type)

    def set_prefill_bf16(self, cap: int) -> None:
        """The KernelPlan's bf16 prefill setting (the widest weight taking it, bits per value): decided here, once."""
        self.bf16 = bf16_prefill.takes_bf16(self.ggml_type, cap)

    def set_prefill_tiles(self) -> None:
        """The KernelPlan's int8 prefill setting (prefill_matmul "int8"), decided here once, after the int8 one:
        whether this weight's int8 products of many rows run on the AMX-INT8 tiles in this process (native.takes_tiles)
        or, without them, on the VNNI panels (native.takes_panels)."""
        self.tiles = native.takes_tiles(self.ggml_type, self.int8) or native.takes_panels(self.ggml_type, self.int8)

    def native_detail(self) -> str:
        """The plan's note: the build and whether the type has a fused decode-and-dot kernel in it."""
        return plan_note({"weight": self.ggml_type}, self.int8, (self.bf16,), (self.tiles,))

    def prefill_reads_in_place(self, rows: int) -> str | None:
        """None where a product of `rows` rows reads this weight's blocks in place (ggml.IN_PLACE_PATHS: a call's
        work on the weight is one pass over its blocks, whatever its rows), else what it runs instead (after the
        plan's settings: the KernelPlan's mlp_rows asks, models/layers.py SwiGLU)."""
        if not registry.runs_native(self):
            return f"kernel {self.kernel}"
        path = ggml.linear_path(rows, self.ggml_type, self.int8, self.bf16, self.tiles)
        return None if path in ggml.IN_PLACE_PATHS else f"{path} (the whole weight decoded per call)"

    def extra_repr(self) -> str:
        t = GGML_TYPES[self.ggml_type].name
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml_type={t}"


class GGUFEmbedding(registry.KernelSwitch, nn.Module):
    """Token embedding kept as ggml blocks; rows are dequantized when looked up (exactly the rows
    of the dense table: a row's blocks are dequantized by the same operations either way). The native
    lookup decodes the rows in one C call, bit for bit the reference dequantizer's values (one call instead of
    the reference's ~20 tensor ops per lookup: ~0.5 ms of a batch-1 decode step on a Q4_K table)."""

    KERNEL_OP = "embedding"  # kernels/registry.py chooses `kernel` at load (the KernelPlan)
    KERNELS = ggml.KERNELS
    KERNEL_CALLS = {"rows": {"native": "_rows_native", "torch": "_rows_torch"}}

    def __init__(self, num_embeddings: int, embedding_dim: int, ggml_type: int, dtype, device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.ggml_type = num_embeddings, embedding_dim, ggml_type
        self.kernel = "torch"  # the reference until the loader sets the engine's kernels (binds self.rows)
        self.dtype = dtype  # what nn.Embedding in the engine's dtype would return
        self.weight = _raw((num_embeddings, ggml.row_bytes(ggml_type, embedding_dim)), device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml.dense(self.weight, self.ggml_type, self.embedding_dim).to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(self.weight[ids.reshape(-1)])
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _rows_torch(self, raw: torch.Tensor) -> torch.Tensor:
        return ggml.dense(raw, self.ggml_type, self.embedding_dim)

    def _rows_native(self, raw: torch.Tensor) -> torch.Tensor:
        return native.dequantize(self.ggml_type, raw, self.embedding_dim)

    def native_unfit(self) -> str | None:
        """The native decoder takes the block types this build decodes, rows on the CPU; float tables (F32 / F16 /
        BF16) keep the reference, a view or a cast."""
        t = GGML_TYPES[self.ggml_type]
        if t.block_size == 1 or not native.type_kernels(self.ggml_type) & 1:
            return f"gguf {t.name}: no native decoder (float rows are read as they are)"
        return None if self.weight.device.type == "cpu" else f"table on {self.weight.device.type}"

    def describe(self) -> tuple[str, tuple[int, int]]:
        return _describe(self.ggml_type)

    def extra_repr(self) -> str:
        t = GGML_TYPES[self.ggml_type].name
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={t}"


class GGUFExperts(registry.KernelSwitch, Experts):
    """Routed experts kept as ggml blocks: a step multiplies only the experts it routes tokens to,
    (token, expert) pairs sorted by expert, one grouped call per projection (kernels.ggml.expert_linear);
    impl "loop" is the per-expert reference like Experts._forward_loop."""

    KERNEL_OP = "grouped_experts"
    KERNELS = ggml.KERNELS
    KERNEL_CALLS = {"routed": {"native": "_routed_native", "torch": "_routed_torch"}}
    # up to MOE_PAIRS (token, expert) pairs one native call pair by pair, more: sorted by expert, grouped native
    NATIVE_ROWS, NATIVE_UNIT, NATIVE_FALLBACK = ggml.MOE_PAIRS, "(token, expert) pairs", "grouped native"

    def __init__(self, hidden: int, n_experts: int, inter: int, type_gate_up: int, type_down: int, device) -> None:
        nn.Module.__init__(self)
        self.impl, self.hidden, self.inter, self.kernel, self.int8 = "grouped_mm", hidden, inter, "torch", False
        self.type_gate_up, self.type_down = type_gate_up, type_down
        self.bf16_gate_up = self.bf16_down = False  # prefill products in bf16, per projection (set_prefill_bf16)
        self.tiles_gate_up = self.tiles_down = False  # prefill products kept int8 (tiles / row kernels), per projection
        self.gate_proj = _raw((n_experts, inter, ggml.row_bytes(type_gate_up, hidden)), device)
        self.up_proj = _raw((n_experts, inter, ggml.row_bytes(type_gate_up, hidden)), device)
        self.down_proj = _raw((n_experts, hidden, ggml.row_bytes(type_down, inter)), device)

    @property
    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_proj, up_proj): the two stacks whose rows are, in this order, each expert's [2I] gate_up rows
        (kernels.ggml takes them as one weight of two parts)."""
        return self.gate_proj, self.up_proj

    def checkpoint_slots(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Three whole stacks: the loader keeps each as a view of the mapped file (loading/weights.py in_place)
        or copies the experts into it."""
        return {"weight": (self.gate_proj, self.up_proj, self.down_proj)}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense gate_up [E, 2I, D] (gate rows first) and down [E, D, I]: the reference."""
        gu = torch.cat([ggml.dense(p, self.type_gate_up, self.hidden) for p in self.gate_up], dim=1)
        return gu.to(dtype), ggml.dense(self.down_proj, self.type_down, self.inter).to(dtype)

    def describe(self) -> tuple[str, tuple[int, int]]:
        name, block = _describe(self.type_gate_up)
        if self.type_down != self.type_gate_up:
            name += f" (down_proj {GGML_TYPES[self.type_down].name})"
        return name, block

    def set_prefill_bf16(self, cap: int) -> None:
        """The KernelPlan's bf16 prefill setting, decided once per projection (their types may differ)."""
        self.bf16_gate_up = bf16_prefill.takes_bf16(self.type_gate_up, cap)
        self.bf16_down = bf16_prefill.takes_bf16(self.type_down, cap)

    def set_prefill_tiles(self) -> None:
        """The KernelPlan's int8 prefill setting, decided once per projection after the int8 one
        (native.takes_expert_int8: on the tiles, or on the row kernels where the process has none; for the int16 types,
        int16_prefill.takes_expert_rows: their row products where the process has no int16 panels)."""
        self.tiles_gate_up = self._expert_rows(self.type_gate_up)
        self.tiles_down = self._expert_rows(self.type_down)

    def _expert_rows(self, type_id: int) -> bool:
        return native.takes_expert_int8(type_id, self.int8) or int16_prefill.takes_expert_rows(type_id, self.int8)

    def native_detail(self) -> str:
        """The plan's note: the build and, per projection type, fused decode-and-dot or decode, then dot."""
        types = {"gate_up": self.type_gate_up, "down": self.type_down}
        tiles = (self.tiles_gate_up, self.tiles_down)
        return plan_note(types, self.int8, (self.bf16_gate_up, self.bf16_down), tiles, grouped=True)

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        if self.impl == "loop":
            return self._loop(x.float(), topk_w, topk_idx).to(x.dtype)
        return self.routed(x, topk_w, topk_idx).to(x.dtype)

    def _routed_native(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """Up to NATIVE_ROWS (token, expert) pairs: one native call, pair by pair (decode at batch 1-2); more:
        grouped by expert, each product native. The pair-by-pair call takes int8 or int16 activations only for
        both projections at once; with a mixed pair the grouped path decides per projection, as it does for more
        pairs (and as the MoE block does)."""
        types = (self.type_gate_up, self.type_down)
        pairwise = len({native.takes_int8(t, self.int8) for t in types}) == 1
        pairwise = pairwise and len({int16_prefill.takes_rest(t, self.int8) for t in types}) == 1
        if topk_idx.numel() <= self.NATIVE_ROWS and pairwise:
            g, u, dn, t_gu, t_dn = self.gate_proj, self.up_proj, self.down_proj, self.type_gate_up, self.type_down
            return ggml.moe_experts(x, topk_w, topk_idx, g, u, t_gu, dn, t_dn, self.int8, self.swiglu_limit)
        return self._grouped(x.float(), topk_w, topk_idx, ggml.expert_linear_native)

    def _routed_torch(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        return self._grouped(x.float(), topk_w, topk_idx, ggml.expert_linear_torch)

    # the activation between the two products; DeepSeek-V4's holder clamps it (quant/ggml_deepseek_v4.py), and
    # the pair-by-pair native call takes the clamp as its limit (inf: none)
    swiglu_limit = math.inf

    @staticmethod
    def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    def _grouped(
        self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor, product: ggml.ExpertProduct
    ) -> torch.Tensor:
        k = topk_idx.shape[1]
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // k  # which token each sorted (token, expert) pair came from
        active, counts = torch.unique(flat, return_counts=True)  # ascending: the groups' order in the pairs
        ends = torch.cumsum(counts, 0)
        weights = topk_w.reshape(-1)[order, None].float()
        out = torch.zeros_like(x)
        # whole experts per chunk, so every expert's product has the rows it has unchunked; the sums into `out`
        # come in the same (expert) order; every chunk takes the path the step's mean rows per expert picks
        mean = flat.numel() / active.shape[0]
        for a0, a1, lo, hi in self._pair_chunks(counts, flat.numel(), x.shape[1]):
            offs = (ends[a0:a1] - lo).to(torch.int32)
            gu = product(
                x[token_of[lo:hi]], self.gate_up, self.type_gate_up, self.hidden, active[a0:a1], offs, self.int8,
                self.bf16_gate_up, self.tiles_gate_up, mean,
            )  # fmt: skip
            h = self._swiglu(*gu.chunk(2, dim=-1))
            del gu
            ys = product(
                h, self.down_proj, self.type_down, self.inter, active[a0:a1], offs, self.int8, self.bf16_down,
                self.tiles_down, mean,
            )  # fmt: skip
            del h
            out.index_add_(0, token_of[lo:hi], ys.mul_(weights[lo:hi]))
        return out

    def _pair_chunks(self, counts: torch.Tensor, pairs: int, hidden: int) -> list[tuple[int, int, int, int]]:
        """The sorted pairs cut into runs of whole experts of at most ggml.MOE_CHUNK_BYTES of activations each (an
        expert with more is a run of its own): [(first expert, past the last, first pair, past the last)]."""
        per_pair = 4 * (2 * hidden + 3 * self.inter)  # fp32: input, gate and up, activation, output
        cap = max(1, ggml.MOE_CHUNK_BYTES // per_pair)
        if pairs <= cap:
            return [(0, counts.shape[0], 0, pairs)]
        runs, a0, lo, hi = [], 0, 0, 0
        for a, n in enumerate(counts.tolist()):
            if hi > lo and hi + n - lo > cap:
                runs.append((a0, a, lo, hi))
                a0, lo = a, hi
            hi += n
        runs.append((a0, counts.shape[0], lo, hi))
        return runs

    def _loop(self, x: torch.Tensor, topk_w: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """The per-expert reference (impl "loop"): one product per active expert, float activations."""
        product = ggml.LINEAR[self.kernel]
        out = torch.zeros_like(x)
        for e in torch.unique(topk_idx).tolist():
            tok, slot = torch.where(topk_idx == e)
            w = torch.cat((self.gate_proj[e], self.up_proj[e]))  # one expert's [2I, R] rows (a small copy)
            gu = product(x[tok], w, self.type_gate_up, self.hidden)
            g, u = gu.chunk(2, dim=-1)
            y = product(self._swiglu(g, u), self.down_proj[e], self.type_down, self.inter)
            out.index_add_(0, tok, y * topk_w[tok, slot, None].float())
        return out


def native_rows(m: nn.Module, int8: bool = False) -> bool:
    """A linear layer whose rows the one-call blocks can read: a GGUFLinear run by the native kernels (with int8
    activations exactly when `int8`: a block runs one activation choice), or an fp32 nn.Linear on the CPU (a
    matrix a GGUF keeps in F32: float activations whatever `int8`, as in the per-op path, whose BLAS sums in
    another order), without bias either way."""
    if isinstance(m, GGUFLinear):
        return registry.runs_native(m) and m.int8 == int8 and m.bias is None
    w = getattr(m, "weight", None)
    return (
        isinstance(m, nn.Linear)
        and m.bias is None
        and w.dtype == torch.float32
        and w.is_contiguous()
        and w.device.type == "cpu"
    )


def rows_args(m: nn.Module) -> native_layers.LinArgs:
    """mls_lin_t (kernels/csrc/mls.h) of a native_rows layer (ggml type 0: F32 rows of 4 K bytes)."""
    if isinstance(m, GGUFLinear):
        return native_layers.LinArgs(m.ggml_type, m.weight.data_ptr(), m.out_features, m.in_features, m.weight.shape[1])
    return native_layers.LinArgs(0, m.weight.data_ptr(), m.out_features, m.in_features, 4 * m.in_features)

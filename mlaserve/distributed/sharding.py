"""Which parameter splits how across N tensor-parallel ranks, each rank's model config, and each
rank's slices of a checkpoint.

Notation
  N ranks, r this rank; H heads, D hidden, I intermediate (dense MLP), I_e moe_intermediate_size,
  V vocabulary; dn/dr/dv nope/rope/v head dims, r_kv = kv_lora_rank
Splits (HF parameter names; "rows" = dim 0 = outputs, "columns" = dim 1 = inputs)
  rows by heads   q_b_proj / q_proj [H*(dn+dr), .], kv_b_proj [H*(dn+dv), r_kv]: rank r holds heads
                  [r*H/N, (r+1)*H/N) (a head's rows are contiguous), so W_UK, W_UV split with them
  columns         o_proj [D, H*dv] (its heads' dv columns): a partial sum, all-reduced
  first rank      o_proj.bias: rank 0 holds it, the others zeros (added once by the all-reduce)
  rows / columns  gate_proj, up_proj [I, D] rows and down_proj [D, I] columns of the dense MLP,
                  the shared experts and every routed expert (I/N or I_e/N each): partial sums,
                  all-reduced once after the whole MLP / MoE
  vocabulary      embed_tokens, lm_head [V, D] rows: rank r holds a contiguous range (the first
                  V mod N ranks one row more); logits are gathered on rank 0. The MTP layer's own
                  embed_tokens and shared_head.head the same (its attention, MLP / experts split as
                  a decoder layer's; eh_proj, enorm, hnorm, shared_head.norm replicated)
  GGUF            kept in its blocks on every rank (as one process): rows are byte ranges of whole
                  blocks, columns ranges of whole blocks of each row. Where an intermediate dim's
                  split (I/N, I_e/N) falls inside the down projection's blocks (Q8_0 at
                  I_e/N = 16, Q4_K at I/N = 128), the rank holds a wider span of units instead:
                  the down columns of the whole blocks covering its units (blocks past the end
                  zero), and gate / up rows that are its own units' rows and zero elsewhere, so
                  the other units give silu(0) * 0 = 0 and add exactly nothing (UnitSpan). An
                  o_proj whose head columns fall inside blocks is read dequantized, said at load
                  (block_split_problem) and recorded in the GGUF plan
  at load         quantization="int8" / "int4" (Q8_0 / Q4_0: 32 values along a row): each rank quantizes
                  its own slices after the fill. A row split keeps whole rows, so each row's blocks are
                  one process's; a column split on whole blocks takes one process's blocks of those
                  columns. An intermediate dim of whole blocks is spanned on them as above (the down
                  columns of the covering blocks hold the checkpoint's values, so their blocks are one
                  process's); an o_proj whose head columns fall inside blocks stays float on every
                  rank, named at load (at_load_split_notes)
  FP8 blocks      kept in e4m3 on every rank: the weight's rows / columns as above, its block scales
                  taken with them. A rank whose slices start inside the checkpoint's (bn, bk) blocks
                  (tiny models: every split of a 128 x 128 block) re-expresses its scales on the finer
                  grid (gcd of bn and every row start, of bk and every column start): each finer
                  block lies inside one stored block and takes its scale, so q * s is the same value
                  for every weight (regrid_fp8); a split on whole blocks keeps the stored grid
  whole experts   TP x EP over expert groups TP does not split (FP4, INT4; distributed/mesh.py): the routed
                  experts are read whole, their scales as stored (whole_experts)
  replicated      the rest: q_a_proj (c_q), kv_a_proj_with_mqa (c_kv, k_pe: every head reads the
                  same latent rows, so each rank keeps the whole latent cache), norms, the DSA
                  indexer (its top-k must be the same on every rank), the MoE gate
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.loading.safetensors_source import WeightError

_RULES = (
    (re.compile(r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$"), "rows"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "columns"),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), "first"),
    (re.compile(r"\.mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj)\.weight$"), "rows"),
    (re.compile(r"\.mlp\.(shared_experts\.|experts\.\d+\.)?down_proj\.weight$"), "columns"),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocabulary"),
    # the MTP layer's own embedding and head (model.layers.N.*, N = num_hidden_layers), split as the trunk's
    (re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$"), "vocabulary"),
)


# the intermediate dims a down projection's columns split: dense MLP (I), routed experts (I_e), shared experts
_UNITS = (
    (re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$"), "dense"),
    (re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"), "experts"),
    (re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$"), "shared"),
)


@dataclass(frozen=True)
class UnitSpan:
    """A rank's part of an intermediate dim: its own units [start, stop) of the checkpoint, held inside a
    span of `width` units starting at checkpoint unit `first` (first <= start, stop <= first + width).
    gate / up rows outside [start, stop) are zero (those units compute silu(0) * 0 = 0), down columns are
    the span's whole blocks (zero past the tensor's end). Even splits: first = start, width = stop - start."""

    start: int
    stop: int
    first: int
    width: int

    @property
    def widened(self) -> bool:
        return self.first != self.start or self.width != self.stop - self.start


_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.")


def _unit_kind(name: str) -> str | None:
    return next((kind for pattern, kind in _UNITS if pattern.search(name)), None)


def _block(source, name: str) -> int:
    """Values per stored block of a tensor along its columns (1: a float or non-GGUF tensor)."""
    ggml_type = getattr(source, "ggml_type", None)
    return GGML_TYPES[ggml_type(name)].block_size if ggml_type is not None else 1


def unit_spans(source, cfg: ModelConfig, rank: int, n: int, at_load: int = 1) -> dict[str, UnitSpan]:
    """Rank r's UnitSpan of each intermediate dim ("dense", "experts", "shared"), from the stored block sizes
    of the down projections that split it (one span per dim for every layer: the model config has one size).
    The shared experts (n_shared x I_e units) follow the routed ones' width, n_shared x theirs.
    at_load: the block (values along a row) of quantization at load; a dim that is whole blocks of it (one
    process quantizes its down projections) is spanned on them, so each rank quantizes the very blocks one
    process does (a dim that is not stays float in both)."""
    block = {"dense": 1, "experts": 1, "shared": 1}
    for name in source.names():
        kind = _unit_kind(name)
        if kind is not None and name.endswith("down_proj.weight"):
            block[kind] = max(block[kind], _block(source, name))
    spans: dict[str, UnitSpan] = {}
    n_shared = cfg.moe.n_shared_experts if cfg.moe is not None else 0
    sizes = {"dense": cfg.intermediate_size, "experts": cfg.moe.moe_intermediate_size if cfg.moe else 0}
    for kind, units in (*sizes.items(), ("shared", n_shared * sizes["experts"])):
        if units and units % at_load == 0:
            block[kind] = max(block[kind], at_load)
    for kind, units in sizes.items():
        part = units // n
        start, stop = rank * part, (rank + 1) * part
        b = max(block[kind], block["shared"]) if kind == "experts" else block[kind]
        first = start // b * b
        width = -(-stop // b) * b - first
        if kind == "experts" and n_shared:
            s0, s1 = n_shared * start, n_shared * stop
            shared_first = s0 // b * b
            width = max(width, -(-(-(-s1 // b) * b - shared_first) // n_shared))
            width = -(-width // b) * b
            spans["shared"] = UnitSpan(s0, s1, shared_first, n_shared * width)
        spans[kind] = UnitSpan(start, stop, first, width)
    return spans


def split_of(name: str) -> str:
    """How the tensor `name` splits: rows | columns | first | vocabulary | replicated."""
    return next((kind for pattern, kind in _RULES if pattern.search(name)), "replicated")


def vocab_range(vocab_size: int, rank: int, n: int) -> tuple[int, int]:
    """Rank r's rows [start, stop) of embed_tokens / lm_head (the first V mod N ranks hold one more)."""
    base, extra = divmod(vocab_size, n)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def vocab_sizes(vocab_size: int, n: int) -> tuple[int, ...]:
    return tuple(b - a for a, b in (vocab_range(vocab_size, r, n) for r in range(n)))


def check_splits(cfg: ModelConfig, n: int) -> None:
    """Every split dimension must divide by N; the error names the tensors that split by it."""
    dims = [("num_attention_heads", cfg.num_heads, "self_attn.q_b_proj / q_proj, kv_b_proj, o_proj (by heads)")]
    if "dense" in cfg.mlp_layer_types:
        dims.append(("intermediate_size", cfg.intermediate_size, "mlp.gate_proj / up_proj / down_proj"))
    if cfg.moe is not None:
        dims.append(
            (
                "moe_intermediate_size",
                cfg.moe.moe_intermediate_size,
                "mlp.experts.*.{gate,up,down}_proj, mlp.shared_experts.*",
            )
        )
    for field, value, tensors in dims:
        if value % n:
            raise ConfigError(
                f"tensor_parallel_size={n} does not divide {field}={value}: the tensors {tensors} "
                f"cannot be split evenly across {n} ranks"
            )


def rank_config(cfg: ModelConfig, rank: int, n: int, spans: dict[str, UnitSpan] | None = None) -> ModelConfig:
    """The model config rank r runs: its heads, its slice of every intermediate dim (the width of its
    UnitSpan where one is given) and of V."""
    check_splits(cfg, n)
    start, stop = vocab_range(cfg.vocab_size, rank, n)
    spans = spans or {}
    inter = spans["dense"].width if "dense" in spans else cfg.intermediate_size // n
    moe = None
    if cfg.moe:
        width = spans["experts"].width if "experts" in spans else cfg.moe.moe_intermediate_size // n
        moe = replace(cfg.moe, moe_intermediate_size=width)
    return replace(cfg, num_heads=cfg.num_heads // n, intermediate_size=inter, vocab_size=stop - start, moe=moe)


class ShardedSource:
    """A tensor source (safetensors folder or GGUF file) seen by one rank: get(name) returns only
    this rank's slice, read as a slice when the source can (safetensors: get_slice; GGUF: only
    the slice's blocks are dequantized); other sources are read whole and narrowed."""

    def __init__(
        self,
        source,
        cfg: ModelConfig,
        rank: int,
        n: int,
        spans: dict[str, UnitSpan] | None = None,
        whole_experts: bool = False,
    ) -> None:
        """whole_experts: the routed experts are not split (TP x EP over expert groups TP does not split,
        distributed/mesh.py): read whole, their scales as stored."""
        self.source, self.rank, self.n, self.whole_experts = source, rank, n, whole_experts
        self.vocab = vocab_range(cfg.vocab_size, rank, n)
        self.spans = spans or {}
        self.heads = (rank * cfg.num_heads // n, (rank + 1) * cfg.num_heads // n)
        self.fp8: tuple[str, tuple[int, int], tuple[int, int]] | None = None  # scale name, stored, rank's block

    def regrid_fp8(self, scale_name: str, block: tuple[int, int]) -> tuple[int, int]:
        """The (bn', bk') block this rank's FP8 scales are expressed on: the gcd of the stored block with the
        start of every quantized slice it reads (the stored block where every slice starts on whole blocks).
        Every scale this source returns from then on is on that grid."""
        suffix, (gr, gc) = "." + scale_name, block
        for name in self.names():
            if not name.endswith(suffix) or (self.whole_experts and _ROUTED.search(name)):  # read as stored
                continue
            weight = name[: -len(suffix)] + ".weight"
            start_row, start_col = (r[0] for r in self._ranges(weight))
            gr, gc = math.gcd(gr, start_row), math.gcd(gc, start_col)
        self.fp8 = (scale_name, block, (gr, gc))
        return gr, gc

    def _ranges(self, weight: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's rows and columns [start, stop) of a 2-D weight (the whole dim where it is not split)."""
        shape = tuple(self.source.shape(weight))
        rows, cols = (0, shape[0]), (0, shape[1])
        kind = self._kind(weight)
        if kind == "vocabulary":
            rows = self.vocab
        elif kind == "rows":
            rows = self._even(weight, shape, 0)
        elif kind == "columns":
            cols = self._even(weight, shape, 1)
        return rows, cols

    def _scale(self, name: str) -> torch.Tensor:
        """A block scale [nb, kb] on this rank's grid: finer block (i, j) of its slice takes the stored block
        holding its first weight (it lies inside that block: the grid divides the block and every start)."""
        scale_name, (bn, bk), (gr, gc) = self.fp8
        weight = name[: -len(scale_name) - 1] + ".weight"
        stored = self.source.get(name)
        (r0, r1), (c0, c1) = self._ranges(weight)
        rows = (r0 + torch.arange(-(-(r1 - r0) // gr)) * gr) // bn
        cols = (c0 + torch.arange(-(-(c1 - c0) // gc)) * gc) // bk
        return stored[rows][:, cols].contiguous()

    def names(self) -> list[str]:
        return self.source.names()

    def where(self, name: str) -> str:
        return self.source.where(name)

    def release(self, name: str) -> None:
        if hasattr(self.source, "release"):
            self.source.release(name)

    # what a GGUF source also answers (plan_gguf): types and rebuilt tensors are the whole tensor's
    def ggml_type(self, name: str) -> int:
        return self.source.ggml_type(name)

    def gguf_type(self, name: str) -> str:
        return self.source.gguf_type(name)

    def rebuilt(self, name: str) -> bool:
        return self.source.rebuilt(name)

    def span(self, name: str) -> UnitSpan | None:
        """The widened UnitSpan a gate / up / down tensor is read by, or None (an even split)."""
        kind = _unit_kind(name)
        span = self.spans.get(kind) if kind is not None else None
        return span if span is not None and span.widened else None

    def block_split_problem(self, name: str) -> str | None:
        """Why this rank's slice of `name` is not whole stored blocks (it is then read dequantized), or None."""
        if self._kind(name) != "columns" or self.span(name) is not None:
            return None
        shape = tuple(self.source.shape(name))
        start, stop = self._even(name, shape, 1)
        block = _block(self.source, name)
        if start % block or stop % block:
            return (
                f"{self.where(name)}: the columns [{start}, {stop}) of {name!r} (tensor_parallel_size={self.n}, rank "
                f"{self.rank}) fall inside its {block}-value {self.gguf_type(name)} blocks: read dequantized"
            )
        return None

    def mla_split_blocks(self, layer: int, mapped: bool = False):
        """attn_k_b / attn_v_b blocks of this rank's heads (dim 0 of both), or None (a fused attn_kv_b)."""
        split = self.source.mla_split_blocks(layer, mapped)
        if split is None:
            return None
        h0, h1 = self.heads
        return tuple((blocks[h0:h1], t) for blocks, t in split)

    def get_blocks(self, name: str, mapped: bool = False) -> torch.Tensor:
        """This rank's slice of a tensor kept in its blocks, as stored bytes uint8 [rows, R]: rows are byte
        ranges, columns whole blocks of every row (the file's bytes; nothing is converted). mapped: views of
        the read-only shared map where the slice is whole rows (a rank then touches only its rows' pages);
        a column slice is not contiguous, so the loader copies it."""
        kind = self._kind(name)
        whole = self.source.get_blocks(name, mapped)
        if kind == "replicated":
            return whole
        if kind == "first":
            raise WeightError(f"{self.where(name)}: {name!r} is not a blocks tensor")
        span = self.span(name)
        t = GGML_TYPES[self.ggml_type(name)]
        if kind == "vocabulary":
            return whole[self.vocab[0] : self.vocab[1]]
        shape = tuple(self.source.shape(name))
        if kind == "rows":
            if span is None:
                start, stop = self._even(name, shape, 0)
                return whole[start:stop]
            out = torch.zeros((span.width, whole.shape[1]), dtype=torch.uint8)
            out[span.start - span.first : span.stop - span.first] = whole[span.start : span.stop]
            return out
        start, stop = (span.first, span.first + span.width) if span is not None else self._even(name, shape, 1)
        if start % t.block_size or stop % t.block_size:
            raise WeightError(self.block_split_problem(name) or f"{self.where(name)}: {name!r} columns off blocks")
        b0, b1 = start // t.block_size * t.type_size, stop // t.block_size * t.type_size
        if b1 <= whole.shape[1]:
            return whole[:, b0:b1]
        out = torch.zeros((whole.shape[0], b1 - b0), dtype=torch.uint8)  # blocks past the end: zero
        out[:, : whole.shape[1] - b0] = whole[:, b0:]
        return out

    def _kind(self, name: str) -> str:
        return "replicated" if self.whole_experts and _ROUTED.search(name) else split_of(name)

    def get(self, name: str) -> torch.Tensor:
        whole = self.whole_experts and _ROUTED.search(name)  # an expert group's own scales, as stored
        if self.fp8 is not None and name.endswith("." + self.fp8[0]) and not whole:
            return self._scale(name)
        kind = self._kind(name)
        if kind == "replicated" or (kind == "first" and self.rank == 0):
            return self.source.get(name)
        shape = tuple(self.source.shape(name))
        if kind == "first":
            return torch.zeros(shape)
        span = self.span(name)
        if span is not None:
            return self._spanned(name, shape, kind, span)
        dim = 0 if kind in ("rows", "vocabulary") else 1
        start, stop = self.vocab if kind == "vocabulary" else self._even(name, shape, dim)
        if not hasattr(self.source, "get_slice"):
            return self.source.get(name).narrow(dim, start, stop - start)
        try:
            return self.source.get_slice(name, dim, start, stop)
        except ValueError as e:  # e.g. a GGUF column split inside a quantization block
            raise WeightError(f"{e} (tensor_parallel_size={self.n}, rank {self.rank})") from e

    def _spanned(self, name: str, shape: tuple[int, ...], kind: str, span: UnitSpan) -> torch.Tensor:
        """A widened span read as floats: the same values get_blocks' bytes dequantize to."""
        dim = 0 if kind == "rows" else 1
        lo, hi = (span.start, span.stop) if dim == 0 else (span.first, min(span.first + span.width, shape[1]))
        part = self._read(name, dim, lo, hi)
        out = torch.zeros((span.width, shape[1]) if dim == 0 else (shape[0], span.width), dtype=part.dtype)
        at = lo - span.first
        out.narrow(dim, at, hi - lo).copy_(part)
        return out

    def _read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if hasattr(self.source, "get_slice"):
            return self.source.get_slice(name, dim, start, stop)
        return self.source.get(name).narrow(dim, start, stop - start)

    def _even(self, name: str, shape: tuple[int, ...], dim: int) -> tuple[int, int]:
        if len(shape) <= dim or shape[dim] % self.n:
            raise WeightError(
                f"{self.where(name)}: tensor {name!r} of shape {list(shape)} does not split evenly "
                f"into {self.n} parts along dim {dim} (tensor_parallel_size={self.n})"
            )
        part = shape[dim] // self.n
        return self.rank * part, (self.rank + 1) * part


def at_load_split_notes(source: ShardedSource, block: int, scheme: str, who: str) -> list[str]:
    """Quantization at load: each column-split tensor (o_proj: its heads' columns) that one process quantizes
    (its rows are whole `block`-value blocks) but whose rank slice falls inside a block: no rank can quantize
    the blocks one process does, so it stays float on every rank (said here, named). The intermediate dims'
    down projections never land here: they are spanned on whole blocks (unit_spans at_load)."""
    out = []
    for name in source.names():
        if split_of(name) != "columns" or source.span(name) is not None:
            continue
        shape = tuple(source.source.shape(name))
        start, stop = source._even(name, shape, 1)
        if shape[1] % block == 0 and (start % block or stop % block):
            out.append(
                f"{who}: quantization={scheme}: the columns [{start}, {stop}) of {name!r} (tensor_parallel_size="
                f"{source.n}) fall inside its {block}-value blocks: kept float on every rank (one process "
                "quantizes it)"
            )
    return out


def span_notes(source: ShardedSource, who: str | None = None) -> list[str]:
    """For the load report: each intermediate dim a rank holds as a wider span, and why. who: the process's
    label (TP x EP: its world rank, distributed/mesh.py), default "rank r" of its tensor-parallel rank."""
    names = {"dense": "intermediate_size", "experts": "moe_intermediate_size", "shared": "shared experts"}
    who = who or f"rank {source.rank}"
    return [
        f"{who}: {names[kind]} units [{s.start}, {s.stop}) held as [{s.first}, {s.first + s.width}) "
        "(the split falls inside the down projection's blocks, stored or quantized at load; the other units' gate / "
        "up rows are zero)"
        for kind, s in source.spans.items()
        if s.widened
    ]

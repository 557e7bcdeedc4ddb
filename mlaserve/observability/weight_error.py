"""What a GGUF file's storage types cost, estimated from the file alone, per block of the model.

Notation
  W        one stored tensor, dequantized to float32 (torch shape; a row = ggml's ne[0])
  s        a quantization sub-block of a row: the values that share one scale (and min)
  n_s      values per sub-block of the type (Q8_0 32, Q6_K 16, ...)
  step(s)  the grid spacing of s, read off its dequantized values:
             symmetric types (x = d q, q in [-m, m-1] or [-m, m]): the largest |x| is stored as m |d|,
               so step = max|s| / m (m: Q8_0 127, Q4_0 8, Q5_0 16, Q3_K 4, Q6_K 32)
             types with a min (x = d q - dmin, q in [0, L-1]): step = (max(s) - min(s)) / (L - 1)
               (L: Q4_1 and Q4_K 16, Q5_1 and Q5_K 32, Q2_K 4)
  MXFP4    e2m1 levels 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and negatives) times S = 2^(e - 127) per 32 values: the
           step depends on the value (S/2 below 2S, S below 4S, 2S above); ggml's quantizer sets e from
           floor(log2 max|s|) - 2, so the largest stored |x| is 4S or 6S and S = 2^(floor(log2 max|x|) - 2)
  i-quants  a value is s * (grid or table value), s its sub-block's scale read from the blocks
           (gguf/quants.py sub_block_scales, as the dequantizer forms it):
             IQ4_NL, IQ4_XS: the 16-value table; step = s * the table's spacing around the value (the mean of
               its two gaps, an end value's one gap)
             grid types: the quantizer picks one of N grid entries for n values (signs apart) whose coordinates
               take L levels Delta apart (IQ2_*: 8, 25, 43, Delta 17.5; IQ3_XXS: 4, 12, ..., 62, Delta 8; IQ3_S:
               1, 3, ..., 15, Delta 2; IQ1_*: -1, 0, 1 (+ delta), Delta 1). The full lattice of L^n points has
               cells Delta^n; N entries cover the same region with cells L^n / N times larger, the spacing of
               an equal-volume cubic cell Delta (L^n / N)^(1/n); 7 stored sign bits per 8 values (IQ2_XXS,
               IQ2_XS, IQ3_XXS: the 8th is their parity) halve the sign patterns: another 2^(1/8). step = s
               times that. (IQ2_XXS 1.64 Delta, IQ2_XS 1.50, IQ2_S 1.26, IQ3_XXS 2.18, IQ3_S 1.68, IQ1 1.16)
             TQ1_0, TQ2_0: d (-1, 0, 1): step = d
  err^2(W) = sum_s n_s step(s)^2 / 12       rounding to the nearest level: uniform in +-step/2
             (MXFP4 and the i-quants: the sum of each value's own step^2 / 12)
  e(W)     = sqrt(err^2(W) / ||W||^2)       relative RMS error of the tensor
  float types: e = u / sqrt(3) with unit roundoff u (F16 2^-11, BF16 2^-8); F32 0
  block    "embed", "layer.i.attn" (attn_* and indexer.* of blk.i), "layer.i.mlp" (ffn_*, exp_probs_b),
           "logits" (output, output_norm)
  e(block) = sum of e(W) over the block's tensors

Why a sum: to first order a relative perturbation e of one matrix in a chain of products perturbs the
output by at most e, and perturbations of several matrices add (worst case: aligned). It is read off
the stored values only, so a file whose weights were *changed* (swapped heads, a wrong shard) gets no
larger allowance than the same type with the right weights: the difference shows up as a divergence
far above e(block).

The step is read from the dequantized values because a dequantized sub-block lies on its own grid.
Checked against the true error of values quantized by the gguf package (tests/identities/test_verify_against.py):
estimate / actual 1.00-1.03 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 on random normal rows. K-quants' sub-block
scales are optimised rather than set by the extremes, so a sub-block may not reach the end of its grid
and the step comes out a little low (a tighter tolerance, never a looser one). Float types: the uniform
relative-rounding model overestimates (1.36x the actual error for F16 and BF16).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch

from mlaserve.gguf.iq_grids import IQ4NL_VALUES
from mlaserve.gguf.quants import sub_block_scales
from mlaserve.gguf.read.file import GGUFFile

# type -> (values per sub-block that share a scale, symmetric, m for symmetric types | L - 1 for types
# with a min): step = max|s| / m, or (max(s) - min(s)) / (L - 1)
_BLOCK_GRID: dict[str, tuple[int, bool, int]] = {
    "Q8_0": (32, True, 127),
    "Q4_0": (32, True, 8),
    "Q5_0": (32, True, 16),
    "Q3_K": (16, True, 4),
    "Q6_K": (16, True, 32),
    "Q4_1": (32, False, 15),
    "Q5_1": (32, False, 31),
    "Q2_K": (16, False, 3),
    "Q4_K": (32, False, 15),
    "Q5_K": (32, False, 31),
}
_FLOAT_ROUNDOFF = {"F32": 0.0, "F64": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}


def _cell(levels: int, n: int, entries: int, parity: bool) -> float:
    """The spacing factor of an equal-volume cubic cell of a grid of `entries` points of n coordinates over the
    levels**n lattice, with half the sign patterns where the 8th sign is a parity bit (notation block)."""
    return (levels**n / entries) ** (1 / n) * (2 ** (1 / 8) if parity else 1.0)


# grid and ternary types -> the step of a value in units of its scale: Delta * cell factor
_GRID_STEP: dict[str, float] = {
    "IQ2_XXS": 17.5 * _cell(3, 8, 256, True),
    "IQ2_XS": 17.5 * _cell(3, 8, 512, True),
    "IQ2_S": 17.5 * _cell(3, 8, 1024, False),
    "IQ3_XXS": 8.0 * _cell(8, 4, 256, True),
    "IQ3_S": 2.0 * _cell(8, 4, 512, False),
    "IQ1_S": 1.0 * _cell(3, 8, 2048, False),
    "IQ1_M": 1.0 * _cell(3, 8, 2048, False),
    "TQ1_0": 1.0,
    "TQ2_0": 1.0,
}
IQ_ERROR_TYPES = frozenset({*_GRID_STEP, "IQ4_NL", "IQ4_XS"})  # the types whose model reads the blocks' scales
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorError:
    name: str  # GGUF tensor name
    ggml_type: str
    block: str | None  # None: not part of the forward pass (e.g. MTP layers)
    rel_error: float  # e(W)


def block_of(gguf_name: str, num_layers: int) -> str | None:
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name in ("output.weight", "output_norm.weight"):
        return "logits"
    m = _BLK.match(gguf_name)
    if m is None or int(m.group(1)) >= num_layers:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest.startswith(("attn_", "indexer.")):
        return f"layer.{layer}.attn"
    if rest.startswith(("ffn_", "exp_probs_b")):
        return f"layer.{layer}.mlp"
    return None


def relative_error(w: torch.Tensor, type_name: str, scales: torch.Tensor | None = None) -> float:
    """e(W) for a tensor stored as type_name (see the notation block); scales: the sub-block scales in the values'
    order (gguf/quants.py sub_block_scales), which the i-quants' and ternary types' model needs."""
    norm2 = float(w.double().pow(2).sum())
    if norm2 == 0.0:
        return 0.0
    if type_name in _FLOAT_ROUNDOFF:
        return _FLOAT_ROUNDOFF[type_name] / 3**0.5
    if type_name == "MXFP4":
        return (_mxfp4_err2(w) / norm2) ** 0.5
    if type_name in IQ_ERROR_TYPES:
        if scales is None:
            raise ValueError(f"the {type_name} error model reads each value's scale from the blocks: none given")
        return (_iq_err2(w.reshape(scales.numel(), -1), scales.reshape(-1), type_name) / norm2) ** 0.5
    if type_name not in _BLOCK_GRID:
        raise ValueError(f"no quantization error model for ggml type {type_name}")
    size, symmetric, div = _BLOCK_GRID[type_name]
    sub = w.reshape(-1, size).double()
    span = sub.abs().amax(dim=1) if symmetric else sub.amax(dim=1) - sub.amin(dim=1)
    step = span / div
    err2 = float((step * step).sum()) * size / 12.0
    return (err2 / norm2) ** 0.5


def _mxfp4_err2(w: torch.Tensor) -> float:
    """err^2 of MXFP4 values (notation block): each value's grid step read off its block's scale."""
    sub = w.reshape(-1, 32).double()
    top = sub.abs().amax(dim=1, keepdim=True)
    s = torch.where(top > 0, torch.exp2(torch.floor(torch.log2(top.clamp_min(1e-300))) - 2), 0.0)
    r = sub.abs() / torch.where(s > 0, s, 1.0)
    step = torch.where(r < 2, 0.5, torch.where(r < 4, 1.0, 2.0)) * s
    return float((step * step).sum()) / 12.0


def _iq_err2(w: torch.Tensor, s: torch.Tensor, type_name: str) -> float:
    """err^2 of i-quant or ternary values w [sub-blocks, values per scale] with their scales s [sub-blocks]
    (notation block). Per sub-block where the step is the scale's alone; IQ4 reads each value's table entry, a
    chunk of rows at a time (a whole expert stack's levels at once would double its memory)."""
    s = s.double()
    if type_name in _GRID_STEP:
        return float((s * s).sum()) * w.shape[1] * _GRID_STEP[type_name] ** 2 / 12.0
    table = torch.tensor(IQ4NL_VALUES, dtype=torch.float32)
    gaps = table[1:] - table[:-1]
    spacing = torch.cat([gaps[:1], (gaps[1:] + gaps[:-1]) / 2, gaps[-1:]]).double()
    mids = (table[1:] + table[:-1]) / 2
    total = 0.0
    for c in range(0, w.shape[0], 1 << 16):  # IQ4_XS's scale may be negative, or 0 (its values 0: no step)
        sc = s[c : c + (1 << 16)]
        level = w[c : c + (1 << 16)].float() / torch.where(sc != 0, sc, 1.0).float()[:, None]
        step = spacing[torch.bucketize(level, mids)] * sc.abs()[:, None]  # the entry whose cell holds the level
        total += float((step * step).sum())
    return total / 12.0


def tensor_errors(gf: GGUFFile, num_layers: int) -> list[TensorError]:
    out = []
    for name, info in gf.tensors.items():
        block = block_of(name, num_layers)
        e = 0.0
        if block is not None:
            scales = sub_block_scales(gf.raw(name), info.ggml_type) if info.type_name in IQ_ERROR_TYPES else None
            e = relative_error(gf.tensor(name), info.type_name, scales)
        out.append(TensorError(name, info.type_name, block, e))
    return out


def block_errors(errors: list[TensorError]) -> dict[str, float]:
    """e(block): the sum of e(W) over the block's tensors."""
    total: dict[str, float] = {}
    for t in errors:
        if t.block is not None:
            total[t.block] = total.get(t.block, 0.0) + t.rel_error
    return total


def types_by_block(errors: list[TensorError]) -> dict[str, dict[str, int]]:
    """Tensor type counts per block, e.g. {"layer.1.attn": {"Q4_K": 3, "F32": 2}}."""
    counts: dict[str, Counter] = {}
    for t in errors:
        if t.block is not None:
            counts.setdefault(t.block, Counter())[t.ggml_type] += 1
    return {b: dict(sorted(c.items())) for b, c in counts.items()}


@dataclass(frozen=True)
class DequantCheck:
    available: bool  # the gguf package is installed
    checked: int  # tensors compared (every non-F32 tensor)
    mismatches: tuple[tuple[str, float], ...]  # (GGUF name, max |ours - gguf's|)

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def describe(self) -> str:
        if not self.available:
            return "gguf package not installed: dequantized tensors not cross-checked (pip install gguf)"
        if self.passed:
            return f"gguf package dequantizer: {self.checked} quantized/f16 tensors checked, all bit-identical"
        bad = ", ".join(f"{n} (max |diff| {d:.2e})" for n, d in self.mismatches[:5])
        return f"gguf package dequantizer: {len(self.mismatches)} of {self.checked} tensors differ: {bad}"


def check_dequantization(gf: GGUFFile) -> DequantCheck:
    """Our dequantized tensors vs the gguf package's `gguf.quants.dequantize`, bit for bit."""
    try:
        import gguf
        import numpy as np
    except ImportError:
        return DequantCheck(False, 0, ())
    mismatches, checked = [], 0
    for name, info in gf.tensors.items():
        if info.type_name == "F32":
            continue
        ours = gf.tensor(name)
        rows = ours.numel() // info.ne[0]
        raw = gf.raw(name).numpy().reshape(rows, -1)
        ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, info.ggml_type), dtype=np.float32))
        checked += 1
        ref = ref.reshape(ours.shape)
        if not torch.equal(ours, ref):
            mismatches.append((name, float((ours - ref).abs().max())))
    return DequantCheck(True, checked, tuple(mismatches))

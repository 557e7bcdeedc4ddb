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
                  V mod N ranks one row more); logits are gathered on rank 0
  GGUF            rows are byte ranges of whole blocks; a column split must fall on a block
                  boundary of the tensor's type (else an error naming the tensor and N)
  replicated      the rest: q_a_proj (c_q), kv_a_proj_with_mqa (c_kv, k_pe: every head reads the
                  same latent rows, so each rank keeps the whole latent cache), norms, the DSA
                  indexer (its top-k must be the same on every rank), the MoE gate
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.loading.safetensors_source import WeightError

_RULES = (
    (re.compile(r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$"), "rows"),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), "columns"),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), "first"),
    (re.compile(r"\.mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj)\.weight$"), "rows"),
    (re.compile(r"\.mlp\.(shared_experts\.|experts\.\d+\.)?down_proj\.weight$"), "columns"),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocabulary"),
)


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


def rank_config(cfg: ModelConfig, rank: int, n: int) -> ModelConfig:
    """The model config rank r runs: its heads, its slice of every intermediate dim and of V."""
    check_splits(cfg, n)
    start, stop = vocab_range(cfg.vocab_size, rank, n)
    moe = replace(cfg.moe, moe_intermediate_size=cfg.moe.moe_intermediate_size // n) if cfg.moe else None
    return replace(
        cfg,
        num_heads=cfg.num_heads // n,
        intermediate_size=cfg.intermediate_size // n,
        vocab_size=stop - start,
        moe=moe,
    )


class ShardedSource:
    """A tensor source (safetensors folder or GGUF file) seen by one rank: get(name) returns only
    this rank's slice, read as a slice when the source can (safetensors: get_slice; GGUF: only
    the slice's blocks are dequantized); other sources are read whole and narrowed."""

    def __init__(self, source, cfg: ModelConfig, rank: int, n: int) -> None:
        self.source, self.rank, self.n = source, rank, n
        self.vocab = vocab_range(cfg.vocab_size, rank, n)

    def names(self) -> list[str]:
        return self.source.names()

    def where(self, name: str) -> str:
        return self.source.where(name)

    def release(self, name: str) -> None:
        if hasattr(self.source, "release"):
            self.source.release(name)

    def get(self, name: str) -> torch.Tensor:
        kind = split_of(name)
        if kind == "replicated" or (kind == "first" and self.rank == 0):
            return self.source.get(name)
        shape = tuple(self.source.shape(name))
        if kind == "first":
            return torch.zeros(shape)
        dim = 0 if kind in ("rows", "vocabulary") else 1
        start, stop = self.vocab if kind == "vocabulary" else self._even(name, shape, dim)
        if not hasattr(self.source, "get_slice"):
            return self.source.get(name).narrow(dim, start, stop - start)
        try:
            return self.source.get_slice(name, dim, start, stop)
        except ValueError as e:  # e.g. a GGUF column split inside a quantization block
            raise WeightError(f"{e} (tensor_parallel_size={self.n}, rank {self.rank})") from e

    def _even(self, name: str, shape: tuple[int, ...], dim: int) -> tuple[int, int]:
        if len(shape) <= dim or shape[dim] % self.n:
            raise WeightError(
                f"{self.where(name)}: tensor {name!r} of shape {list(shape)} does not split evenly "
                f"into {self.n} parts along dim {dim} (tensor_parallel_size={self.n})"
            )
        part = shape[dim] // self.n
        return self.rank * part, (self.rank + 1) * part

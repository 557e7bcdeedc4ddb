"""Which tokens a row may take next, and how much more or less likely: OpenAI's `logit_bias` and the row's
grammar (structured output, tool calls), applied to the whole batch's logits in one step, first in the
sampling pipeline (sampler.py), so penalties, min_tokens, temperature and the top-k/p/min-p filters see
only allowed tokens. Speculative verification (rejection.py) applies the same step.

Notation
--------
    B   rows in the batch
    V   vocabulary size
    W   ceil(V / 32): 32-bit words of one row's bitmask
    logits        float32 [B, V]
    logit_bias    float32 [B, V]   added; zeros for a row without a bias; None when no row has one
    token_bitmask int32   [B, W]   bit t % 32 of word t // 32 set iff token t is allowed (structured/backend
                                   fills it, one row per constrained request; free rows all ones)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlaserve.sampling.params import SamplingParams

_NEG_INF = float("-inf")
_BIT = torch.arange(32, dtype=torch.int32)


def logit_bias_rows(params: Sequence[SamplingParams], V: int, dev: torch.device) -> torch.Tensor | None:
    """float32 [B, V] of the rows' logit_bias (zeros elsewhere); None when no row has one."""
    if not any(p.logit_bias for p in params):
        return None
    rows, toks, vals = [], [], []
    for row, p in enumerate(params):  # a few entries per biased row: the dict is the request's own data
        for tok, v in (p.logit_bias or {}).items():
            if tok < V:
                rows.append(row)
                toks.append(tok)
                vals.append(v)
    bias = torch.zeros(len(params), V, dtype=torch.float32)
    bias[torch.tensor(rows, dtype=torch.int64), torch.tensor(toks, dtype=torch.int64)] = torch.tensor(vals)
    return bias.to(dev)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] -> bool [B, V]: token t allowed iff bit t % 32 of word t // 32 is set."""
    bits = (bitmask.unsqueeze(-1) >> _BIT.to(bitmask.device)) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bias_and_grammar(
    logits: torch.Tensor, logit_bias: torch.Tensor | None, token_bitmask: torch.Tensor | None
) -> torch.Tensor:
    """logit_bias (added), then the grammar mask (forbidden tokens -> -inf); a new tensor when either
    applies, `logits` itself (untouched) when neither does."""
    if logit_bias is not None:
        logits = logits + logit_bias
    if token_bitmask is not None:
        logits = logits.masked_fill(~unpack_bitmask(token_bitmask, logits.shape[-1]), _NEG_INF)
    return logits

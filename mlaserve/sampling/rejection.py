"""Rejection sampling for speculative decoding: the kept token is distributed exactly as the target's
distribution, whatever the draft proposed (Leviathan et al. 2023, Chen et al. 2023).

Notation
  B        rows (one verify position of one request each)
  p [B, V] the target's distribution at that position: the same logit_bias, grammar mask, penalties,
           min_tokens mask, temperature and top-k/top-p/min-p filters as plain sampling (target_probs)
  q [B, V] the draft's distribution for its token d [B]; one-hot when the draft is greedy (MTP drafts are)
  u [B]    uniform in [0, 1)
Rule: accept d iff u < p(d) / q(d); else draw from the residual r = max(p - q, 0) / sum(max(p - q, 0)).
P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x) = min(p, q)(x) + max(p - q, 0)(x) = p(x).
With a one-hot q the residual is p with d removed, renormalised.
"""

from __future__ import annotations

import torch

from mlaserve.sampling.sampler import (
    SamplingBatch,
    _apply_min_tokens,
    _apply_penalties,
    _exponential_race,
    filtered_probs,
)
from mlaserve.sampling.token_mask import apply_bias_and_grammar


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """p [B, V]: what `sample` draws from for random rows (greedy rows use temperature 1 here; callers
    take greedy rows through `sample`'s argmax instead). logit_bias and the grammar mask included: a draft
    the row's grammar forbids has p = 0, so it is rejected and the residual draw obeys the grammar."""
    logits = apply_bias_and_grammar(logits.float(), batch.logit_bias, batch.token_bitmask)
    return filtered_probs(_apply_min_tokens(_apply_penalties(logits, batch), batch), batch)


def uniform(n: int, generators: dict[int, torch.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """u [n]; a seeded row draws from its own generator (so it does not depend on the other rows)."""
    u = torch.rand(n, device=device)
    for row, gen in generators.items():
        # a request's generator lives on the CPU (sampler.make_generator): draw there, then place the value
        u[row] = torch.rand(1, generator=gen, device=gen.device)[0].to(device)
    return u


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    generators: dict[int, torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (token [B], accepted [B] bool): d where accepted, else a draw from the residual."""
    generators = generators or {}
    rows = torch.arange(p.shape[0], device=p.device)
    p_d, q_d = p[rows, draft], q[rows, draft]
    u = uniform(p.shape[0], generators, p.device)
    accepted = u * q_d < p_d  # u < p(d)/q(d) without dividing by q(d) = 0
    residual = (p - q).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # Rows where p <= q everywhere accept surely (mass 0); give them p so the draw below is defined.
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
    resampled = _exponential_race(residual, generators)
    return torch.where(accepted, draft, resampled), accepted


def one_hot(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """q of a greedy draft: all mass on the drafted token."""
    return torch.nn.functional.one_hot(draft, vocab).float()

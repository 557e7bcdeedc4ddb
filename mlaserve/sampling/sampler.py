"""Batched token sampler: every request keeps its own SamplingParams, one set of tensor ops.

Notation
--------
    B   rows in the batch (one per sequence being decoded this step)
    V   vocabulary size (the logits' last dimension)
    N   number of top logprobs requested (max over the rows)
    logits      float32 [B, V]   model output for the last position of each row
    token_ids   int64   [B]      the sampled tokens

Pipeline for one step (`sample`)
--------------------------------
    raw logprobs = log_softmax(logits)                  (only if logprobs are requested)
    logits = logits + logit_bias                        per-row additive bias (OpenAI logit_bias)  } token_mask.py
    logits = grammar mask(logits)                       tokens the row's grammar forbids -> -inf   }
    logits = penalties(logits)                          repetition / presence / frequency
    logits = min_tokens mask(logits)                    EOS and stop ids -> -inf while too short
    greedy rows:  argmax(logits)
    random rows:  logits / temperature -> top-k -> top-p -> min-p -> softmax
                  -> exponential race: argmax(probs / q), q ~ Exponential(1)

Every stage runs on the whole [B, V] tensor with per-row parameter tensors; a row
whose parameter is "off" (temperature 1, top_k 0, top_p 1, min_p 0, no penalty) goes
through each stage *bit-for-bit unchanged*. That is what makes a request's result
independent of what else is in the batch, and the `no_*` flags let the common
case skip whole stages.

The only Python loop over rows is the random-number draw for rows with their own
`torch.Generator` (seeded requests): a generator produces one stream, so each such
row draws its [V] noise from it; all other rows share one batched draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from mlaserve.sampling.params import SamplingParams
from mlaserve.sampling.token_mask import apply_bias_and_grammar, logit_bias_rows

__all__ = [
    "SamplingBatch",
    "SamplerOutput",
    "sample",
    "gather_logprobs",
    "make_generator",
]

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request.

    Create it once per request (per sequence for n > 1, e.g. seed + index) and pass the
    same object every step: its state advances with each draw, which is what makes
    the whole token sequence reproducible.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    # Raw logprobs (log_softmax of the model logits, see `sample`): column 0 is the
    # sampled token, columns 1..N the top-N tokens in descending order. None when
    # no logprobs were requested.
    logprobs: torch.Tensor | None = None  # float32 [B, 1+N]
    logprob_token_ids: torch.Tensor | None = None  # int64 [B, 1+N]
    # Rank of the sampled token under the raw distribution (1 = most likely).
    sampled_ranks: torch.Tensor | None = None  # int64 [B]


def _per_row():
    """A SamplingBatch field with one entry per row (dim 0)."""
    return field(metadata={"per_row": True})


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step, as tensors on the logits' device.

    Build it with `SamplingBatch.build`; the fields below are what `sample` reads.
    Rows are in the same order as the logits' rows.
    """

    vocab_size: int
    # Fields marked _per_row() have one entry per row along dim 0 (`select` picks rows of them).
    # Greedy rows: temperature stored as 1.0 so the batched division is harmless.
    temperature: torch.Tensor = _per_row()  # float32 [B]
    is_greedy: torch.Tensor = _per_row()  # bool [B]
    top_k: torch.Tensor = _per_row()  # int64 [B], 0 = off, otherwise clamped to [1, V]
    top_p: torch.Tensor = _per_row()  # float32 [B], 1 = off
    min_p: torch.Tensor = _per_row()  # float32 [B], 0 = off
    repetition_penalty: torch.Tensor = _per_row()  # float32 [B], 1 = off
    presence_penalty: torch.Tensor = _per_row()  # float32 [B], 0 = off
    frequency_penalty: torch.Tensor = _per_row()  # float32 [B], 0 = off
    # Only built when some row uses the penalty that needs it.
    output_counts: torch.Tensor | None = _per_row()  # float32 [B, V]: occurrences in the output
    seen_mask: torch.Tensor | None = _per_row()  # bool [B, V]: token in prompt or output
    # Structured output: bit t of row i (word t // 32, bit t % 32) set iff the row's grammar allows
    # token t next; unconstrained rows are all ones. None when no row is constrained.
    token_bitmask: torch.Tensor | None = _per_row()  # int32 [B, ceil(V/32)]
    logit_bias: torch.Tensor | None = _per_row()  # float32 [B, V], added to the logits; None if no row has one
    # (row, token) pairs to force to -inf because the row is below min_tokens.
    banned_rows: torch.Tensor | None  # int64 [M]
    banned_tokens: torch.Tensor | None  # int64 [M]
    generators: dict  # row -> torch.Generator, random rows only
    # Fast-path flags.
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    max_top_k: int  # largest active top_k (0 if none): size of the torch.topk call
    max_num_logprobs: int | None  # largest `logprobs` asked by a row, None if none

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        *,
        eos_token_id: int | None | Sequence[int] = None,
        device: torch.device | str | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors.

        prompt_ids / output_ids: each row's tokens so far; read only when a row uses a
        penalty (or min_tokens, which needs the output length).
        generators: the row's own generator (seeded requests, see `make_generator`;
        on `device`) or None; used only for non-greedy rows.
        eos_token_id: masked, with the row's stop_token_ids, while the row has fewer
        than `min_tokens` output tokens (unless ignore_eos, as in vLLM).
        device: where the tensors live (the logits' device); default CPU.
        token_bitmask: int32 [B, ceil(V/32)] from the rows' grammars (structured/backend.fill_bitmask).
        """
        B = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == B):
            raise ValueError(
                f"params, prompt_ids, output_ids and generators must have the same length, got "
                f"{B}, {len(prompt_ids)}, {len(output_ids)}, {len(generators)}"
            )
        if B == 0:
            raise ValueError("cannot build a SamplingBatch with no rows")
        V = vocab_size
        dev = torch.device(device) if device is not None else torch.device("cpu")

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=dev)

        greedy = [p.greedy for p in params]
        top_k = [min(p.top_k, V) for p in params]
        rep = [p.repetition_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]

        need_seen = any(r != 1.0 for r in rep)
        need_counts = any(x != 0.0 for x in pres + freq)
        output_counts, seen_mask = _penalty_counts(prompt_ids, output_ids, V, dev, need_seen, need_counts)
        banned_rows, banned_tokens = _min_tokens_bans(params, output_ids, V, eos_token_id)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        if token_bitmask is not None and tuple(token_bitmask.shape) != (B, (V + 31) // 32):
            raise ValueError(f"token_bitmask must be [{B}, {(V + 31) // 32}], got {list(token_bitmask.shape)}")
        return cls(
            vocab_size=V,
            temperature=f32([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=dev),
            top_p=f32([p.top_p for p in params]),
            min_p=f32([p.min_p for p in params]),
            repetition_penalty=f32(rep),
            presence_penalty=f32(pres),
            frequency_penalty=f32(freq),
            output_counts=output_counts,
            seen_mask=seen_mask,
            token_bitmask=token_bitmask.to(dev) if token_bitmask is not None else None,
            logit_bias=logit_bias_rows(params, V, dev),
            banned_rows=torch.tensor(banned_rows, dtype=torch.int64, device=dev) if banned_rows else None,
            banned_tokens=torch.tensor(banned_tokens, dtype=torch.int64, device=dev) if banned_rows else None,
            generators={row: gen for row, gen in enumerate(generators) if gen is not None and not greedy[row]},
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=not (need_seen or need_counts),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p == 0.0 for p in params),
            max_top_k=max(top_k),
            max_num_logprobs=max(requested) if requested else None,
        )

    def select(self, rows: Sequence[int]) -> SamplingBatch:
        """The batch of `rows` (in that order): per-row fields, min_tokens bans and generators
        renumbered. The fast-path flags stay the whole batch's: they only skip stages that leave the
        rows where they hold unchanged, so a stage run for a subset changes nothing either."""
        idx = torch.tensor(list(rows), device=self.temperature.device)
        picked = {
            f.name: getattr(self, f.name)[idx]
            for f in fields(self)
            if f.metadata.get("per_row") and getattr(self, f.name) is not None
        }
        new_row = {int(r): j for j, r in enumerate(rows)}
        banned_rows = banned_tokens = None
        if self.banned_rows is not None:
            keep = [
                (new_row[int(r)], int(t)) for r, t in zip(self.banned_rows, self.banned_tokens) if int(r) in new_row
            ]
            if keep:
                banned_rows = torch.tensor([r for r, _ in keep], device=idx.device)
                banned_tokens = torch.tensor([t for _, t in keep], device=idx.device)
        generators = {new_row[r]: g for r, g in self.generators.items() if r in new_row}
        return replace(self, **picked, banned_rows=banned_rows, banned_tokens=banned_tokens, generators=generators)


def _penalty_counts(
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    V: int,
    dev: torch.device,
    need_seen: bool,
    need_counts: bool,
):
    """(output token counts [B, V] for presence/frequency penalties, seen mask [B, V] for the
    repetition penalty); each None when no row needs it."""
    output_counts = _token_counts(output_ids, V, dev) if need_counts else None
    if not need_seen:
        return output_counts, None
    in_output = output_counts if output_counts is not None else _token_counts(output_ids, V, dev)
    return output_counts, (_token_counts(prompt_ids, V, dev) > 0) | (in_output > 0)


def _min_tokens_bans(
    params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]], V: int, eos_token_id
) -> tuple[list[int], list[int]]:
    """(rows, tokens) to mask: every stop id of a row still below its min_tokens."""
    rows, tokens = [], []
    for row, p in enumerate(params):
        if len(output_ids[row]) < p.min_tokens:
            for tok in p.all_stop_token_ids(eos_token_id):
                if tok < V:
                    rows.append(row)
                    tokens.append(tok)
    return rows, tokens


def _token_counts(seqs: Sequence[Sequence[int]], V: int, device: torch.device) -> torch.Tensor:
    """float32 [B, V]: how often each token id occurs in each row's sequence.

    Rows are padded with the id V, counted in an extra column that is then dropped
    (one scatter_add for the whole batch instead of a bincount per row).
    Ids outside [0, V) are ignored the same way.
    """
    B = len(seqs)
    width = max(1, max(len(s) for s in seqs))
    table = torch.full((B, width), V, dtype=torch.int64)
    for row, s in enumerate(seqs):
        if s:
            table[row, : len(s)] = torch.as_tensor(s, dtype=torch.int64)
    table = table.to(device)
    table = table.masked_fill((table < 0) | (table > V), V)
    counts = torch.zeros(B, V + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, table, torch.ones_like(table, dtype=torch.float32))
    return counts[:, :V]


# --------------------------------------------------------------------------- sampling


def plain_greedy(params: SamplingParams, n_output: int) -> bool:
    """Whether sample() gives this row the argmax of its logits as they are: greedy, no penalty, no logit_bias, no
    logprobs, past min_tokens (no stop id masked). The caller also checks that no grammar constrains the row."""
    return (
        params.greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and n_output >= params.min_tokens
    )


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    num_logprobs: int | None = None,
) -> SamplerOutput:
    """Pick one token per row.

    logits: [B, V]; converted to float32 if needed; never modified in place.
    num_logprobs: N top logprobs to return per row (0 = only the sampled token's);
    None (default) means `batch.max_num_logprobs`, i.e. what the rows asked for,
    which is itself None when no row asked, and then no logprobs are computed.
    The caller slices each row down to its own request's N.

    Logprob semantics (vLLM's default "raw_logprobs"): log_softmax of the logits
    as the model produced them -- before penalties, the min_tokens mask,
    temperature and the top-k/top-p/min-p filters. They describe the model, not
    the sampling procedure: a token excluded by top-k still has a finite logprob,
    and with penalties the sampled token need not be the raw argmax.
    """
    if logits.dim() != 2 or logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits must be [B, {batch.vocab_size}], got {list(logits.shape)}")
    if logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} rows, batch has {batch.temperature.shape[0]}")
    logits = logits.float()
    if num_logprobs is None:
        num_logprobs = batch.max_num_logprobs
    # Computed first: later stages replace `logits`, but raw logprobs describe the model.
    raw_logprobs = logits.log_softmax(dim=-1) if num_logprobs is not None else None

    logits = apply_bias_and_grammar(logits, batch.logit_bias, batch.token_bitmask)
    logits = _apply_penalties(logits, batch)
    logits = _apply_min_tokens(logits, batch)

    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        random_ids = _sample_random(logits, batch)
        if batch.all_random:
            token_ids = random_ids
        else:
            token_ids = torch.where(batch.is_greedy, logits.argmax(dim=-1), random_ids)

    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids)
    lps, ids, ranks = gather_logprobs(raw_logprobs, token_ids, num_logprobs)
    return SamplerOutput(token_ids, lps, ids, ranks)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick out, per row, the logprob of `token_ids` and the top-N logprobs.

    logprobs: float [T, V] (already log_softmax-ed); token_ids: int64 [T].
    Returns (values [T, 1+N], ids [T, 1+N], rank of token_ids [T]) where column 0 is
    `token_ids` and columns 1..N the top-N in descending order. Also usable for prompt
    logprobs (T prompt positions, token_ids = the next prompt token).
    """
    n = min(num_logprobs, logprobs.shape[-1])
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [T, 1]
    # Rank = 1 + number of strictly more likely tokens (ties share the better rank).
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if n > 0:
        top_values, top_ids = logprobs.topk(n, dim=-1)
        values = torch.cat([chosen, top_values], dim=1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
    else:
        values, ids = chosen, token_ids.unsqueeze(1)
    return values, ids, ranks


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics; returns a new tensor (the input stays raw for logprobs).

    repetition (tokens seen in prompt or output): positive logits / penalty, negative
    ones * penalty -- both make the token less likely when penalty > 1.
    frequency: subtract penalty * count in the output; presence: subtract penalty once
    if the token is in the output at all.
    Rows without a penalty have 1.0 / 0.0 here, for which every op is exact identity.
    """
    if batch.no_penalties:
        return logits
    if batch.seen_mask is not None:
        rep = batch.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(batch.seen_mask, penalised, logits)
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
    return logits


def _apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.banned_rows is None:
        return logits
    neg_inf = torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device)
    return logits.index_put((batch.banned_rows, batch.banned_tokens), neg_inf)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, filters, then one exponential-race draw for every row."""
    return _exponential_race(filtered_probs(logits, batch), batch.generators)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a random row draws from: temperature, then top-k / top-p / min-p, softmax
    (speculative verification's target distribution is this very function)."""
    logits = logits / batch.temperature.unsqueeze(1)
    if not batch.no_top_k:
        logits = _apply_top_k(logits, batch.top_k, batch.max_top_k)
    if not batch.no_top_p:
        logits = _apply_top_p(logits, batch.top_p)
    if not batch.no_min_p:
        logits = _apply_min_p(logits, batch.min_p)
    return logits.softmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep the tokens whose logit is >= the row's k-th largest (ties at the edge kept).

    torch.topk with the largest k in the batch is much cheaper than a full sort of V.
    """
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(1, max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill((top_k == 0).unsqueeze(1), _NEG_INF)  # off: threshold -inf keeps all
    return logits.masked_fill(logits < kth, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus: keep the smallest most-likely set whose mass is >= top_p.

    Sorted descending, a token is kept iff the mass strictly before it is < top_p:
    that keeps exactly the tokens up to and including the one that reaches top_p,
    and always the most likely token (mass before it is 0).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    # top_p == 1 means off: rounding in the cumsum must not drop the far tail.
    drop_sorted &= (top_p < 1.0).unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob.

    In logit space: p_i / p_max = exp(l_i - l_max), so the test is l_i < l_max + log(min_p);
    no softmax needed, and min_p = 0 gives log 0 = -inf, which drops nothing.
    The ratio does not change under renormalisation, so applying this after top-k/top-p
    is the same as applying it to their renormalised distribution.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _exponential_race(probs: torch.Tensor, generators: dict) -> torch.Tensor:
    """argmax_i(p_i / q_i) with q_i ~ Exponential(1) is a draw from p.

    (q_i / p_i is Exponential with rate p_i; the smallest of independent exponentials
    is index i with probability p_i / sum p.) Unlike torch.multinomial it needs no
    per-row call, and a row's result depends only on its own probs and noise.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()  # one shared draw for the unseeded rows
    for row, gen in generators.items():
        # Seeded rows: draw [V] from the row's own stream, so the noise does not
        # depend on the row index or on the other rows. A generator on another device
        # than the logits (a request's CPU generator, CUDA logits) draws where it lives.
        if gen.device == q.device:
            q[row].exponential_(generator=gen)
        else:
            q[row].copy_(torch.empty(q.shape[-1], dtype=q.dtype, device=gen.device).exponential_(generator=gen))
    # exponential_ can return exactly 0 (u == 0 in -log(1-u)): 0/0 = nan would win
    # argmax even for a masked token. Clamping keeps p = 0 tokens at score 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)

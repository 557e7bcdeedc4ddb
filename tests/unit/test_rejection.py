"""Rejection sampling keeps the target distribution exactly: on a vocabulary of 6, 20,000 draws of
(draft from q, then accept or resample) match p by a chi-square test (fixed seed), for a random draft
distribution and for greedy (one-hot) drafts; a biased rule (always accept) is rejected by the same test."""

from __future__ import annotations

import torch

from mlaserve.sampling.rejection import one_hot, rejection_sample

V, N = 6, 20_000


def chi_square_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """P-value of the counts of `tokens` under p; a token with p = 0 that occurs gives 0."""
    counts = torch.bincount(tokens, minlength=V).double()
    support = p > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = p.double()[support] * N
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g).pow(2)
    q = torch.rand(V, generator=g).pow(2)
    return p / p.sum(), q / q.sum()


def test_random_draft_keeps_target_distribution():
    torch.manual_seed(0)
    p, q = _dists(1)
    draft = torch.multinomial(q, N, replacement=True)
    tokens, accepted = rejection_sample(p.expand(N, V), q.expand(N, V), draft)
    assert chi_square_pvalue(tokens, p) > 0.01
    # the acceptance rate is sum_x min(p, q)(x), the overlap of the two distributions
    assert abs(accepted.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.02
    assert chi_square_pvalue(draft, p) < 1e-6  # the test has the power to see a wrong distribution


def test_greedy_draft_keeps_target_distribution():
    torch.manual_seed(1)
    p, _ = _dists(2)
    draft = torch.full((N,), int(p.argmin()))  # a poor greedy draft: one-hot on the least likely token
    tokens, accepted = rejection_sample(p.expand(N, V), one_hot(draft, V), draft)
    assert chi_square_pvalue(tokens, p) > 0.01
    assert abs(accepted.float().mean().item() - p.min().item()) < 0.01


def test_seeded_rows_are_reproducible():
    p, q = _dists(3)
    draft = torch.tensor([0, 1, 2, 3])

    def run():
        gens = {i: torch.Generator().manual_seed(10 + i) for i in range(4)}
        return rejection_sample(p.expand(4, V), q.expand(4, V), draft, gens)

    a, b = run(), run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_verify_position_keeps_the_sampling_distribution():
    """engine/speculative.choose on 20,000 copies of one verify position: temperature, top-k and a
    repetition penalty shape p (written out here), a greedy draft proposes one token, and the kept
    token follows p; greedy rows keep plain argmax."""
    from mlaserve.engine.speculative import choose
    from mlaserve.sampling.params import SamplingParams
    from mlaserve.sampling.sampler import SamplingBatch

    torch.manual_seed(5)
    logits = torch.tensor([2.0, 1.5, -0.5, 1.0, 0.2, -1.0])
    params = SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.5)
    history = [0, 2]  # tokens 0 and 2 were seen
    pen = logits.clone()
    for t in history:
        pen[t] = pen[t] / 1.5 if pen[t] > 0 else pen[t] * 1.5
    scaled = pen / 0.7
    keep = scaled >= scaled.topk(4).values[-1]
    p = torch.where(keep, scaled, torch.tensor(float("-inf"))).softmax(-1)
    batch = SamplingBatch.build([params] * N, [history] * N, [[]] * N, [None] * N, V)
    tokens, accepted, _ = choose(logits.expand(N, V), batch, [3] * N)
    tokens = torch.tensor(tokens)
    assert chi_square_pvalue(tokens, p) > 0.01
    assert abs(sum(accepted) / N - p[3].item()) < 0.015
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [[1]] * 2, [[]] * 2, [None] * 2, V)
    tok, ok, _ = choose(logits.expand(2, V), greedy, [0, 1])
    assert tok == [0, 0] and ok == [True, False]

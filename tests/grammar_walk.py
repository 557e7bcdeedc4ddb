"""A seeded random walk over the tokens a grammar allows (a model at temperature infinity: the hardest
sampler for a grammar, since it takes every odd path), for the grammar tests."""

from __future__ import annotations

import random

import torch

from mlaserve.sampling.token_mask import unpack_bitmask
from mlaserve.structured.spec import StructuredOutputs


def byte_level_tokens_with(tokenizer, byte: int) -> set[int]:
    """Ids of the byte-level BPE tokens whose bytes hold `byte` (GPT-2's byte <-> character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    return {i for t, i in tokenizer.tok.get_vocab().items() if chars[byte] in t}


def walk(
    backend, spec: StructuredOutputs, stop_ids: set[int], avoid: set[int], rng: random.Random, max_steps: int = 400
) -> tuple[list[int], bool]:
    """-> (tokens, ended by a stop token the grammar allowed); never takes a token in `avoid`."""
    matcher = backend.matcher(spec)
    vocab = backend.vocab_size
    tokens: list[int] = []
    for _ in range(max_steps):
        mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        matcher.fill(mask, 0)
        allowed = [t for t in unpack_bitmask(mask, vocab)[0].nonzero().flatten().tolist() if t not in avoid]
        assert allowed, f"the grammar allows no token after {tokens}"
        tok = rng.choice(allowed)
        matcher.accept(tok)
        if tok in stop_ids:
            assert matcher.is_terminated
            return tokens, True
        tokens.append(tok)
    return tokens, False

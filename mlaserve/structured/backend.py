"""The grammar engine (xgrammar) behind one small interface.

    backend = GrammarBackend(tokenizer, vocab_size, stop_ids)   # once per engine, on first use
    matcher = backend.matcher(spec)                             # at add_request: compiles (cached)
    bitmask = fill_bitmask([matcher or None per row], vocab)    # each step: int32 [B, ceil(V/32)]
    matcher.accept(token)                                       # each sampled token

A spec the engine cannot compile raises ValueError("structured <kind>: ..."), which the server turns
into a 400 naming the part. Each mask also keeps the output well-formed UTF-8 (structured/utf8.py:
xgrammar's byte classes let surrogates and overlong forms through). The bitmask is what
`sampling.sampler.sample` applies to the logits before every other stage; this module is the only one that
imports xgrammar.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence

import torch

from mlaserve.structured.reasoning import after_reasoning_tag
from mlaserve.structured.spec import StructuredOutputs, choice_regex
from mlaserve.structured.strict import plain_length_strings
from mlaserve.structured.utf8 import BOUNDARY, Utf8State, Utf8Table

_ERR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:123: " prefix
_CACHE_LIMIT = 256  # compiled grammars kept (xgrammar also caches, by bytes)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class Matcher:
    """One request's position in its grammar, and in UTF-8 (structured/utf8.py)."""

    def __init__(self, matcher, utf8: Utf8State) -> None:
        self._m = matcher
        self._utf8 = utf8

    def accept(self, token_id: int) -> None:
        """Raises ValueError for a token the grammar or UTF-8 forbids (the engine fails the request); neither
        automaton moves then, so a rollback after it stays consistent."""
        after = self._utf8.check(int(token_id))
        if not self._m.accept_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed by the request's grammar")
        self._utf8.states.append(after)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        self._utf8.narrow(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)
        self._utf8.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    @property
    def in_character(self) -> bool:
        """Whether the output so far ends inside a multi-byte character (its next token must continue it)."""
        return self._utf8.states[-1] != BOUNDARY


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        textless = [*self.info.special_token_ids, *self.info.stop_token_ids]
        self.utf8 = Utf8Table(self.info.decoded_vocab, textless, vocab_size)
        self._cache: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(spec)
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the reason
            why = _ERR_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__
            raise ValueError(f"structured {spec.kind}: cannot be compiled: {why}") from None
        with self._lock:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def _compile(self, spec: StructuredOutputs):
        c = self.compiler
        if spec.after_reasoning is not None:  # the reasoning block, then the constraint (structured/reasoning.py)
            return c.compile_structural_tag(after_reasoning_tag(spec))
        kind = spec.kind
        if kind == "json":
            # Compact JSON (no free whitespace): the output still validates, and a model cannot spend
            # its tokens on blank space. strict_mode: properties a schema does not name are not generated.
            schema = json.dumps(plain_length_strings(spec.schema))
            return c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            return c.compile_regex(choice_regex(spec.choice))
        if kind == "structural_tag":
            return c.compile_structural_tag(spec.structural_tag)
        return c.compile_grammar(spec.grammar)

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        return Matcher(self._xgr.GrammarMatcher(self.compile(spec)), Utf8State(self.utf8))


def fill_bitmask(matchers: Sequence[Matcher | None], vocab_size: int) -> torch.Tensor | None:
    """int32 [B, ceil(V/32)]: bit t of row i (word t // 32, bit t % 32) set iff token t may follow;
    rows without a matcher allow everything. None when no row is constrained."""
    if all(m is None for m in matchers):
        return None
    bitmask = torch.full((len(matchers), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for row, m in enumerate(matchers):
        if m is not None:
            m.fill(bitmask, row)
    return bitmask

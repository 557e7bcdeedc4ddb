"""Incremental detokenization with stop strings.

Text is produced in two stages for every new token:

1. UTF-8 completion (prefix_offset / read_offset technique).
   With byte-level BPE one character can be split over several tokens, and decoding
   a token alone gives U+FFFD for the incomplete bytes. We keep a small window of ids:

       ids[prefix_offset:read_offset]   already emitted; kept as decoding context
       ids[read_offset:]                not emitted yet

   and decode two slices that start at the same token,
       prefix_text = decode(ids[prefix_offset:read_offset])
       new_text    = decode(ids[prefix_offset:])
   If new_text is longer and does not end in U+FFFD, the delta is
   new_text[len(prefix_text):] and the window slides (prefix <- read, read <- end);
   otherwise we wait for more tokens. Starting both decodes at the same token makes
   decoder effects at the window start (leading-space stripping, a partial character
   that the window cut through) cancel out, and the window stays a few tokens long
   instead of re-decoding the whole output each step. The window starts with the last
   few prompt tokens, as in vLLM, so the first output token is decoded in context.

2. Stop strings. On the UTF-8-complete text we look for the stop strings. Text that
   could still be the start of a stop string (the longest suffix that is a proper
   prefix of one, at most max(len(stop)) - 1 characters) is held back until the next
   token decides it; `finish()` flushes it. When a stop string appears, text up to it
   (plus the stop string if include_stop_str_in_output) is emitted, `stopped_by` is
   set, and nothing after it is ever emitted.

Invariant (tested): for byte-level BPE tokenizers, once `finish()` has been called,
the concatenation of all returned deltas == tokenizer.decode(output_ids,
skip_special_tokens=...) truncated at the stop string. For Metaspace (SentencePiece
style, "▁hello") decoders the one difference is the first output token's leading
space: decode(output_ids) strips it, we keep it because the token is decoded after
the prompt context (vLLM behaves the same).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens kept at the start of the window as decoding context (vLLM uses 5).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas, one call per step.

    Usage: `delta = detok.add(new_ids)` each step (stream `delta` if non-empty); when
    `detok.stopped_by` is set the request is finished; otherwise at the end of the
    request call `detok.finish()` and stream what it returns.

    Pass only tokens that should appear in the text: the engine should not `add` the
    EOS / stop_token_ids token that ended the request (vLLM drops it unless
    include_stop_str_in_output). With skip_special_tokens it would decode to "" anyway.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        # A proper prefix of a stop string is at most len - 1 characters.
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1

        # Window of ids (prompt context + output not yet slid past), see module doc.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # cache of decode(ids[prefix:read])

        self._pending = ""  # UTF-8-complete text held back as a possible stop-string start
        self._output: list[str] = []  # every delta returned so far
        self._stopped_by: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public API

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stopped_by

    @property
    def finished(self) -> bool:
        """True after a stop string was found or `finish()` was called."""
        return self._finished

    @property
    def output_text(self) -> str:
        """All text returned so far (the final text once finished)."""
        return "".join(self._output)

    def add(self, token_ids: list[int]) -> str:
        """Feed newly generated token ids; return the newly finalised text (maybe "").

        Tokens after a stop string (in this call or later ones) are ignored.
        """
        if self._finished:
            if self._stopped_by is not None:
                return ""
            raise RuntimeError("add() called after finish()")
        parts = []
        # One token at a time so that a character completed mid-list is released
        # even if the list ends with an incomplete one.
        for token_id in token_ids:
            delta = self._utf8_step(token_id)
            if delta:
                parts.append(self._stop_step(delta, final=False))
                if self._stopped_by is not None:
                    break
        return self._emit("".join(parts))

    def finish(self) -> str:
        """End of the request: return the text still held back (may be "").

        An incomplete UTF-8 tail is released as U+FFFD, as tokenizer.decode would.
        """
        if self._finished:
            return ""
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        text = self._stop_step(delta, final=True)
        self._finished = True
        return self._emit(text)

    # ------------------------------------------------------------------ internals

    def _emit(self, text: str) -> str:
        if text:
            self._output.append(text)
        return text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._prefix_text

    def _utf8_step(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is split)."""
        self._ids.append(token_id)
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._prefix_offset, len(self._ids))
        # Not longer: the token decoded to nothing (e.g. a skipped special token).
        # Ends in U+FFFD: the last character's bytes are not all here yet.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window; drop ids before the new prefix so it stays short.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def _stop_step(self, delta: str, final: bool) -> str:
        """Run stop-string detection over held-back text + delta; return what to emit."""
        if not self._stop:
            return delta
        text = self._pending + delta
        # `pending` had no complete stop string, so any match ends inside `delta`;
        # and every match that starts before `delta` starts inside `pending`
        # (which holds the longest suffix that could begin one).
        match = self._first_stop(text)
        if match is not None:
            start, stop = match
            self._stopped_by = stop
            self._finished = True
            self._pending = ""
            return text[: start + len(stop)] if self._include_stop else text[:start]
        hold = 0 if final else self._partial_stop_len(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold]

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that *ends* first, i.e. where generation
        would have stopped had the text arrived one character at a time; among matches
        ending at the same place, the longest (earliest start)."""
        best = None
        for s in self._stop:
            i = text.find(s)
            if i < 0:
                continue
            key = (i + len(s), i)
            if best is None or key < best[0]:
                best = (key, i, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

"""Whole UTF-8 characters in constrained output: the grammar engine's byte-level character classes are laxer than
UTF-8 (xgrammar lets a UTF-16 surrogate through as ED A0..BF xx, and an overlong form such as E0 8B AE, which
decode to U+FFFD each and break a string's maxLength), so each step's mask also keeps only the tokens whose
bytes continue the output as well-formed UTF-8 (RFC 3629). A model trained on UTF-8 text rarely writes such bytes;
a sampler at high temperature over a byte-level vocabulary can.

Notation: the states of the well-formed-sequence automaton (the Unicode standard's Table 3-7), per request:
  BOUNDARY     0   between characters
  1, 2, 3          that many continuation bytes (80..BF) still to come
  AFTER_E0     4   A0..BF, then one (no overlong 3-byte forms)
  AFTER_ED     5   80..9F, then one (no surrogates D800..DFFF)
  AFTER_F0     6   90..BF, then two (no overlong 4-byte forms)
  AFTER_F4     7   80..8F, then two (nothing past U+10FFFF)
  next  int8 [S, V]    the state after token t from state s; -1: the token's bytes are not UTF-8 from there
  allow int32 [S, W]   bit t % 32 of word t // 32 set iff next[s, t] >= 0 (the bitmask layout of
                       sampling/token_mask.py)
Special and stop tokens carry no text: they keep the state from every state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

BOUNDARY, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4 = 0, 4, 5, 6, 7
STATES = 8
# continuation states: (lowest byte, highest byte, the state after it)
_CONTINUE = {
    1: (0x80, 0xBF, BOUNDARY),
    2: (0x80, 0xBF, 1),
    3: (0x80, 0xBF, 2),
    AFTER_E0: (0xA0, 0xBF, 1),
    AFTER_ED: (0x80, 0x9F, 1),
    AFTER_F0: (0x90, 0xBF, 2),
    AFTER_F4: (0x80, 0x8F, 2),
}


def step(state: int, byte: int) -> int:
    """The state after one byte; -1 when the byte cannot follow (not UTF-8)."""
    if state != BOUNDARY:
        lo, hi, after = _CONTINUE[state]
        return after if lo <= byte <= hi else -1
    if byte < 0x80:
        return BOUNDARY
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte in (0xE0, 0xED, 0xF0, 0xF4):
        return {0xE0: AFTER_E0, 0xED: AFTER_ED, 0xF0: AFTER_F0, 0xF4: AFTER_F4}[byte]
    if 0xE1 <= byte <= 0xEF:
        return 2
    if 0xF1 <= byte <= 0xF3:
        return 3
    return -1  # 80..C1 (a continuation or an overlong 2-byte lead), F5..FF


def _run(state: int, raw: bytes) -> int:
    for b in raw:
        state = step(state, b)
        if state < 0:
            return -1
    return state


class Utf8Table:
    """next and allow (above) for one vocabulary: built once per grammar backend (only tokens with a byte past
    ASCII are walked; an ASCII token keeps BOUNDARY and ends any other state)."""

    def __init__(self, decoded_vocab: Sequence[bytes], textless: Iterable[int], vocab_size: int) -> None:
        nxt = torch.full((STATES, vocab_size), -1, dtype=torch.int8)
        for t, raw in enumerate(decoded_vocab[:vocab_size]):
            if raw.isascii():
                nxt[BOUNDARY, t] = BOUNDARY
            else:
                nxt[:, t] = torch.tensor([_run(s, raw) for s in range(STATES)], dtype=torch.int8)
        ids = torch.tensor(sorted(t for t in set(textless) if t < vocab_size), dtype=torch.int64)
        nxt[:, ids] = torch.arange(STATES, dtype=torch.int8)[:, None]
        self.next = nxt
        width = (vocab_size + 31) // 32
        bits = torch.zeros(STATES, width * 32, dtype=torch.int64)
        bits[:, :vocab_size] = (nxt >= 0).to(torch.int64)
        words = (bits.view(STATES, width, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
        self.allow = (words - ((words >> 31) << 32)).to(torch.int32)  # bit 31 as the sign bit of an int32

    def after(self, state: int, token: int) -> int:
        return int(self.next[state, token])


class Utf8State:
    """One request's automaton state, with the states before its accepted tokens (rollback)."""

    def __init__(self, table: Utf8Table) -> None:
        self.table = table
        self.states = [BOUNDARY]

    def check(self, token: int) -> int:
        """The state after `token`; ValueError when its bytes would make the output invalid UTF-8 here."""
        s = self.table.after(self.states[-1], token)
        if s < 0:
            raise ValueError(f"token {token} would make the output invalid UTF-8 here")
        return s

    def accept(self, token: int) -> None:
        self.states.append(self.check(token))

    def narrow(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the bitmask (int32 [B, W]) ANDed with the tokens that keep the output UTF-8."""
        bitmask[row] &= self.table.allow[self.states[-1]]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self.states[-num_tokens:]

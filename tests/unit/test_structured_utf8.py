"""The UTF-8 automaton every structured-output matcher follows (mlaserve/structured/utf8.py): against Python's
own UTF-8 decoder on every byte sequence of up to 3 bytes and on random longer ones, and its table over a small
byte-level vocabulary (the states a token leads to, the packed bitmask, the state kept by text-less tokens);
then in the grammar backend: a string schema whose walk took E0 8B AE (an overlong form xgrammar allows, found by
test_structured_fuzz) cannot take it any more, and rollback restores the state."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mlaserve.sampling.token_mask import unpack_bitmask
from mlaserve.structured import utf8


def _valid_prefix(raw: bytes) -> bool:
    """Whether some continuation makes raw decode (Python's strict decoder as the judge: its incremental form waits
    on ED A0 instead of refusing it): raw itself, or raw and 1-3 more bytes, the first any continuation-range
    boundary, the rest 80."""
    firsts = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
    tails = [b""] + [bytes([f]) + b"\x80" * extra for f in firsts for extra in range(3)]
    return any(_decodes(raw + t) for t in tails)


def _state(raw: bytes) -> int:
    s = utf8.BOUNDARY
    for b in raw:
        s = utf8.step(s, b)
        if s < 0:
            return -1
    return s


def test_step_agrees_with_pythons_decoder():
    for n in (1, 2, 3):
        for seq in itertools.product(range(256), repeat=n) if n < 3 else _three_byte_samples():
            raw = bytes(seq)
            s = _state(raw)
            assert (s >= 0) == _valid_prefix(raw), raw.hex()
            if s >= 0:  # at a boundary exactly when the whole sequence decodes
                assert (s == utf8.BOUNDARY) == _decodes(raw), raw.hex()
    rng = random.Random(0)
    for _ in range(20000):
        raw = bytes(rng.choice([rng.randrange(256), rng.randrange(0x80, 0xC0)]) for _ in range(rng.randrange(1, 9)))
        assert (_state(raw) >= 0) == _valid_prefix(raw), raw.hex()
    for text in ("a", "é", "€", "한", "𝄞", "\U0010ffff"):
        assert _state(text.encode()) == utf8.BOUNDARY


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _three_byte_samples():
    """Every lead byte from C0 up with every second and third byte in 7F..C0 (the boundaries that matter)."""
    edges = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0]
    return itertools.product(range(0xC0, 0x100), edges, edges)


def test_table_over_a_byte_vocabulary():
    vocab = [b"a", b"\xe0", b"\x8b", b"\xae", b"\xa0\x80", b"\xe2\x82\xac", b"", b"\xed", b"\xed\xa0", b"\xff"]
    stop = 6  # text-less: keeps every state
    table = utf8.Utf8Table(vocab, [stop], 40)  # 40 ids: the ones past the vocabulary are never allowed
    nxt = table.next
    assert nxt[utf8.BOUNDARY, :10].tolist() == [0, utf8.AFTER_E0, -1, -1, -1, 0, 0, utf8.AFTER_ED, -1, -1]
    assert nxt[utf8.AFTER_E0, :10].tolist() == [-1, -1, -1, 1, 0, -1, utf8.AFTER_E0, -1, -1, -1]  # E0 A0 80
    assert nxt[utf8.AFTER_ED, :10].tolist() == [-1, -1, 1, -1, -1, -1, utf8.AFTER_ED, -1, -1, -1]  # ED 8B ok
    assert (nxt[:, 10:] == -1).all()
    allowed = unpack_bitmask(table.allow, 40)
    assert torch.equal(allowed, nxt >= 0)
    state = utf8.Utf8State(table)
    state.accept(1)  # E0
    with pytest.raises(ValueError, match="invalid UTF-8"):
        state.accept(2)  # 8B after E0: an overlong form
    state.accept(3)
    state.accept(3)
    assert state.states[-1] == utf8.BOUNDARY
    state.rollback(2)
    assert state.states == [utf8.BOUNDARY, utf8.AFTER_E0]
    mask = torch.full((2, 2), -1, dtype=torch.int32)
    state.narrow(mask, 1)
    assert torch.equal(mask[0], torch.full((2,), -1, dtype=torch.int32))
    assert unpack_bitmask(mask[1:], 40)[0].nonzero().flatten().tolist() == [3, 4, 6]


def test_the_backend_mask_keeps_strings_utf8():
    from mlaserve import LLM
    from mlaserve.structured.spec import StructuredOutputs

    engine = LLM().engine
    backend = engine.grammar_backend()
    raw = {t: bytes(b) for t, b in enumerate(backend.info.decoded_vocab)}
    byte_token = {r[0]: t for t, r in raw.items() if len(r) == 1}
    quote, e0, overlong = next(t for t, r in raw.items() if r == b'"'), byte_token[0xE0], byte_token[0x8B]
    m = backend.matcher(StructuredOutputs(json={"type": "string", "maxLength": 3}))
    for tok in (quote, e0):
        m.accept(tok)
    mask = torch.full((1, (backend.vocab_size + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    allowed = set(unpack_bitmask(mask, backend.vocab_size)[0].nonzero().flatten().tolist())
    assert overlong not in allowed  # xgrammar alone allows it (the fuzz's find)
    assert allowed and all(0xA0 <= raw[t][0] <= 0xBF for t in allowed)
    with pytest.raises(ValueError, match="invalid UTF-8"):
        m.accept(overlong)
    m.rollback(1)  # back after the quote: a lead byte is fine again
    mask = torch.full((1, (backend.vocab_size + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    assert unpack_bitmask(mask, backend.vocab_size)[0, e0]

"""Tests for mlaserve.engine.detokenizer with a tiny byte-level BPE trained in the test."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mlaserve.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token
        show_progress=False,
    )
    corpus = [
        "The naïve café serves crème brûlée to the naïve.",
        "日本語のテキストです。日本語 🙂 emoji 🙂🙂",
        "Hello world, hello there! The end.",
    ] * 3
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


# Characters unseen in training stay split into byte tokens (ü ç 中 😀 ∑ ...); seen
# ones may be merged into tokens together with their neighbours.
TEXTS = [
    "naïve café 日本語 🙂",
    "über façade 中文 😀 ∑x → y",
    "🙂😀🎉 ",
    "Hello world, the end.",
    "a\u00e9\u0301 \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # combining mark, Hebrew, Arabic
]
ALPHABET = list("ab ,.Thelo") + ["ï", "é", "ü", "日", "本", "中", "🙂", "😀", "∑", "\n"]


def stream(det, ids, chunk=1):
    """Feed ids `chunk` at a time; return every delta, the one from finish() last."""
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(det.add(ids[i : i + chunk]))
    deltas.append(det.finish())
    return deltas


def expected_with_stop(full, stops, include):
    """Reference: cut `full` at the match that ends first (ties: the longest)."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[0]):
            best = ((i + len(s), i), i, s)
    if best is None:
        return full, None
    _, i, s = best
    return (full[: i + len(s)] if include else full[:i]), s


def test_tokenizer_splits_characters(tok):
    """Guard: the texts really contain tokens that are partial UTF-8 characters."""
    split = [i for t in TEXTS for i in tok.encode(t).ids if FFFD in tok.decode([i])]
    assert len(split) > 10


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("prompt", ["", "Prompt: 日本", "ends in emoji 😀"])
def test_deltas_concatenate_to_decode(tok, chunk, prompt):
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        det = IncrementalDetokenizer(tok, tok.encode(prompt).ids)
        deltas = stream(det, ids, chunk)
        assert "".join(deltas) == text
        assert det.output_text == text
        assert not any(FFFD in d for d in deltas), deltas
        assert det.stopped_by is None and det.finished


def test_random_texts_roundtrip(tok):
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 25)))
        ids = tok.encode(text).ids
        deltas = stream(IncrementalDetokenizer(tok, ids[: rng.randint(0, 3)]), ids, rng.randint(1, 3))
        assert "".join(deltas) == tok.decode(ids) == text
        assert FFFD not in "".join(deltas)


def test_window_stays_small(tok):
    ids = tok.encode("naïve café 日本語 🙂 " * 20).ids
    det = IncrementalDetokenizer(tok, [])
    longest = 0
    for i in ids:
        det.add([i])
        longest = max(longest, len(det._ids))
    assert longest <= 8  # not the whole output


def test_incomplete_tail_flushed_as_replacement_at_finish(tok):
    ids = tok.encode("ok 😀").ids
    assert FFFD in tok.decode(ids[:-1])
    det = IncrementalDetokenizer(tok, [])
    streamed = "".join(det.add([i]) for i in ids[:-1])
    assert FFFD not in streamed
    assert streamed + det.finish() == tok.decode(ids[:-1])  # same U+FFFD decode would give


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    eot = tok.token_to_id(EOT)
    ids = tok.encode("über").ids + [eot] + tok.encode(" 日本").ids
    deltas = stream(IncrementalDetokenizer(tok, [eot], skip_special_tokens=skip), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert (EOT in "".join(deltas)) == (not skip)


def test_stop_string_excluded_and_nothing_after(tok):
    text = "Hello world, the end. More text after."
    ids = tok.encode(text).ids
    det = IncrementalDetokenizer(tok, [], stop=("end.",))
    deltas = []
    for i in ids:
        deltas.append(det.add([i]))
        assert "Hello world, the ".startswith("".join(deltas))  # never a bit of the stop string
    deltas.append(det.finish())
    assert "".join(deltas) == "Hello world, the "
    assert det.stopped_by == "end."
    assert det.add(tok.encode(" more").ids) == "" and det.finish() == ""


def test_stop_string_split_across_byte_tokens(tok):
    # "中" and "😀" are unseen in training: their bytes are separate tokens.
    text = "über 中😀 then more"
    ids = tok.encode(text).ids
    for include in (False, True):
        det = IncrementalDetokenizer(tok, [], stop=("中😀",), include_stop_str_in_output=include)
        out = "".join(stream(det, ids))
        assert out == ("über 中😀" if include else "über ")
        assert det.stopped_by == "中😀"


def test_stop_inside_one_token_and_in_one_add_call(tok):
    text = "the naïve café"
    ids = tok.encode(text).ids
    assert any("ïve" in tok.decode([i]) for i in ids)  # the stop string sits inside a token
    det = IncrementalDetokenizer(tok, [], stop=("ïv",))
    out = det.add(ids)  # all tokens at once
    assert out == "the na" and det.stopped_by == "ïv"
    assert det.finish() == ""


def test_partial_stop_held_back_then_flushed(tok):
    det = IncrementalDetokenizer(tok, [], stop=("xyz",))
    assert det.add(tok.encode("abcx").ids) == "abc"  # "x" might start "xyz"
    assert det.add(tok.encode("y").ids) == ""
    assert det.add(tok.encode("q").ids) == "xyq"  # decided: not a stop
    assert det.add(tok.encode("xy").ids) == ""
    assert det.finish() == "xy"  # end of request: flush
    assert det.output_text == "abcxyqxy" and det.stopped_by is None


def test_first_ending_stop_wins(tok):
    # Both candidates complete inside the same token (" naïve"), so the choice is not
    # decided by token order: the match that ends first wins, ties go to the longest.
    ids = tok.encode("the naïve").ids
    assert any(tok.decode([i]) == " naïve" for i in ids)
    det = IncrementalDetokenizer(tok, [], stop=("aïve", "ïv"))
    assert "".join(stream(det, ids)) == "the na" and det.stopped_by == "ïv"
    det = IncrementalDetokenizer(tok, [], stop=("ve", "ïve"))
    assert "".join(stream(det, ids)) == "the na" and det.stopped_by == "ïve"


def test_random_stop_strings_match_reference(tok):
    rng = random.Random(1)
    for _ in range(150):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 25)))
        ids = tok.encode(text).ids
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 4)] if rng.random() < 0.7 else rng.choice(ALPHABET) * 2)
        include = rng.random() < 0.5
        want, want_stop = expected_with_stop(text, stops, include)
        got = ""
        det = IncrementalDetokenizer(tok, [], stop=tuple(stops), include_stop_str_in_output=include)
        chunk = rng.randint(1, 3)
        for i in range(0, len(ids), chunk):
            got += det.add(ids[i : i + chunk])
            assert want.startswith(got), (text, stops, got, want)  # nothing wrong ever emitted
            assert FFFD not in got
        got += det.finish()
        assert got == want, (text, stops, include)
        assert det.stopped_by == want_stop

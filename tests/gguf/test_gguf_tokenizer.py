"""The tokenizer built from ``tokenizer.ggml.*`` reproduces the fixtures' own tokenizer.json."""

from __future__ import annotations

import json

import pytest
from gguf_helpers import (
    fixture_params,
    need_fixtures,
    rewrite_gguf,
)

from mlaserve.gguf.read.checkpoint import GGUFError, GGUFTokenizer, load_gguf

tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")
gguf = pytest.importorskip("gguf")

EXTRA_TEXTS = [
    "def f(x):\n    return x ** 2  # 12345 3.14\n\n\tfoo_bar = 'naïve café 😀 日本語'\r\n  ",
    "I've been 'told he's there, 'RE you sure?   ",
    "",
]


def _fixture_text_and_ids(model: str) -> tuple[str, list[int]]:
    folder = need_fixtures() / model
    text = json.loads((folder / "expected.json").read_text())["text"]
    return text, safetensors_torch.load_file(folder / "expected.safetensors")["input_ids"].tolist()


@pytest.mark.parametrize("model,qtype,path", fixture_params())
def test_fixture_text_tokenizes_like_the_fixture(model, qtype, path):
    text, ids = _fixture_text_and_ids(model)
    tk = load_gguf(path, validate_numeric=False).build_tokenizer()
    assert tk.encode(text).ids == ids


@pytest.mark.parametrize("model", ["ds3", "glm5"])
def test_matches_tokenizer_json_on_other_text(model):
    ref = tokenizers.Tokenizer.from_file(str(need_fixtures() / model / "tokenizer.json"))
    tk = load_gguf(need_fixtures() / model / "model-q8_0.gguf", validate_numeric=False).build_tokenizer()
    for s in EXTRA_TEXTS:
        assert tk.encode(s).ids == ref.encode(s).ids, repr(s)
        assert tk.decode(tk.encode(s).ids, skip_special_tokens=True) == s


def test_special_ids_and_flags():
    ds = load_gguf(need_fixtures() / "ds32" / "model-f32.gguf", validate_numeric=False).tokenizer
    assert (ds.bos_token_id, ds.eos_token_id, ds.pad_token_id, ds.add_bos_token) == (0, 1, 2, True)
    assert ds.pre == "gpt-2" and ds.chat_template is None and ds.prefix_ids() == [0]
    glm = load_gguf(need_fixtures() / "glm5" / "model-f32.gguf", validate_numeric=False).tokenizer
    assert (glm.bos_token_id, glm.eos_token_id, glm.eot_token_id, glm.eom_token_id) == (792, 790, 797, 799)


def test_glm_prefix_from_metadata_alone():
    """The GGUF metadata only says add_bos_token with BOS=[gMASK]; <sop> is GLM's convention."""
    text, ids = _fixture_text_and_ids("glm5")
    ck = load_gguf(need_fixtures() / "glm5" / "model-f32.gguf", validate_numeric=False)
    assert ck.tokenizer.prefix_ids() == [792, 794]  # auto: [gMASK] <sop>
    assert ck.build_tokenizer(glm_prefix=False).encode(text).ids == [792] + ids[2:]
    with pytest.raises(GGUFError, match="no \\[gMASK\\]/<sop>"):
        load_gguf(need_fixtures() / "ds3" / "model-f32.gguf", validate_numeric=False).tokenizer.prefix_ids(True)


def test_chat_template_is_exposed(tmp_path):
    src = need_fixtures() / "ds2lite" / "model-q8_0.gguf"
    tpl = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    dst = rewrite_gguf(src, tmp_path / "t.gguf", set_keys={"tokenizer.chat_template": (tpl, gguf.GGUFValueType.STRING)})
    assert load_gguf(dst, validate_numeric=False).tokenizer.chat_template == tpl


def _toy(pre: str, tokens=None) -> GGUFTokenizer:
    from pathlib import Path

    tokens = tokens or [chr(c) for c in range(33, 127)] + ["Ġ", "<s>"]
    types = [1] * (len(tokens) - 1) + [3]
    return GGUFTokenizer(
        Path("toy.gguf"), "gpt2", pre, tokens, types, [], len(tokens) - 1, None, None, None, None, True, False, None
    )


@pytest.mark.parametrize(
    "pre,text,pieces",
    [
        # the CJK run is its own piece (shown byte-level encoded: 日本語 -> æĹ¥æľ¬èªŀ)
        ("deepseek-v3", "abc 12345 日本語x", ["abc", "Ġ", "123", "45", "Ġ", "æĹ¥æľ¬èªŀ", "x"]),
        ("glm4", "I'll 12345", ["I", "'ll", "Ġ", "123", "45"]),
        ("gpt-2", "I'll 12345", ["I", "'ll", "Ġ12345"]),
    ],
)
def test_pre_tokenizers(pre, text, pieces):
    tk = _toy(pre).build_tokenizer()
    assert [p for p, _ in tk.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_unsupported_tokenizer_is_an_error():
    with pytest.raises(GGUFError, match=r"toy\.gguf: tokenizer\.ggml\.pre='kimi-k2' is not supported"):
        _toy("kimi-k2").build_tokenizer()
    tk = _toy("gpt-2")
    tk.model = "llama"
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model='llama' is not supported"):
        tk.build_tokenizer()

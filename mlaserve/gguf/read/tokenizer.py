"""The tokenizer stored in a GGUF file (`tokenizer.ggml.*`) as a `tokenizers.Tokenizer`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from mlaserve.gguf.read.file import GGUFError, GGUFFile

# =============================================================================================
# tokenizer

_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp llm_tokenizer_bpe regex lists (applied one after the other, each split "isolated")
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "deepseek-v3": [
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ],
    "glm4": [_LLAMA3_RE],
    "chatglm-bpe": [_LLAMA3_RE],
    "llama-bpe": [_LLAMA3_RE],
    "dbrx": [_LLAMA3_RE],
    "smaug-bpe": [_LLAMA3_RE],
    "qwen2": [
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
        r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "default": [
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ],
}
# pre-tokenizers for which llama.cpp adds no BOS although add_bos_token may be set
_NO_BOS_PRE = ("glm4", "chatglm-bpe")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


@dataclass
class GGUFTokenizer:
    """``tokenizer.ggml.*`` of a GGUF file; `build_tokenizer` makes a `tokenizers.Tokenizer`."""

    path: Path
    model: str | None
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None  # None: the key is absent (GGUF has no empty arrays)
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, gf: GGUFFile) -> GGUFTokenizer:
        md = gf.metadata
        t = lambda k: md.get(f"tokenizer.ggml.{k}")  # noqa: E731
        return cls(
            gf.path,
            t("model"),
            t("pre"),
            list(t("tokens") or []),
            list(t("token_type") or []),
            None if t("merges") is None else list(t("merges")),
            t("bos_token_id"),
            t("eos_token_id"),
            t("eot_token_id"),
            t("eom_token_id"),
            t("padding_token_id"),
            bool(t("add_bos_token") or False),
            bool(t("add_eos_token") or False),
            md.get("tokenizer.chat_template"),
        )

    def token_id(self, text: str) -> int | None:
        try:
            return self.tokens.index(text)
        except ValueError:
            return None

    def prefix_ids(self, glm_prefix: bool | None = None) -> list[int]:
        """Special ids put before the text.

        From the metadata alone: [bos] when add_bos_token (llama.cpp: not for the glm4 /
        chatglm-bpe pre-tokenizers).  GLM models expect "[gMASK]<sop>" instead -- their HF
        tokenizer prepends both, llama.cpp puts them in the chat template -- which the metadata
        does not encode; ``glm_prefix`` (default: auto = when the vocabulary has both tokens and
        [gMASK] is the BOS or there is none) reproduces it.
        """
        gmask, sop = self.token_id("[gMASK]"), self.token_id("<sop>")
        is_glm = gmask is not None and sop is not None and self.bos_token_id in (None, gmask)
        if glm_prefix or (glm_prefix is None and is_glm):
            if not is_glm:
                raise GGUFError(f"{self.path}: glm_prefix requested but the vocabulary has no [gMASK]/<sop>")
            return [gmask, sop]
        if self.add_bos_token and self.bos_token_id is not None and self.pre not in _NO_BOS_PRE:
            return [self.bos_token_id]
        return []

    def build_tokenizer(self, glm_prefix: bool | None = None):
        """A `tokenizers.Tokenizer` equivalent to llama.cpp's BPE tokenizer for this file."""
        from tokenizers import Tokenizer, decoders, models

        if self.model != "gpt2":
            raise GGUFError(
                f"{self.path}: tokenizer.ggml.model={self.model!r} is not supported (only 'gpt2' byte-level BPE)"
            )
        if not self.tokens:
            raise GGUFError(f"{self.path}: tokenizer.ggml.tokens is missing or empty: the file has no token list")
        if self.merges is None:
            # llama.cpp refuses a BPE without the key ("cannot find tokenizer merges in model file");
            # a vocabulary of single byte symbols needs none (and GGUF stores no empty array)
            multi = self._merged_token()
            if multi is not None:
                raise GGUFError(
                    f"{self.path}: tokenizer.ggml.merges is missing, but the vocabulary has merged tokens "
                    f"(id {multi}: {self.tokens[multi]!r}): without the merges every text would be tokenized "
                    "byte by byte"
                )
        if self.pre is None:  # llama.cpp's documented fallback, with its warning
            warnings.warn(
                f"{self.path}: tokenizer.ggml.pre is missing: using llama.cpp's 'default' pre-tokenizer, "
                "which may split words differently from the model's own (regenerate the file to name it)",
                stacklevel=2,
            )
        vocab: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            vocab.setdefault(tok, i)  # duplicate strings: the first id wins, as in llama.cpp
        merges = [_split_merge(m, self.path) for m in self.merges or []]
        tk = Tokenizer(
            models.BPE(
                vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=self.pre == "llama-bpe"
            )
        )
        tk.pre_tokenizer = self._pre_tokenizer()
        tk.decoder = decoders.ByteLevel()
        self._add_special_tokens(tk)
        self._post_processor(tk, self.prefix_ids(glm_prefix))
        return tk

    def _merged_token(self) -> int | None:
        """The id of the first normal token (not control / user-defined) longer than one symbol."""
        for i, tok in enumerate(self.tokens):
            kind = self.token_types[i] if i < len(self.token_types) else 1
            if len(tok) > 1 and kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
                return i
        return None

    def _pre_tokenizer(self):
        from tokenizers import Regex, pre_tokenizers

        pre = self.pre or "default"
        if pre == "gpt-2":
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise GGUFError(
                f"{self.path}: tokenizer.ggml.pre={pre!r} is not supported "
                f"(known: gpt-2, {', '.join(PRE_TOKENIZER_REGEXES)})"
            )
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_REGEXES[pre]]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def _add_special_tokens(self, tk) -> None:
        from tokenizers import AddedToken

        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(self.tokens, self.token_types)
            if ty == TOKEN_CONTROL
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(self.tokens, self.token_types)
            if ty == TOKEN_USER_DEFINED
        ]
        tk.add_special_tokens(special)
        tk.add_tokens(user)

    def _post_processor(self, tk, prefix: list[int]) -> None:
        from tokenizers import processors

        suffix = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
        if not prefix and not suffix:
            return
        # template pieces get neutral names: token texts may contain ':' or spaces
        name = {i: f"SPECIAL{k}" for k, i in enumerate(dict.fromkeys(prefix + suffix))}
        specials = [{"id": n, "ids": [i], "tokens": [self.tokens[i]]} for i, n in name.items()]
        pieces = lambda ids, seq: [f"{name[i]}:{seq}" for i in ids]  # noqa: E731
        single = " ".join(pieces(prefix, 0) + ["$A:0"] + pieces(suffix, 0))
        pair = " ".join([single] + pieces(prefix, 1) + ["$B:1"] + pieces(suffix, 1))
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _split_merge(m: str, path: Path) -> tuple[str, str]:
    i = m.find(" ", 1)  # as llama.cpp: the separator is the first space after position 0
    if i < 0:
        raise GGUFError(f"{path}: invalid BPE merge {m!r} in tokenizer.ggml.merges")
    return m[:i], m[i + 1 :]

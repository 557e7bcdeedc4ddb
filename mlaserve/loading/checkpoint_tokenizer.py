"""A checkpoint's tokenizer: a folder's tokenizer.json (+ tokenizer_config.json / chat_template.jinja) or a GGUF's
tokenizer.ggml.* data, built once at open, errors naming the file; and the chat encoding decided with it."""

from __future__ import annotations

from pathlib import Path

from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.engine.tokenizer import Tokenizer
from mlaserve.loading.files import regular_file
from mlaserve.tools.select import choose_encoding


def set_encoding(tokenizer: Tokenizer | None, model_type: str | None) -> str | None:
    """Decide once, at load, what writes a chat prompt without a template: the encoding the release publishes
    (DeepSeek-V3.2 / V4), else the plain transcript (tools/select.py choose_encoding)."""
    if tokenizer is None:
        return None
    tokenizer.encoding = choose_encoding(model_type, tokenizer.chat_template, tokenizer.has_token)
    return tokenizer.encoding


def folder_tokenizer(path: Path, model_cfg: ModelConfig) -> Tokenizer | None:
    if not regular_file(path / "tokenizer.json", ConfigError, required=False):
        return None
    try:
        return Tokenizer.from_folder(path, model_cfg.eos_token_ids)
    except ConfigError:  # names its own file (tokenizer_config.json, chat_template.jinja)
        raise
    except Exception as e:  # the tokenizers library raises its own types; name the file
        raise ConfigError(f"{path / 'tokenizer.json'}: cannot build the tokenizer: {type(e).__name__}: {e}") from e


def gguf_tokenizer(path: Path, tok, default_eos: tuple[int, ...]) -> Tokenizer:
    """The tokenizer of a GGUF's tokenizer.ggml.* (`tok`: gguf/read/tokenizer.py GGUFTokenizer), its chat template
    and end tokens (eos and eot; `default_eos`, the model config's, when it names neither)."""
    from mlaserve.gguf.read.file import GGUFError

    config = {"chat_template": tok.chat_template} if tok.chat_template else {}
    eos = tuple(i for i in (tok.eos_token_id, tok.eot_token_id) if i is not None)
    try:
        built = tok.build_tokenizer()
    except GGUFError:
        raise
    except Exception as e:  # a broken token list: name the file and the keys
        raise GGUFError(f"{path}: cannot build the tokenizer from tokenizer.ggml.*: {type(e).__name__}: {e}") from e
    return Tokenizer(built, config, eos or default_eos)

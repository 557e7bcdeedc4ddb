"""Tokenizer of a model folder: `tokenizer.json` (the `tokenizers` library) plus
`tokenizer_config.json` (special tokens, chat template rendered with jinja2). Without a template, the prompt
encoding its release publishes instead (`encoding`: DeepSeek-V3.2 / V4, engine/dsml_encoding.py; the loader
decides it, tools/select.py `choose_encoding`), else a plain transcript."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from mlaserve.engine.dsml_encoding import ENCODINGS, encode


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tok = tok
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.encoding: str | None = None  # a published Python encoding used without a template (dsml_encoding)
        ids = list(eos_token_ids)
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in ids:
            ids.append(tok.token_to_id(eos))
        self.eos_token_ids = tuple(ids)

    @staticmethod
    def from_folder(folder: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        from mlaserve.config.model import ConfigError
        from mlaserve.loading.files import path_problem, read_json, regular_file

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if path_problem(path) == "does not exist":
            raise FileNotFoundError(f"{folder}: no tokenizer.json (needed to turn text into tokens)")
        regular_file(path, ConfigError)
        config = read_json(folder / "tokenizer_config.json", ConfigError, required=False) or {}
        template = folder / "chat_template.jinja"
        if "chat_template" not in config and regular_file(template, ConfigError, required=False):
            try:
                config["chat_template"] = template.read_text()
            except UnicodeDecodeError as e:
                raise ConfigError(f"{template}: not UTF-8 text ({e})") from e
        return Tokenizer(_HFTokenizer.from_file(str(path)), config, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def has_token(self, text: str) -> bool:
        return self.tok.token_to_id(text) is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the folder's chat template (kwargs: more template variables, e.g. tools); without one, the
        release's published encoding (its thinking mode from kwargs `thinking` / `enable_thinking`, as the
        templates of the family read them; it always opens the assistant turn after a user turn or tool results,
        as the encoders do), else a plain 'role: content' transcript (tools, if any, named on a first
        'tools: ...' line)."""
        if not self.chat_template and self.encoding is not None:
            thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
            return encode(ENCODINGS[self.encoding], messages, kwargs.get("tools"), bool(thinking))
        if not self.chat_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            if kwargs.get("tools"):
                names = [t.get("function", {}).get("name", "?") for t in kwargs["tools"]]
                lines.insert(0, "tools: " + ", ".join(names))  # a template-less model reads names only
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        env = _template_env()
        special = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in self.config.items()
            if k in ("bos_token", "eos_token", "pad_token")
        }
        return env.from_string(self.chat_template).render(
            **{**special, **kwargs}, messages=messages, add_generation_prompt=add_generation_prompt
        )


def _template_env():
    """The environment the chat templates of the Hub are written for (transformers' apply_chat_template): a
    sandbox (a checkpoint's template is untrusted code), loop controls ({% break %}: Kimi-K2), `tojson`
    with keywords and without HTML escaping (GLM-4.6 writes tojson(ensure_ascii=False)), raise_exception and
    strftime_now."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env

"""Tokenizer: a HF `tokenizer.json` (via the `tokenizers` library) plus the chat template and special
tokens from `tokenizer_config.json` (or transformers 5's `chat_template.jinja`), rendered with jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self._backend = backend
        self.special_tokens: dict[str, str | None] = {n: _content(config.get(n)) for n in SPECIAL_NAMES}
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A checkpoint folder's tokenizer, a GGUF file's, or a pretrained model's (by name)."""
        from ferry.model.source import resolve_model

        path = resolve_model(path)
        if path.suffix == ".gguf":
            from ferry.model.gguf_reader import open_gguf
            from ferry.model.gguf_tokenizer import tokenizer_from_gguf

            return tokenizer_from_gguf(open_gguf(path))
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file}: missing (only fast tokenizers are supported)")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        return cls(HFTokenizer.from_file(str(file)), config, template)

    @property
    def backend(self) -> HFTokenizer:
        """The tokenizers.Tokenizer underneath (DecodeStream steps over it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of a special token by role ('eos_token', ...), or None."""
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """None for an id the vocabulary does not have."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ValueError("chat_template: this tokenizer has none")
        values = {**{k: v or "" for k, v in self.special_tokens.items()}, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **values)


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)

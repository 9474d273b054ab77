"""The server's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus the checkpoint's chat
template rendered with a sandboxed Jinja environment.

This module owns text <-> token ids and chat messages -> prompt text. Incremental decoding and stop
strings live in ``detokenizer.py``; nothing here touches the engine.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer


class ChatTemplateError(ValueError):
    """The chat messages cannot be rendered (no template, or the template raised on this input)."""


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_template(path: Path, config: dict) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    """A checkpoint's tokenizer and chat template (loaded from the model directory)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json; the server needs it to tokenize text")
        self._tok = _RustTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.chat_template = _load_chat_template(path, config)
        self.special_ids = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON can carry lone surrogates ("\ud800"); text cannot
            raise ValueError(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from None
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (used for logprobs; may hold U+FFFD for partial bytes)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    extra: dict | None = None) -> str:
        """Messages -> prompt text with the checkpoint's chat template (the same variables as
        transformers' ``apply_chat_template``)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if self._template is None:
            self._template = _compile(self.chat_template)
        variables = dict(extra or {})
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template error is the request's fault, not the server's
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    extra: dict | None = None) -> list[int]:
        # The template writes the special tokens itself, so none are added on top (as transformers does).
        return self.encode(self.render_chat(messages, add_generation_prompt, extra), add_special_tokens=False)


def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)

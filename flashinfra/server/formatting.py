"""OpenAI response shapes: completion bodies, stream chunks, usage and logprobs (the chat formatter, built on
``CompletionFormatter``, is ``chat_output.ChatFormatter``: its messages carry the parsed reasoning and tool calls).

Owns JSON layout only (what the official ``openai`` client parses); the values come from ``serving.py``.
Logprobs that are -inf (a token the sampler could never have picked) are written as -9999.0, because JSON
has no infinity.
"""

from __future__ import annotations

import math
import time

import msgspec

from flashinfra.server.serving import Choice, ChoiceEvent
from flashinfra.server.tokenizer import Tokenizer

_json_encode = msgspec.json.Encoder().encode

LogprobEntry = tuple[int, float, list[tuple[int, float]], int]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0


def sse(payload: dict | str) -> str:
    """One server-sent event (msgspec's JSON encoder: UTF-8 as is, several times faster than ``json``)."""
    data = payload if isinstance(payload, str) else _json_encode(payload).decode()
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def count_usage(choices: list[Choice]) -> dict:
    prompt = sum({id(c.prompt_ids): len(c.prompt_ids) for c in choices}.values())
    return usage(prompt, sum(c.num_tokens for c in choices))


class CompletionLogprobs:
    """The legacy completions logprobs object: parallel lists of tokens, logprobs, top dicts, offsets."""

    def __init__(self, base_offset: int = 0):
        self.base_offset = base_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, tok: Tokenizer, entries: list[LogprobEntry]) -> None:
        for token_id, logprob, top, offset in entries:
            text = tok.token_text(token_id)
            self.tokens.append(text)
            self.token_logprobs.append(_finite(logprob))
            # Distinct ids can decode to the same text (e.g. partial UTF-8 bytes): keep the first, which
            # is the sampled token, then the most likely.
            top_dict = {text: _finite(logprob)}
            for t, lp in top:
                top_dict.setdefault(tok.token_text(t), _finite(lp))
            self.top_logprobs.append(top_dict)
            self.text_offset.append(self.base_offset + offset)

    def body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


def chat_logprobs_content(tok: Tokenizer, entries: list[LogprobEntry]) -> list[dict]:
    def item(token_id: int, logprob: float) -> dict:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, logprob, top, _ in entries:
        entry = item(token_id, logprob)
        entry["top_logprobs"] = [item(t, lp) for t, lp in top]
        content.append(entry)
    return content


class CompletionFormatter:
    """Builds /v1/completions responses and stream chunks for one request."""

    object_name = "text_completion"

    def __init__(self, request_id: str, model: str, tok: Tokenizer, want_logprobs: bool,
                 echo_texts: dict[int, str] | None = None, want_token_ids: bool = False):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tok = tok
        self.want_logprobs = want_logprobs
        self.want_token_ids = want_token_ids
        self.echo_texts = echo_texts or {}
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._texts: dict[int, list[str]] = {}

    def _envelope(self, choices: list[dict], object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs_for(self, event: ChoiceEvent) -> CompletionLogprobs:
        lp = self._logprobs.get(event.choice.index)
        if lp is None:
            lp = self._logprobs[event.choice.index] = CompletionLogprobs()
        return lp

    def stream_start(self) -> list[dict]:
        return [self._envelope([{"index": c, "text": text, "logprobs": None, "finish_reason": None}],
                               self.object_name) for c, text in sorted(self.echo_texts.items())]

    def chunk(self, event: ChoiceEvent) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs = CompletionLogprobs()
            logprobs.add(self.tok, event.logprobs)
            logprobs = logprobs.body()
        choice = {"index": event.choice.index, "text": event.text, "logprobs": logprobs,
                  "finish_reason": event.finish_reason}
        return self._envelope([self._with_ids(choice, event.token_ids)], self.object_name)

    def _with_ids(self, choice: dict, token_ids: list[int]) -> dict:
        if self.want_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def add(self, event: ChoiceEvent) -> None:
        self._texts.setdefault(event.choice.index, []).append(event.text)
        if self.want_logprobs:
            self._logprobs_for(event).add(self.tok, event.logprobs)

    def final(self, choices: list[Choice]) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = self.echo_texts.get(c.index, "") + "".join(self._texts.get(c.index, []))
            lp = self._logprobs.get(c.index)
            logprobs = (lp or CompletionLogprobs()).body() if self.want_logprobs else None
            out.append(self._with_ids({"index": c.index, "text": text, "logprobs": logprobs,
                                       "finish_reason": c.finish_reason}, c.detok.token_ids))
        body = self._envelope(out, self.object_name)
        body["usage"] = count_usage(choices)
        return body

    def usage_chunk(self, choices: list[Choice]) -> dict:
        body = self._envelope([], self.object_name)
        body["usage"] = count_usage(choices)
        return body

"""A chat choice's generated text -> OpenAI ``reasoning_content``, ``content`` and ``tool_calls``, streamed
as deltas or returned as one message.

Owns ``ChatOutputParser`` (reasoning split first, then GLM tool calls in what follows), ``ChatFormatter``
(the chat formatter, whose deltas and final messages carry those fields; ``finish_reason`` becomes
``tool_calls`` when a call was made) and ``MarkerDecoder``, the decoder the detokenizer uses for chat so
that GLM's think/tool markers survive decoding while every other special token (EOS, role tokens) is
dropped. When the output was all reasoning that never closed and the model stopped on its own, it is filed
as the answer (``content``), not as reasoning: the model skipped thinking. Streamed, the reasoning deltas
already went out; the last chunk then carries the same text as ``content``.
"""

from __future__ import annotations

from flashinfra.server.formatting import CompletionFormatter, chat_logprobs_content, count_usage
from flashinfra.server.reasoning import ReasoningParser
from flashinfra.server.serving import Choice, ChoiceEvent
from flashinfra.server.tokenizer import Tokenizer
from flashinfra.server.tool_calls import Delta, ToolCallParser

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
           "</arg_value>")


class MarkerDecoder:
    """Decodes like the tokenizer, keeping GLM's marker tokens as text when special tokens are skipped."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        keep = {i for i in tokenizer.special_ids if tokenizer.token_text(i) in MARKERS}
        self._drop = frozenset(tokenizer.special_ids - keep)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self._drop]
        return self._tok.decode(token_ids, skip_special_tokens=False)


def _tool_call_entries(deltas: list[Delta]) -> list[dict]:
    """Deltas -> OpenAI ``delta.tool_calls`` entries, argument fragments of one call merged."""
    entries: list[dict] = []
    for d in deltas:
        if d.call is None:
            continue
        if d.name is not None:
            entries.append({"index": d.call.index, "id": d.call.id, "type": "function",
                            "function": {"name": d.name, "arguments": ""}})
        elif entries and entries[-1]["index"] == d.call.index:
            entries[-1]["function"]["arguments"] += d.arguments
        else:
            entries.append({"index": d.call.index, "function": {"arguments": d.arguments}})
    return entries


class ChatOutputParser:
    """One choice's parse state: ``feed`` text deltas, ``finish`` once; both return OpenAI delta fields."""

    def __init__(self, think_open: bool, tools: list[dict] | None, tools_enabled: bool):
        self.reasoning = ReasoningParser(think_open, tools_enabled)
        self.tool_parser = ToolCallParser(tools) if tools_enabled else None
        self.content = ""
        self.refiled = False  # unclosed reasoning filed as the answer

    def _rest(self, text: str, deltas: list[Delta]) -> None:
        if self.tool_parser is None:
            if text:
                deltas.append(Delta(content=text))
        else:
            deltas.extend(self.tool_parser.feed(text))

    def _fields(self, reasoning: str, deltas: list[Delta]) -> dict:
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        content = "".join(d.content for d in deltas)
        if content:
            self.content += content
            delta["content"] = content
        calls = _tool_call_entries(deltas)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def feed(self, text: str) -> dict:
        reasoning, rest = self.reasoning.feed(text)
        deltas: list[Delta] = []
        self._rest(rest, deltas)
        return self._fields(reasoning, deltas)

    def finish(self, finish_reason: str | None) -> dict:
        reasoning, rest = self.reasoning.finish()
        deltas: list[Delta] = []
        self._rest(rest, deltas)
        if self.tool_parser is not None:
            deltas.extend(self.tool_parser.finish())
        delta = self._fields(reasoning, deltas)
        if finish_reason == "stop" and self.reasoning.unclosed_reasoning_only and not self.calls:
            self.refiled = True
            text = self.reasoning.reasoning_text
            if text:
                self.content += text
                delta["content"] = delta.get("content", "") + text
        return delta

    @property
    def calls(self) -> list:
        return self.tool_parser.calls if self.tool_parser is not None else []

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.calls else finish_reason

    def message(self) -> dict:
        reasoning = None if self.refiled else (self.reasoning.reasoning_text or None)
        message = {"role": "assistant", "refusal": None,
                   "content": self.content if (self.content or not self.calls) else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return message


class ChatFormatter(CompletionFormatter):
    """Builds /v1/chat/completions responses and stream chunks for one request, each choice's text through a
    ``ChatOutputParser`` of its own."""

    object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tok: Tokenizer, want_logprobs: bool, num_choices: int,
                 want_token_ids: bool = False, *, think_open: bool, tools: list[dict] | None, tools_enabled: bool):
        super().__init__(request_id, model, tok, want_logprobs, want_token_ids=want_token_ids)
        self.num_choices = num_choices
        self._entries: dict[int, list[dict]] = {}
        self._parser_args = (think_open, tools, tools_enabled)
        self._parsers: dict[int, ChatOutputParser] = {}

    def stream_start(self) -> list[dict]:
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], self.object_name) for i in range(self.num_choices)]

    def parser(self, index: int) -> ChatOutputParser:
        p = self._parsers.get(index)
        if p is None:
            p = self._parsers[index] = ChatOutputParser(*self._parser_args)
        return p

    def _delta(self, event: ChoiceEvent) -> dict:
        p = self.parser(event.choice.index)
        delta = p.feed(event.text)
        if event.finish_reason is not None:
            for key, value in p.finish(event.finish_reason).items():
                delta[key] = delta[key] + value if key in delta else value
        return delta

    def chunk(self, event: ChoiceEvent) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs = {"content": chat_logprobs_content(self.tok, event.logprobs), "refusal": None}
        p = self.parser(event.choice.index)
        delta = self._delta(event)
        choice = {"index": event.choice.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": p.finish_reason(event.finish_reason)}
        return self._envelope([self._with_ids(choice, event.token_ids)], self.object_name)

    def add(self, event: ChoiceEvent) -> None:
        self._delta(event)
        if self.want_logprobs:
            self._entries.setdefault(event.choice.index, []).extend(
                chat_logprobs_content(self.tok, event.logprobs))

    def final(self, choices: list[Choice]) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            p = self.parser(c.index)
            logprobs = None
            if self.want_logprobs:
                logprobs = {"content": self._entries.get(c.index, []), "refusal": None}
            out.append(self._with_ids({"index": c.index, "message": p.message(), "logprobs": logprobs,
                                       "finish_reason": p.finish_reason(c.finish_reason)}, c.detok.token_ids))
        body = self._envelope(out, "chat.completion")
        body["usage"] = count_usage(choices)
        return body

"""Incremental detokenization with stop strings, for one generated sequence.

Tokens arrive a few at a time; text is decoded so that a multi-byte character split across tokens is
never emitted half-done (the decoder waits while the tail is U+FFFD), and a stop string that spans token
boundaries is still found: text that could be the start of a stop string is held back until it either
completes the stop string or cannot any more. This module owns only text; the engine owns stop token ids,
max_tokens and EOS.
"""

from __future__ import annotations

from flashinfra.server.tokenizer import Tokenizer

# Tokens of prompt context decoded with the output: SentencePiece-style tokenizers render a leading
# space differently at the start of a string than after other text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas and finds stop strings.

    ``add_token`` consumes one token id (``add_tokens`` several, when there are no stop strings);
    ``pop_delta`` returns the text that may be sent now. Once a stop string is seen, ``stopped`` is true,
    the text ends before it (or after it, with ``include_stop``), and further tokens are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | tuple[str, ...] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context  # context + generated tokens, for decoding only
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.token_ids: list[int] = []
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.stop_string: str | None = None

    def add_token(self, token_id: int) -> int:
        """Consume one generated token; return the text offset (in ``text``) where that token starts."""
        offset = len(self.text)
        if self.stopped:
            return offset
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        self._append(self._decode_new(final=False))
        return offset

    def add_tokens(self, token_ids: list[int]) -> None:
        """Consume several generated tokens with one decode (the text is the same as token by token). Only
        without stop strings: with them, tokens after the one that completes a stop string must be ignored,
        which needs ``add_token``'s one-at-a-time view."""
        if self._stop:
            raise ValueError("add_tokens is for sequences without stop strings; use add_token")
        self.token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        self._append(self._decode_new(final=False))

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def finish(self) -> None:
        """The sequence is over: flush text that was waiting for the rest of a multi-byte character."""
        if not self.stopped:
            self._append(self._decode_new(final=True))

    def pop_delta(self, final: bool = False) -> str:
        """Text not yet sent that can be sent now (everything, when ``final`` or stopped)."""
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        if end <= self._sent:
            return ""
        delta = self.text[self._sent:end]
        self._sent = end
        return delta

    def _decode_new(self, final: bool) -> str:
        decode = self._tok.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the token that completes it
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _append(self, piece: str) -> None:
        if not piece:
            return
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, len(self.text) - longest + 1)
        self.text += piece
        if not self._stop:
            return
        best: tuple[int, str] | None = None
        for s in self._stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self.text = self.text[:at + len(s)] if self._include_stop else self.text[:at]
            self.stopped = True
            self.stop_string = s

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        held = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held

"""GLM reasoning: ``<think>...</think>`` in generated text, split from the answer while it streams.

Owns two things: reading from the rendered prompt whether the chat template left a ``<think>`` open (GLM-4.7+
templates end the generation prompt with ``<think>`` when thinking is on and with ``</think>`` when
``enable_thinking`` is false, so the parser starts in the state the template chose instead of guessing),
and ``ReasoningParser``, which turns text deltas into (reasoning, rest) deltas at any split of the text.
A tool call opened inside the reasoning ends it (the model went straight to acting). Tool-call parsing of
the rest lives in ``tool_calls.py``; the OpenAI shapes in ``chat_output.py``.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
ASSISTANT = "<|assistant|>"


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the prompt's last assistant turn leaves a ``<think>`` open (the output begins inside the
    reasoning). Only the text after the last ``<|assistant|>`` counts: earlier turns' reasoning is history."""
    tail = prompt_text[prompt_text.rfind(ASSISTANT) + len(ASSISTANT):] if ASSISTANT in prompt_text else prompt_text
    return tail.rfind(THINK_START) > tail.rfind(THINK_END)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers`` (text that must
    wait for the next delta before anyone can tell whether a marker starts there)."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return held


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest occurrence of any marker in ``text``: (position, marker), or None."""
    best = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    return best


class ReasoningParser:
    """Streaming split of one choice's output into reasoning and the rest (answer text and tool calls).

    ``think_open``: the prompt left ``<think>`` open (see ``prompt_opens_think``). Otherwise a ``<think>`` at
    the very start of the output (after whitespace) opens the reasoning. Reasoning ends at ``</think>`` or,
    when ``tools_enabled``, at a ``<tool_call>`` (which then stays in the rest, for the tool-call parser).
    ``feed`` returns the (reasoning, rest) text that is certain now; ``finish`` flushes what was held back.
    """

    def __init__(self, think_open: bool, tools_enabled: bool = False):
        self.in_reasoning = think_open
        self.opened_by_prompt = think_open
        self.closed = False  # a </think> (or a tool call) ended the reasoning
        self._tools = tools_enabled
        self._at_start = not think_open  # still before any non-whitespace output
        self._buf = ""
        self._strip_next = False  # the reasoning just closed: newlines that follow </think> are layout
        self.reasoning_text = ""
        self.rest_text = ""

    def _end_markers(self) -> tuple[str, ...]:
        return (THINK_END, TOOL_CALL_START) if self._tools else (THINK_END,)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, rest = [], []
        while self._buf:
            if self._at_start:
                stripped = self._buf.lstrip()
                if not stripped:
                    return self._emit(reasoning, rest)  # only whitespace so far: keep it until we know
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START):]
                    self._at_start = False
                    self.in_reasoning = True
                    continue
                if THINK_START.startswith(stripped):
                    return self._emit(reasoning, rest)  # could still become <think>
                self._at_start = False
                continue
            if not self.in_reasoning:
                rest.append(self._buf)
                self._buf = ""
                break
            hit = find_first(self._buf, self._end_markers())
            if hit is None:
                keep = held_prefix(self._buf, self._end_markers())
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, marker = hit
            reasoning.append(self._buf[:at])
            self._buf = self._buf[at + len(marker):] if marker == THINK_END else self._buf[at:]
            if marker == THINK_END:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    self._strip_next = True
            self.in_reasoning = False
            self.closed = True
        return self._emit(reasoning, rest)

    def _emit(self, reasoning: list[str], rest: list[str]) -> tuple[str, str]:
        r, t = "".join(reasoning), "".join(rest)
        if self._strip_next and t:
            t = t.lstrip("\n")
            self._strip_next = not t
        self.reasoning_text += r
        self.rest_text += t
        return r, t

    def finish(self) -> tuple[str, str]:
        """The output ended: flush held-back text (an unfinished marker prefix is plain text)."""
        buf, self._buf = self._buf, ""
        if self.in_reasoning:
            return self._emit([buf], [])
        return self._emit([], [buf])

    @property
    def unclosed_reasoning_only(self) -> bool:
        """The output was all reasoning that never closed: the model skipped thinking and answered (or was
        cut off) without ``</think>``."""
        return self.in_reasoning and not self.closed and not self.rest_text

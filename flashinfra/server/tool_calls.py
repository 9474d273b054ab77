"""GLM-4.7+ tool calls in generated text -> OpenAI ``tool_calls``, incrementally, at any split of the text.

The format: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (whitespace
between the parts allowed, zero arguments allowed). Arguments become one JSON object typed by the tool's
JSON schema: a value whose property is declared ``string`` is the raw text (whitespace around it dropped);
any other value is decoded as JSON, and kept as a string when it is not JSON. ``ToolCallParser.feed``
returns deltas in OpenAI's streaming order: the call's id and name first (as soon as the name is complete),
then argument fragments whose concatenation is exactly the final ``arguments`` string. String values are
streamed as they arrive; other values when their ``</arg_value>`` is seen. Reasoning is split off before
this parser (``reasoning.py``); JSON shapes are built in ``chat_output.py``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from flashinfra.server.reasoning import find_first, held_prefix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"

TEXT, NAME, KEY, BEFORE_VALUE, VALUE, AFTER_VALUE = range(6)


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # the JSON object so far; complete once ``done``
    done: bool = False


@dataclass
class Delta:
    """One piece of parsed output: answer text, or a tool call's header (``name`` set), or its argument
    fragment."""

    content: str = ""
    call: ToolCall | None = None
    name: str | None = None
    arguments: str = ""


def _string_typed(schema: object) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string":
        return True
    if isinstance(kind, list):
        return "string" in kind and not any(t in kind for t in ("number", "integer", "boolean", "object", "array"))
    enum = schema.get("enum")
    return kind is None and isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Tool name -> its parameters' ``properties`` (from OpenAI ``tools``)."""
    out = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        params = function.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[function.get("name", "")] = props if isinstance(props, dict) else {}
    return out


def typed_value(raw: str) -> str:
    """A non-string argument's JSON text: the value decoded as JSON, else the raw text as a JSON string."""
    text = raw.strip()
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


class ToolCallParser:
    """Incremental GLM tool-call parser for one choice (feed the text that follows the reasoning)."""

    def __init__(self, tools: list[dict] | None):
        self._props = tool_properties(tools)
        self._state = TEXT
        self._buf = ""
        self._acc = ""  # the name, key or non-string value being read
        self._key = ""
        self._string_value = False
        self._pending_ws = ""  # whitespace inside a string value that may turn out to be trailing
        self._value_started = False
        self._strip_content = False  # content right after a call: its leading whitespace is layout
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The output ended. Held-back text is flushed; an unfinished call whose name was announced is closed
        with the arguments read so far; one still in its name is returned as text."""
        out: list[Delta] = []
        buf, self._buf = self._buf, ""
        if self._state == TEXT:
            self._content(out, buf)
        elif self._state == NAME:
            self._content(out, CALL_START + self._acc + buf)
        else:
            if self._state == VALUE:
                self._value_piece(out, buf)
                self._value_done(out, VALUE_END)
            self._close_call(out)
        self._state = TEXT
        return out

    # -- the state machine: each _step consumes what it can and says whether to go on --

    def _step(self, out: list[Delta]) -> bool:
        state = self._state
        if state == TEXT:
            return self._until(out, (CALL_START,), self._content_piece, self._open_call)
        if state == NAME:
            return self._until(out, (KEY_START, CALL_END), self._name_piece, self._name_done)
        if state == KEY:
            return self._until(out, (KEY_END,), self._acc_piece, self._key_done)
        if state in (BEFORE_VALUE, AFTER_VALUE):
            expected = (VALUE_START,) if state == BEFORE_VALUE else (KEY_START, CALL_END)
            stripped = self._buf.lstrip()
            for marker in expected:
                if stripped.startswith(marker):
                    self._buf = stripped[len(marker):]
                    self._marker(out, marker)
                    return True
            if stripped and not any(m.startswith(stripped) for m in expected):
                # not the format: keep the text as part of the value/name (lenient), as the next part
                self._buf = stripped
                self._state = VALUE if state == BEFORE_VALUE else KEY
                if self._state == VALUE:
                    self._begin_value()
                return True
            self._buf = stripped
            return False
        return self._until(out, (VALUE_END,), self._value_piece, self._value_done)

    def _until(self, out, markers, piece, done) -> bool:
        hit = find_first(self._buf, markers)
        if hit is None:
            keep = held_prefix(self._buf, markers)
            text = self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            if text:
                piece(out, text)
            return False
        at, marker = hit
        if at:
            piece(out, self._buf[:at])
        self._buf = self._buf[at + len(marker):]
        done(out, marker)
        return True

    def _marker(self, out, marker: str) -> None:
        if marker == VALUE_START:
            self._state = VALUE
            self._begin_value()
        elif marker == KEY_START:
            self._state = KEY
            self._acc = ""
        else:
            self._close_call(out)

    def _content(self, out, text: str) -> None:
        if self._strip_content:
            text = text.lstrip()
            self._strip_content = not text
        if text:
            self.content += text
            out.append(Delta(content=text))

    def _content_piece(self, out, text: str) -> None:
        self._content(out, text)

    def _open_call(self, out, marker: str) -> None:
        self._state = NAME
        self._acc = ""

    def _name_piece(self, out, text: str) -> None:
        self._acc += text

    def _name_done(self, out, marker: str) -> None:
        call = ToolCall(index=len(self.calls), id=f"call_{uuid.uuid4().hex[:24]}", name=self._acc.strip())
        self.calls.append(call)
        out.append(Delta(call=call, name=call.name))
        if marker == KEY_START:
            self._state = KEY
            self._acc = ""
        else:
            self._close_call(out)

    def _acc_piece(self, out, text: str) -> None:
        self._acc += text

    def _key_done(self, out, marker: str) -> None:
        self._key = self._acc.strip()
        self._state = BEFORE_VALUE

    def _begin_value(self) -> None:
        call = self.calls[-1]
        self._string_value = _string_typed(self._props.get(call.name, {}).get(self._key))
        self._acc = ""
        self._pending_ws = ""
        self._value_started = False
        head = ", " if call.arguments else "{"
        head += json.dumps(self._key, ensure_ascii=False) + ": "
        self._head = head + ('"' if self._string_value else "")

    def _value_piece(self, out, text: str) -> None:
        call = self.calls[-1]
        if not self._string_value:
            self._acc += text
            return
        if not self._value_started:
            text = text.lstrip()
            if not text:
                return
            self._value_started = True
            self._args(out, call, self._head)
        body = text.rstrip()
        piece = self._pending_ws + body if body else ""
        self._pending_ws = (self._pending_ws if not body else "") + text[len(body):]
        if piece:
            self._args(out, call, json.dumps(piece, ensure_ascii=False)[1:-1])

    def _value_done(self, out, marker: str) -> None:
        call = self.calls[-1]
        if self._string_value:
            if not self._value_started:
                self._args(out, call, self._head)
            self._args(out, call, '"')
        else:
            self._args(out, call, self._head + typed_value(self._acc))
        self._state = AFTER_VALUE

    def _close_call(self, out) -> None:
        call = self.calls[-1]
        self._args(out, call, "}" if call.arguments else "{}")
        call.done = True
        self._state = TEXT
        self._strip_content = True

    def _args(self, out, call: ToolCall, fragment: str) -> None:
        call.arguments += fragment
        out.append(Delta(call=call, arguments=fragment))

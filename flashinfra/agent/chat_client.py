"""A client for any OpenAI-compatible chat-completions endpoint with tool calling (flashinfra's own
server included), over ``httpx``.

``ChatClient.complete(messages, tools)`` posts ``{base_url}/chat/completions`` and returns the assistant
message (with its ``tool_calls``) and the token usage. Transient failures (connection errors, 429, 5xx)
are retried with backoff; anything else is an ``LLMError``. The API key goes only into the
``Authorization`` header: it is never part of an error message or a returned value.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx


class LLMError(RuntimeError):
    pass


@dataclass
class Reply:
    message: dict  # {"role": "assistant", "content": ..., "tool_calls": [...]}
    prompt_tokens: int
    completion_tokens: int
    latency_s: float

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatClient:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 300.0,
                 retries: int = 3, temperature: float | None = None, backoff_s: float = 1.0):
        if not base_url:
            raise LLMError("no endpoint: pass --base-url or set FLASHINFRA_AGENT_BASE_URL")
        if not model:
            raise LLMError("no model: pass --model or set FLASHINFRA_AGENT_MODEL")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.retries = retries
        self.backoff_s = backoff_s
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def complete(self, messages: list[dict], tools: list[dict]) -> Reply:
        body = {"model": self.model, "messages": messages, "tools": tools, "tool_choice": "auto"}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            start = time.monotonic()
            try:
                response = self._http.post(self.url, json=body)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__} talking to {self.url}"
            else:
                if response.status_code == 200:
                    return self._parse(response, time.monotonic() - start)
                error = f"HTTP {response.status_code} from {self.url}: {response.text[:500]}"
                if response.status_code != 429 and response.status_code < 500:
                    raise LLMError(error)
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise LLMError(f"{error} (after {self.retries + 1} attempts)")

    def _parse(self, response: httpx.Response, latency: float) -> Reply:
        try:
            data = response.json()
            message = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise LLMError(f"malformed chat-completions response: {response.text[:500]}") from None
        clean = {"role": "assistant", "content": message.get("content")}
        calls = []
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            calls.append({"id": call.get("id") or f"call_{len(calls)}", "type": "function",
                          "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments") or "{}"}})
        if calls:
            clean["tool_calls"] = calls
        usage = data.get("usage") or {}
        return Reply(clean, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                     latency)


def parse_arguments(call: dict) -> dict:
    """A tool call's arguments as a dict; malformed JSON raises ``ValueError`` with the reason."""
    raw = call["function"].get("arguments") or "{}"
    args = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(args, dict):
        raise ValueError("tool arguments must be a JSON object")
    return args

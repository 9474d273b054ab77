"""A scripted LLM: an OpenAI-compatible chat-completions server on loopback that replays a fixed sequence
of turns (tool calls, or plain text), and records every request it receives.

A turn is a list of ``(tool_name, arguments)`` pairs, a string (an answer without tool calls), or a
function of the conversation so far returning either (to use what a tool answered earlier). After
the last turn it answers with plain text, so a loop that keeps asking ends on its own.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedLLM:
    def __init__(self, turns: list, fail_first: int = 0):
        self.turns = list(turns)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_first = fail_first
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "ScriptedLLM":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def tool_results(self) -> dict[str, str]:
        """tool_call_id -> the result the loop sent back (from the last request)."""
        last = self.requests[-1]["messages"] if self.requests else []
        return {m["tool_call_id"]: m["content"] for m in last if m.get("role") == "tool"}

    def _reply(self, body: dict) -> tuple[int, dict]:
        with self._lock:
            self.requests.append(body)
            if self.fail_first > 0:
                self.fail_first -= 1
                return 503, {"error": "warming up"}
            turn_no = len([m for m in body["messages"] if m["role"] == "assistant"])
            turn = self.turns[turn_no] if turn_no < len(self.turns) else "script finished"
            if callable(turn):
                turn = turn(body["messages"])
        if isinstance(turn, str):
            message = {"role": "assistant", "content": turn}
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{turn_no}_{i}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(turn)]}
        usage = {"prompt_tokens": len(json.dumps(body)) // 4, "completion_tokens": 20}
        return 200, {"id": f"chat-{turn_no}", "object": "chat.completion", "model": body.get("model"),
                     "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}], "usage": usage}

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                outer.headers.append(dict(self.headers))
                if self.path != "/v1/chat/completions":
                    status, payload = 404, {"error": f"no route {self.path}"}
                else:
                    status, payload = outer._reply(body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

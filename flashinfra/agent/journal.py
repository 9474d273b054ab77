"""The campaign journal: one JSON object per line, appended and flushed to disk before the loop moves on,
so a crash loses at most the step in flight and ``replay`` can rebuild the campaign from the file.

Record kinds: ``campaign_start``, ``message`` (every chat message, so the conversation can be resumed),
``llm_call`` (tokens, latency), ``hypothesis``, ``tool_call``, ``tool_result``, ``candidate``,
``measurement``, ``verdict``, ``decision`` (approve/reject by a person), ``resume``, ``budget``,
``campaign_end``. Every record passes through the redactor first: the secrets it was given (the API key)
are replaced by ``[REDACTED]`` wherever they appear, however deeply nested.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

REDACTED = "[REDACTED]"


def redact(value: Any, secrets: tuple[str, ...]) -> Any:
    if not secrets:
        return value
    if isinstance(value, str):
        for s in secrets:
            if s:
                value = value.replace(s, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    return value


class Journal:
    def __init__(self, path: str | os.PathLike, secrets: tuple[str, ...] = ()):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.secrets = tuple(s for s in secrets if s)
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> dict:
        record = redact({"kind": kind, "ts": time.time(), **fields}, self.secrets)
        line = json.dumps(record, default=str, ensure_ascii=False)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return record

    def records(self) -> list[dict]:
        return list(read(self.path))


def read(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a journal; a torn last line (a crash mid-write) is skipped, any other bad line is an
    error naming its line number."""
    path = Path(path)
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if number >= len(lines) - 1:
                return
            raise ValueError(f"{path}:{number}: corrupt journal line: {exc}") from None

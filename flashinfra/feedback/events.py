"""Runtime events: a structured event stream (JSONL) and Prometheus metrics emitted by the engine.

    log = EventLog("events.jsonl")              # EventLog(None): disabled, every call returns at once
    log.emit("preempt", request_id="r1", reason="no free blocks")
    with log.span("step", step=12, num_reqs=8) as ev:   # one event with start, end, duration_s
        ...
        ev["num_decode_tokens"] = 8                     # fields known only at the end

Each line is one JSON object: ``kind``, ``ts`` (wall clock, seconds since the epoch, comparable across
processes), ``thread``, ``pid``, and the caller's fields; spans add ``start``, ``end`` (wall clock) and
``duration_s`` (from the monotonic clock). Writes are serialised by a lock, so any thread may emit.

Kinds the engine emits (``summarize`` understands them; any other kind is counted too):

- ``step`` span: ``step``, ``num_reqs``, ``num_prefill_tokens``, ``num_decode_tokens``, ``num_prefill_reqs``
- ``queue_wait``: ``request_id``, ``wait_s`` (arrival to first schedule)
- ``preempt``: ``request_id``, ``reason``
- ``cache``: ``used_blocks``, ``total_blocks``, ``used_slots``, ``total_slots``
- ``transfer`` span: ``request_id``, ``bytes``, ``src``, ``dst``
- ``gil_stall``: ``duration_s``, ``thread_stacks`` (from ``flashinfra.feedback.gil_probe``)
- ``kernel_compile``: ``kernel``, ``spec``, ``phase``, ``duration_s`` (a Triton compilation, at start-up or while
  serving, from ``flashinfra.feedback.compiles``)

Prometheus (``prometheus=True``): ``flashinfra_events_total{kind}``, ``flashinfra_span_seconds{kind}``
(histogram) and ``flashinfra_event_field_total{kind,field}`` summing the numeric fields in
``COUNTED_FIELDS``, in a registry of this log's own (``prometheus_text()``, or ``.registry`` to serve).
Turning a file into a timeline summary lives in ``flashinfra.feedback.events_summary``.
This module does not import torch: the scheduler uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

COUNTED_FIELDS = ("num_prefill_tokens", "num_decode_tokens", "bytes", "num_tokens")

SPAN_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0)


class EventLog:
    """A thread-safe event sink writing JSONL to ``path`` (None: file output off) and, when asked,
    Prometheus metrics. With neither, ``enabled`` is False and ``emit``/``span`` do nothing."""

    def __init__(self, path: str | os.PathLike | None = None, *, prometheus: bool = False,
                 flush_every: int = 1):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._file = None
        self._pending = 0
        self._flush_every = max(1, int(flush_every))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self.registry = None
        if prometheus:
            self._init_prometheus()
        self.enabled = self._file is not None or self.registry is not None

    def _init_prometheus(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self._events_total = Counter("flashinfra_events", "Runtime events by kind", ["kind"],
                                     registry=self.registry)
        self._span_seconds = Histogram("flashinfra_span_seconds", "Duration of span events", ["kind"],
                                       buckets=SPAN_BUCKETS, registry=self.registry)
        self._field_total = Counter("flashinfra_event_field", "Sum of counted numeric event fields",
                                    ["kind", "field"], registry=self.registry)

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event now."""
        if not self.enabled:
            return
        self._record(kind, {"ts": time.time(), **fields})

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Record one event covering the ``with`` block. The yielded dict may take more fields; an
        exception leaving the block is recorded as ``error`` and re-raised."""
        if not self.enabled:
            yield fields
            return
        start, t0 = time.time(), time.perf_counter()
        try:
            yield fields
        except BaseException as exc:
            fields["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            duration = time.perf_counter() - t0
            self._record(kind, {"ts": start, "start": start, "end": start + duration, "duration_s": duration,
                                **fields})

    def _record(self, kind: str, event: dict[str, Any]) -> None:
        event["kind"] = kind
        event.setdefault("thread", threading.current_thread().name)
        event.setdefault("pid", os.getpid())
        if self.registry is not None:
            self._events_total.labels(kind).inc()
            if "duration_s" in event:
                self._span_seconds.labels(kind).observe(event["duration_s"])
            for name in COUNTED_FIELDS:
                value = event.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._field_total.labels(kind, name).inc(value)
        if self._file is None:
            return
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._file.write(line)
            self._pending += 1
            if self._pending >= self._flush_every:
                self._file.flush()
                self._pending = 0

    def prometheus_text(self) -> str:
        """The metrics in Prometheus' text exposition format ("" when Prometheus is off)."""
        if self.registry is None:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                self._pending = 0

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        self.enabled = self.registry is not None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse a JSONL event file; a malformed line is an error naming its line number (a torn last
    line, from a process killed mid-write, is skipped)."""
    events = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON event: {exc}") from None
        if not isinstance(event, dict) or "kind" not in event or "ts" not in event:
            raise ValueError(f"{path}:{number}: an event needs 'kind' and 'ts'")
        events.append(event)
    return events

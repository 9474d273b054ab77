"""The GIL probe: a watchdog that detects Python threads starved because one thread holds the GIL (a C
call that does not release it, such as ``sum(range(10**8))``), and reports how long, how often, and the
stacks of all threads at that moment.

How: a heartbeat thread wakes every ``interval_s``; to run it needs the GIL, so when it wakes late by more
than ``threshold_s`` every Python thread was starved for that long (a CPU oversubscribed by other
processes looks the same, and is worth knowing too). The stacks are ``sys._current_frames()`` right after the
stall (``source == "after"``), which names a holder stuck in one C call or looping on a blocking one.

With ``native_stacks=True`` they are taken *during* the stall by ``faulthandler``'s watchdog, a native thread
that needs no GIL: each heartbeat re-arms it to fire ``interval_s + threshold_s`` later, so it fires only when the
heartbeat is late (a stall just over the threshold falls back to the stacks after it; those are kept as
``stacks_after`` in any case). It is opt-in because ``faulthandler`` walks the other threads' frames without the
GIL, which races with a holder that is running Python code rather than sitting in one C call: on CPython 3.12
that crashed a process running the engine (``bench/disagg_gil.py --engine``, a segmentation fault within the first
stalls). ``faulthandler`` has one such timer per process: while a probe with native stacks runs it owns it. A
re-arm is cheap next to the default 10 ms interval, so the probe costs little CPU.
Stalls go to ``stalls`` and, when an ``EventLog`` is given, out as ``gil_stall`` events.
"""

from __future__ import annotations

import faulthandler
import linecache
import re
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass
class Stall:
    start: float  # wall clock when the heartbeat should have run
    duration_s: float  # how long past that it ran
    source: str  # "during": stacks taken in the stall; "after": right after it
    stacks: dict[str, list[str]] = field(default_factory=dict)  # thread name -> frames, innermost last
    stacks_after: dict[str, list[str]] = field(default_factory=dict)  # sys._current_frames() once it ended

    def culprit_lines(self) -> list[str]:
        """The innermost frame of every thread but the probe's own."""
        return [f"{name}: {frames[-1]}" for name, frames in self.stacks.items()
                if frames and name != GilProbe.THREAD_NAME]


def _frame_text(filename: str, lineno: int, func: str) -> str:
    line = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno} in {func}" + (f": {line}" if line else "")


def parse_faulthandler_dump(text: str, names: dict[int, str]) -> dict[str, list[str]]:
    """faulthandler's text (innermost frame first) -> thread name -> frames, innermost last."""
    stacks: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        header = _THREAD_HEADER.match(raw)
        if header:
            ident = int(header.group(1), 16)
            current = stacks.setdefault(names.get(ident, f"thread-{ident:#x}"), [])
            continue
        frame = _FRAME.match(raw)
        if frame and current is not None:
            current.insert(0, _frame_text(frame.group(1), int(frame.group(2)), frame.group(3)))
    return stacks


def current_stacks(names: dict[int, str]) -> dict[str, list[str]]:
    return {names.get(ident, f"thread-{ident:#x}"):
            [_frame_text(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]
            for ident, frame in sys._current_frames().items()}


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


class GilProbe:
    """``with GilProbe(threshold_s=0.05) as probe: ...`` then ``probe.stalls`` / ``probe.report()``."""

    THREAD_NAME = "flashinfra-gil-probe"

    def __init__(self, threshold_s: float = 0.05, interval_s: float = 0.01, native_stacks: bool = False,
                 events=None, on_stall: Callable[[Stall], None] | None = None, max_stalls: int = 1000):
        if threshold_s <= 0 or interval_s <= 0:
            raise ValueError("threshold_s and interval_s must be positive")
        self.threshold_s, self.interval_s = threshold_s, interval_s
        self.native_stacks = native_stacks
        self.events, self.on_stall, self.max_stalls = events, on_stall, max_stalls
        self.stalls: list[Stall] = []
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dump = None
        self._names: dict[int, str] = {}
        self._started = self._stopped = None

    def start(self) -> "GilProbe":
        if self._thread is not None:
            raise RuntimeError("GIL probe already started")
        if self.native_stacks:
            self._dump = tempfile.TemporaryFile()
        self._stop.clear()
        self._started, self._stopped = time.perf_counter(), None
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._stopped = time.perf_counter()
        self._thread = None
        if self._dump is not None:
            faulthandler.cancel_dump_traceback_later()
            self._dump.close()
            self._dump = None

    def __enter__(self) -> "GilProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _arm(self) -> None:
        # Names as of this beat: a thread that holds the GIL and then exits before the probe runs again
        # is gone from threading.enumerate() by then, and must still be named in the report.
        current = _thread_names()
        self._names = {**self._names, **current} if len(self._names) < 1024 else current
        if self._dump is not None:
            faulthandler.dump_traceback_later(self.interval_s + self.threshold_s, repeat=False, file=self._dump)

    def _take_dump(self) -> str:
        if self._dump is None:
            return ""
        faulthandler.cancel_dump_traceback_later()  # waits for a dump in progress to finish
        self._dump.seek(0)
        text = self._dump.read().decode(errors="replace")
        self._dump.seek(0)
        self._dump.truncate()
        return text

    def _run(self) -> None:
        last = time.perf_counter()
        self._arm()
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            late = now - last - self.interval_s
            dump = self._take_dump()
            if late >= self.threshold_s:
                self._record(late, dump)
            last = time.perf_counter()
            self._arm()

    def _record(self, late: float, dump: str) -> None:
        names = {**self._names, **_thread_names()}
        stacks = parse_faulthandler_dump(dump, names) if dump else {}
        after = current_stacks(names)
        stall = Stall(start=time.time() - late, duration_s=late, source="during" if stacks else "after",
                      stacks=stacks or after, stacks_after=after)
        self.count += 1
        self.total_s += late
        self.max_s = max(self.max_s, late)
        if len(self.stalls) < self.max_stalls:
            self.stalls.append(stall)
        if self.events is not None:
            self.events.emit("gil_stall", duration_s=late, source=stall.source, thread_stacks=stall.stacks)
        if self.on_stall is not None:
            self.on_stall(stall)

    def report(self) -> dict[str, Any]:
        probed = ((self._stopped or time.perf_counter()) - self._started) if self._started else 0.0
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s, "probed_s": probed,
                "stalled_fraction": self.total_s / probed if probed else 0.0,
                "threshold_s": self.threshold_s, "stalls": [asdict(s) for s in self.stalls]}

    def format_text(self) -> str:
        lines = [f"GIL probe: {self.count} stall(s) over {self.threshold_s * 1e3:.0f} ms, total "
                 f"{self.total_s * 1e3:.0f} ms, longest {self.max_s * 1e3:.0f} ms"]
        for s in self.stalls:
            lines.append(f"  stall of {s.duration_s * 1e3:.0f} ms (stacks {s.source} the stall):")
            lines += [f"    {line}" for line in s.culprit_lines()]
        return "\n".join(lines)


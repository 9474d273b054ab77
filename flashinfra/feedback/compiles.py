"""Triton compilations after start-up, as runtime events: which kernel, at which specialisation, and how long.

A Triton kernel compiles once per specialisation of its arguments (dtypes, 16-byte alignment, an integer's
divisibility by 16 or equality to 1, the constexprs); the engine's warm-up (``engine/warmup.py``) runs the shapes it
can foresee, and any specialisation it missed compiles in the middle of serving, where a step then takes tens to
hundreds of milliseconds instead of a few. ``CompileWatch`` installs Triton's JIT hooks (chaining any already
installed) and emits one ``kernel_compile`` event per compilation: ``kernel``, ``spec`` (the launch options, the
constexpr values, integers equal to 1 among them, and the arguments specialised as divisible by 16) and
``duration_s`` (from the lookup that missed to the compiled kernel; a kernel found in Triton's on-disk cache takes
milliseconds, a fresh one seconds). ``count`` and ``seconds`` total them. Launches through ``kernels/launch.py``
reach Triton's compiler the same way, on their first call per specialisation. A benchmark that watches an engine
without making it write events keeps them in a ``KeptCompiles``; ``totals`` adds them up, for it and for the events
summary.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class CompileWatch:
    def __init__(self, events: Any) -> None:
        self.events = events
        self.phase = "start-up"  # the owner names the phase the next compilations belong to
        self.count, self.seconds = 0, 0.0
        self._started: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._saved: tuple | None = None  # the hooks found at ``start``; None once stopped
        self._hooks: tuple | None = None

    def start(self) -> "CompileWatch":
        import triton

        runtime = triton.knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._saved = (before, after)

        def on_miss(**kw):
            if self._saved is not None:
                self._started[kw["key"]] = time.perf_counter()
            return before(**kw) if before is not None else False

        def on_compiled(**kw):
            if self._saved is None:  # stopped while a later watch chained onto it: only pass the call on
                return after(**kw) if after is not None else None
            t0 = self._started.pop(kw["key"], None)
            duration = time.perf_counter() - t0 if t0 is not None else 0.0
            with self._lock:
                self.count += 1
                self.seconds += duration
            fn = kw.get("fn")
            self.events.emit("kernel_compile", kernel=getattr(fn, "name", str(fn)), spec=describe(kw),
                             duration_s=duration, phase=self.phase)
            return after(**kw) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled
        self._hooks = (on_miss, on_compiled)
        return self

    def stop(self) -> None:
        """Report nothing more; put the hooks found at ``start`` back if this watch's are still the installed ones
        (a watch started later keeps calling this one's, which then only pass the call on)."""
        if self._saved is not None:
            import triton

            runtime = triton.knobs.runtime
            if (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == self._hooks:
                runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._saved
            self._saved = None


class KeptCompiles(list):
    """An event sink for a ``CompileWatch`` of a benchmark's own, keeping each compilation's fields (``kernel``,
    ``spec``, ``duration_s``, ``phase``): the engine it watches need not write runtime events while it is timed."""

    def emit(self, kind: str, **fields) -> None:
        self.append(fields)

    def summary(self) -> dict:
        """``totals`` of the compilations kept, and each one's specialisation (what a warm-up would have to run to
        cover it)."""
        return {**totals(self), "specs": [{"kernel": e["kernel"], "spec": e["spec"]} for e in self]}


def totals(compiles: list[dict]) -> dict:
    """Compilations (``kernel_compile`` events' fields) totalled: how many and their seconds, overall and per
    kernel."""
    by_kernel: dict[str, dict[str, float]] = {}
    for e in compiles:
        k = by_kernel.setdefault(str(e.get("kernel")), {"count": 0, "seconds": 0.0})
        k["count"] += 1
        k["seconds"] += float(e.get("duration_s", 0.0))
    return {"count": len(compiles), "seconds": sum(k["seconds"] for k in by_kernel.values()), "by_kernel": by_kernel}


def describe(kw: dict) -> str:
    """The specialisation a JIT hook's arguments name: the launch options, the constexprs (by name) and the
    arguments Triton takes as divisible by 16."""
    head = str(kw.get("repr", "")).split("(", 1)[0]
    compiled = kw.get("compile") or {}
    names = list(compiled.get("signature") or ())

    def name(path) -> str:
        return names[path[0]] if isinstance(path, tuple) and path and path[0] < len(names) else str(path)

    constants = {name(p): v for p, v in (compiled.get("constants") or {}).items()}
    attrs = (compiled.get("configs") or [{}])[0] or {}
    div16 = sorted(name(p) for p, a in attrs.items() if "divisibility" in str(a))
    return f"{head} constexprs {constants} divisible by 16 {div16}"

"""Timing helpers for the scripts in ``bench/``: medians of back-to-back calls (CUDA events on the GPU,
``perf_counter`` on the CPU), eager and inside a CUDA graph, the copy-bandwidth ceiling of this device, and
the results JSON (device, command, date and the machine first).

``flashinfra bench`` (``feedback/bench.py``) times registered ops one fresh-input call at a time after an L2
flush; the scripts here time one op on fixed inputs many times in a row, the way the anchors' figures were
taken, so both share ``summarize_times`` and ``machine_info`` but not the loop.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from flashinfra.feedback.bench import machine_info, summarize_times

REQUIRED_FIELDS = ("device", "command", "date")


def _cuda(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def call_times_us(fn: Callable[[], Any], calls: int = 1, iters: int = 50, warmup: int = 5,
                  device: str | None = None) -> list[float]:
    """Microseconds per call over ``iters`` timings of ``calls`` back-to-back calls, after ``warmup`` calls: between
    two CUDA events on the GPU (``device`` None: the GPU when torch sees one), by ``perf_counter`` on the CPU."""
    cuda = _cuda(device)
    if cuda:
        import torch
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    return times


def time_eager(fn: Callable[[], Any], iters: int = 50, warmup: int = 5, device: str | None = None) -> float:
    """Median microseconds of one call, each call timed alone (the host's launch cost included)."""
    return summarize_times(call_times_us(fn, 1, iters, warmup, device))["median_s"]


def time_stream(fn: Callable[[], Any], calls: int = 10, iters: int = 5, device: str | None = None) -> float:
    """Median microseconds of one call among ``calls`` back-to-back calls: the device time of a launch that takes
    longer on the GPU than on the host (its host work overlaps the calls before it)."""
    return summarize_times(call_times_us(fn, calls, iters, 1, device))["median_s"]


def capture_graph(fn: Callable[[], Any], calls: int = 1):
    """A CUDA graph of ``calls`` back-to-back calls of fn, after three warm-up calls on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn: Callable[[], Any], replays: int = 20, iters: int = 20) -> float:
    """Median microseconds of one call captured in a CUDA graph, timed over ``replays`` back-to-back replays."""
    graph = capture_graph(fn)

    def many():
        for _ in range(replays):
            graph.replay()

    return time_eager(many, iters=iters, warmup=2, device="cuda") / replays


def kernel_times_us(fn: Callable[[], Any], calls: int = 5, warmup: int = 2,
                    device: str | None = None) -> dict[str, float]:
    """Microseconds per call of each kernel ``fn`` runs, by name (torch.profiler's device time of each kernel,
    summed over ``calls`` calls and divided by them), largest first: the launches of a multi-kernel op timed
    without any option of its own. On the CPU, each operator's own CPU time instead."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda(device)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            out[e.key] = out.get(e.key, 0.0) + us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def copy_bandwidth_GBps(device: str = "cuda") -> float:
    """This device's copy bandwidth (bytes read plus written, GB/s), measured now by ``ceilings.measure``: the
    ceiling for memory-bound kernels."""
    from flashinfra.feedback import ceilings

    return ceilings.measure(device)["copy_bytes_per_s"] / 1e9


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def relerr(a, b) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def generated(llm, prompts, params, **kwargs) -> list:
    """``llm.generate(prompts, params, **kwargs)``, raising when a request failed in the engine: a benchmark times
    generations, never failures."""
    outputs = llm.generate(prompts, params, **kwargs)
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(outputs)} requests failed; the first: {errors[0]}")
    return outputs


def checked_step(engine) -> list:
    """``engine.step()`` (an ``EngineCore``), raising when a request failed in it: a benchmark times steps, never
    failures."""
    outputs = engine.step()
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in an engine step; the first: {errors[0]}")
    return outputs


def header(argv: list[str] | None = None) -> dict[str, Any]:
    """The first fields of a results JSON: device, the command that produced it, the UTC date, versions (torch,
    triton, fla-core where installed) and ``machine_info``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine() or "cpu"
    argv = sys.argv if argv is None else argv
    return {"device": device, "command": " ".join([os.path.basename(sys.executable)] + list(argv)),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": package_version("torch"), "triton": package_version("triton"), "fla": package_version("fla-core"),
            "machine": machine_info()}


def results_dir() -> Path:
    """``bench/results`` of the source tree this module is imported from."""
    return Path(__file__).resolve().parents[2] / "bench" / "results"


def write_results(name: str, results: dict[str, Any], copy_to: str | None = None,
                  directory: str | Path | None = None) -> Path:
    """Write ``<directory>/<name>.json`` (default ``bench/results``) and, with ``copy_to``, a copy in that folder.
    A result without the device, command and date it came from is refused (ValueError)."""
    missing = [k for k in REQUIRED_FIELDS if not results.get(k)]
    if missing:
        raise ValueError(f"results lack {', '.join(missing)}: start them from timing.header()")
    text = json.dumps(results, indent=1, default=str) + "\n"
    folder = Path(directory) if directory is not None else results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(text)
    if copy_to:
        Path(copy_to).mkdir(parents=True, exist_ok=True)
        (Path(copy_to) / f"{name}.json").write_text(text)
    return path

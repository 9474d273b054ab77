"""Timing helpers shared by the KDA benchmark scripts: CUDA-event medians, eager and inside a CUDA graph,
the copy-bandwidth ceiling, and the JSON result header (device, command, date)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import torch


def _event_median_us(fn, calls: int, iters: int, warmup: int) -> float:
    """Median microseconds per call over ``iters`` timings of ``calls`` back-to-back calls between two CUDA
    events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def time_eager(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median microseconds of one call, each call bracketed by CUDA events (launch overhead included)."""
    return _event_median_us(fn, 1, iters, warmup)


def time_stream(fn, calls: int = 10, iters: int = 5) -> float:
    """Median microseconds of one call among ``calls`` back-to-back calls between two CUDA events: the device
    time of a launch that takes longer on the GPU than on the host (its host work overlaps the calls before)."""
    return _event_median_us(fn, calls, iters, 1)


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of fn, after three warm-up calls on a side stream."""
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


def time_graph(fn, replays: int = 20, iters: int = 20) -> float:
    """Median microseconds of one call captured in a CUDA graph, timed over ``replays`` back-to-back replays."""
    graph = capture_graph(fn)

    def many():
        for _ in range(replays):
            graph.replay()

    return time_eager(many, iters=iters, warmup=2) / replays


def copy_bandwidth_GBps() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written, the ceiling for memory-bound kernels."""
    x = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    us = time_eager(lambda: y.copy_(x), iters=10, warmup=2)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2**31 * 2 / us / 1e3


def header() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def fla_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:
        return None


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 (b is the reference)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def write_results(name: str, results: dict, copy_to: str | None = None) -> str:
    """Write ``bench/results/<name>.json`` and, when ``copy_to`` is given, a copy in that folder."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(here, exist_ok=True)
    text = json.dumps(results, indent=1, sort_keys=False)
    path = os.path.join(here, f"{name}.json")
    with open(path, "w") as f:
        f.write(text + "\n")
    if copy_to:
        with open(os.path.join(copy_to, f"{name}.json"), "w") as f:
            f.write(text + "\n")
    return path


def part_main(doc: str, name: str, parts: dict, batches: str = "64,256") -> int:
    """The command line of a benchmark made of parts: ``--part`` picks one of ``parts`` (each a function of the
    batch size returning a row, whose ``*_frac_copy`` entries are in GB/s), ``--batches`` the batch sizes. Each
    row's bandwidths become shares of the copy bandwidth measured first; the rows are written after each batch to
    ``bench/results/<name>.json`` for the first part, ``<name>_<part>.json`` for the others."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--part", choices=tuple(parts), default=next(iter(parts)))
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    res = header() | {"fla": fla_version(), "copy_GBps": copy_bandwidth_GBps(), "rows": []}
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        row = parts[args.part](B)
        for key in [k for k in row if k.endswith("_frac_copy")]:
            row[key] /= res["copy_GBps"]  # GB/s -> share of copy
        res["rows"].append(row)
        print(B, {n: round(x, 4 if "relerr" in n or "frac" in n else 1) for n, x in row.items()
                  if n != "B" and not isinstance(x, str)}, flush=True)
        write_results(name + ("" if args.part == next(iter(parts)) else f"_{args.part}"), res, args.out)
    return 0

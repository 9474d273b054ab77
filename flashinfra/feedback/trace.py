"""``flashinfra trace``: run engine steps (or one benchmark) under torch.profiler and write a Chrome/Perfetto
trace (``PREFIX.json``) plus a text summary (``PREFIX.txt``, also printed).

The summary is computed from the exported trace itself, so it reads exactly what Perfetto shows: top GPU
kernels by total time, top CPU ops by self time, the GPU's idle gaps between kernels (with the kernels on
either side), and per step (each step is a ``flashinfra.step N`` annotation) its CPU time, its kernels'
GPU time and their count. A step whose GPU sits idle most of the time is launch- or CPU-bound, and the
summary says so. On a CPU-only machine the kernel and gap sections are empty and CPU ops carry the time.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

STEP_PREFIX = "flashinfra.step "
# the engine settings ``trace --model`` takes (its flags), to profile the steps of the path they select
TRACE_ENGINE_OPTIONS = ("max_num_seqs", "async_scheduling", "speculative_tokens", "speculative_max_batch",
                        "deterministic", "quantization", "kv_cache_dtype", "startup_warmup")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_steps(step: Callable[[int], Any], steps: int, device: str, out_prefix: str | Path,
                  warmup: int = 1) -> Path:
    """Run ``step(i)`` ``warmup`` times unprofiled, then ``steps`` times under the profiler; returns the
    Chrome trace path."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    for i in range(warmup):
        step(-1 - i)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                step(i)
            if cuda:
                torch.cuda.synchronize()
    path = Path(f"{out_prefix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def _self_times(ops: list[dict[str, Any]]) -> dict[int, float]:
    """Self time of each op (by index): its duration minus that of the ops nested directly inside it, per
    thread."""
    by_thread: dict[Any, list[int]] = defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    self_us = {i: float(ops[i]["dur"]) for i in range(len(ops))}
    for idx in by_thread.values():
        idx.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        stack: list[int] = []
        for i in idx:
            start = ops[i]["ts"]
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= start:
                stack.pop()
            if stack:
                self_us[stack[-1]] -= ops[i]["dur"]
            stack.append(i)
    return self_us


def summarize_trace(trace: dict[str, Any] | str | Path, top: int = 15) -> dict[str, Any]:
    """Figures from a Chrome trace written by torch.profiler (times in seconds)."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_PREFIX)),
                   key=lambda e: e["ts"])
    # Kernel -> the CPU time of its launch (cudaLaunchKernel, or cuLaunchKernel for Triton), by correlation id.
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    by_kernel: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_kernel[k["name"]].append(k["dur"])
    gpu_total = sum(k["dur"] for k in kernels)
    top_kernels = [{"name": n, "count": len(d), "total_s": sum(d) / 1e6, "mean_s": sum(d) / len(d) / 1e6,
                    "fraction": sum(d) / gpu_total if gpu_total else 0.0}
                   for n, d in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]]

    self_us = _self_times(ops)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for i, e in enumerate(ops):
        row = by_op[e["name"]]
        row[0] += 1
        row[1] += self_us[i]
        row[2] += e["dur"]
    top_ops = [{"name": n, "count": c, "self_s": s / 1e6, "total_s": t / 1e6}
               for n, (c, s, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]]

    # GPU activity merged across streams; the gaps between merged intervals are when the GPU did nothing.
    gaps, busy_us, merged = [], 0.0, []
    for k in kernels:
        start, end = k["ts"], k["ts"] + k["dur"]
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, k["name"]
        else:
            if merged:
                gaps.append({"gap_s": (start - merged[-1][1]) / 1e6, "at_s": (merged[-1][1] - kernels[0]["ts"]) / 1e6,
                             "after": merged[-1][3], "before": k["name"]})
            merged.append([start, end, k["name"], k["name"]])
    busy_us = sum(b - a for a, b, _, _ in merged)
    window_us = (merged[-1][1] - merged[0][0]) if merged else 0.0
    gaps.sort(key=lambda g: -g["gap_s"])

    step_rows = []
    for j, s in enumerate(steps):
        lo, hi = s["ts"], (steps[j + 1]["ts"] if j + 1 < len(steps) else float("inf"))
        mine = [k for k in kernels if lo <= launches.get(k.get("args", {}).get("correlation"), k["ts"]) < hi]
        gpu_us = sum(k["dur"] for k in mine)
        span_us = (max(k["ts"] + k["dur"] for k in mine) - s["ts"]) if mine else s["dur"]
        step_rows.append({"step": s["name"].removeprefix(STEP_PREFIX), "cpu_s": s["dur"] / 1e6,
                          "gpu_s": gpu_us / 1e6, "kernels": len(mine),
                          "gpu_busy_fraction": gpu_us / max(span_us, s["dur"]) if mine else None})
    summary = {"kernels": len(kernels), "gpu_busy_s": busy_us / 1e6, "gpu_window_s": window_us / 1e6,
               "gpu_busy_fraction": busy_us / window_us if window_us else None,
               "idle_gaps": {"count": len(gaps), "total_s": sum(g["gap_s"] for g in gaps), "largest": gaps[:top]},
               "top_kernels": top_kernels, "top_cpu_ops": top_ops, "steps": step_rows}
    summary["diagnosis"] = diagnose(summary)
    return summary


def diagnose(s: dict[str, Any]) -> str:
    if not s["kernels"]:
        return "no GPU kernels in the trace: CPU time by op is the whole story"
    frac = s["gpu_busy_fraction"] or 0.0
    mean_kernel = s["gpu_busy_s"] / s["kernels"]
    if frac < 0.5:
        kind = "launch-bound" if mean_kernel < 20e-6 else "CPU-bound"
        return (f"{kind}: the GPU is idle {100 * (1 - frac):.0f}% of the time between kernels "
                f"({s['kernels']} kernels, mean {mean_kernel * 1e6:.1f} us)")
    return f"GPU-bound: busy {100 * frac:.0f}% of the window; look at the top kernels"


def format_text(s: dict[str, Any]) -> str:
    lines = [f"diagnosis: {s['diagnosis']}"]
    if s["kernels"]:
        lines.append(f"GPU: {s['kernels']} kernels, busy {s['gpu_busy_s'] * 1e3:.3f} ms of "
                     f"{s['gpu_window_s'] * 1e3:.3f} ms ({100 * (s['gpu_busy_fraction'] or 0):.1f}%), "
                     f"{s['idle_gaps']['count']} idle gaps totalling {s['idle_gaps']['total_s'] * 1e3:.3f} ms")
        lines.append("top kernels (total ms, count, mean us, share):")
        lines += [f"  {k['total_s'] * 1e3:9.3f} {k['count']:6d} {k['mean_s'] * 1e6:9.1f} {100 * k['fraction']:5.1f}%  "
                  f"{k['name'][:100]}" for k in s["top_kernels"]]
        lines.append("largest idle gaps (us, at ms, between):")
        lines += [f"  {g['gap_s'] * 1e6:9.1f} {g['at_s'] * 1e3:9.3f}  {g['after'][:50]} -> {g['before'][:50]}"
                  for g in s["idle_gaps"]["largest"][:5]]
    lines.append("top CPU ops (self ms, total ms, count):")
    lines += [f"  {o['self_s'] * 1e3:9.3f} {o['total_s'] * 1e3:9.3f} {o['count']:6d}  {o['name'][:100]}"
              for o in s["top_cpu_ops"]]
    lines.append("steps (CPU ms, GPU ms, kernels, GPU busy):")
    for r in s["steps"]:
        busy = f"{100 * r['gpu_busy_fraction']:.0f}%" if r["gpu_busy_fraction"] is not None else "-"
        lines.append(f"  step {r['step']:>4}: {r['cpu_s'] * 1e3:9.3f} {r['gpu_s'] * 1e3:9.3f} "
                     f"{r['kernels']:6d} {busy:>5}")
    return "\n".join(lines)


def _bench_step(name: str, device: str, dtype: str | None, quick: bool, steps: int) -> Callable[[int], Any]:
    from flashinfra.feedback import registry
    from flashinfra.feedback.registry import BenchContext

    errors = registry.load_providers()
    for module, tb in errors:
        print(f"ERROR importing provider {module}:\n{tb}", file=sys.stderr)
    (entry,) = [e for e in registry.select(registry.benchmarks(), [name]) if e.name == name] or [None]
    if entry is None:
        raise KeyError(f"no benchmark named {name!r}")
    spec = entry.fn(BenchContext(device=device, dtype=dtype or "bfloat16", quick=quick))
    # Inputs are made before profiling starts, so the trace shows the op and nothing else.
    inputs = {i: spec.make_inputs(i) for i in range(-1, steps)}

    def step(i: int):
        args = inputs[max(i, -1)]
        return spec.fn(*(args if isinstance(args, (tuple, list)) else (args,)))

    return step


def _engine_step(model: str | None, device: str, dtype: str | None, prompt_lens: list[int],
                 max_tokens: int, options: dict[str, Any],
                 arrivals: tuple[int, int] = (0, 0)) -> Callable[[int], Any]:
    """Engine steps over requests with random prompts; a finished batch is replaced by a new one. ``options``:
    further ``EngineConfig`` settings (speculative decoding, asynchronous scheduling, ...). ``arrivals``
    (count, length): that many new prompts of that length join before every step, which then mixes their
    prefill with the running rows' decode (the steps a server under load runs)."""
    import random

    from flashinfra.engine.config import EngineConfig
    from flashinfra.engine.core import EngineCore
    from flashinfra.engine.sched.messages import EngineRequest, SamplingParams

    options = {"max_num_seqs": max(4, len(prompt_lens)), **options}
    engine = EngineCore(EngineConfig(model=model, device=device, dtype=dtype or "auto", **options))
    vocab = engine.model.config.text.vocab_size
    rng = random.Random(0)
    batch = [0]

    def add_batch(lens: list[int]):
        for j, n in enumerate(lens):
            ids = [rng.randrange(vocab) for _ in range(n)]
            engine.add_request(EngineRequest(f"trace-{batch[0]}-{j}", ids,
                                             SamplingParams(max_tokens=max_tokens, ignore_eos=True), time.time()))
        batch[0] += 1

    def step(i: int):
        if not engine.has_work():
            add_batch(prompt_lens)
        elif arrivals[0]:
            add_batch([arrivals[1]] * arrivals[0])
        return engine.step()

    return step


def cli_main(args) -> int:
    from flashinfra.feedback.bench import default_device

    device = args.device or default_device()
    if (args.bench is None) == (args.model is None):
        print("error: give exactly one of --bench NAME or --model PATH|default", file=sys.stderr)
        return 2
    try:
        if args.bench is not None:
            step = _bench_step(args.bench, device, args.dtype, args.quick, args.steps)
        else:
            lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
            if not lens or min(lens) < 1:
                raise ValueError("--prompt-lens needs positive integers")
            arrivals = (0, 0)
            if args.arrivals:
                arrivals = tuple(int(x) for x in args.arrivals.split(","))
                if len(arrivals) != 2 or min(arrivals) < 1:
                    raise ValueError(f"--arrivals needs N,LEN with both positive, got {args.arrivals!r}")
            options = {name: getattr(args, name) for name in TRACE_ENGINE_OPTIONS
                       if getattr(args, name, None) is not None}
            step = _engine_step(None if args.model == "default" else args.model, device, args.dtype, lens,
                                max_tokens=max(2, args.warmup + args.steps), options=options, arrivals=arrivals)
    except (KeyError, ValueError, OSError) as exc:
        print(f"error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    path = profile_steps(step, args.steps, device, args.out, warmup=args.warmup if args.model else 1)
    summary = summarize_trace(path, top=args.top)
    text = format_text(summary)
    Path(f"{args.out}.txt").write_text(text + "\n")
    Path(f"{args.out}.summary.json").write_text(json.dumps(summary, indent=2))
    print(text)
    print(f"trace: {path} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0

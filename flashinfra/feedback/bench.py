"""The microbenchmark runner: ``flashinfra bench NAME... | ceilings | serve ARGS``.

For each benchmark: warm-up calls, then timed calls of ``spec.fn(*inputs)``, each on fresh inputs from
``spec.make_inputs(seed)`` made before its timer starts. On CUDA every timed call is preceded by an L2
flush (a write over a buffer larger than L2) and a synchronize, and timed with CUDA events; on the CPU
with ``perf_counter``. Reported: median and spread (min, p10, p90, max, IQR), achieved bytes/s and
FLOP/s as fractions of the measured ceilings, the re-check of a timed output (``spec.check``), and flags:
``cached`` when outputs stay identical across different inputs, ``inputs_not_fresh`` when
``make_inputs`` ignores its seed. With ``graph`` each call is captured in a CUDA graph (after the warm-up,
outside the timer) and its replay is timed, so the time is the kernels' alone, without the host's launch
cost; an op that cannot be captured is timed eagerly and its result says ``"timing": "eager"``.

torch is imported only when the device or the benchmark needs it, so pure-Python benchmarks (and the
A/B worker subprocesses that run them) start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flashinfra.feedback import registry
from flashinfra.feedback.registry import BenchContext, BenchSpec
from flashinfra.progress import progress_bar

L2_FLUSH_BYTES = 256 << 20  # H200 L2 is 60 MiB: four times that evicts it


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _as_args(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _snapshot(value: Any) -> Any:
    """A detached copy of an output (tensors to CPU), for comparing outputs across calls."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _identical(a: Any, b: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()))
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_identical, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    return a == b


class _Timer:
    """Times one call: CUDA events after an L2 flush and a synchronize, or perf_counter on the CPU."""

    def __init__(self, device: str, graph: bool = False):
        self.cuda = device.startswith("cuda")
        self.graph = graph and self.cuda
        if self.cuda:
            import torch

            self.torch = torch
            self.flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def __call__(self, fn, args: tuple) -> tuple[float, Any]:
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            return time.perf_counter() - t0, out
        torch = self.torch
        call = None
        if self.graph:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    out = fn(*args)
                call = graph.replay
            except RuntimeError:  # a host sync or an allocation the capture refuses: time it eagerly
                self.graph = False
                torch.cuda.synchronize()
        self.flush_buffer.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        if call is not None:
            call()
        else:
            out = fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_times(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    median = statistics.median(s)
    return {"median_s": median, "min_s": s[0], "max_s": s[-1], "p10_s": _quantile(s, 0.1),
            "p90_s": _quantile(s, 0.9), "iqr_s": _quantile(s, 0.75) - _quantile(s, 0.25),
            "rel_spread": (_quantile(s, 0.9) - _quantile(s, 0.1)) / median if median > 0 else 0.0,
            "runs": len(s)}


def run_spec(name: str, spec: BenchSpec, device: str, runs: int = 30, warmup: int = 3, seed: int = 0,
             max_seconds: float | None = None, ceilings: dict[str, Any] | None = None,
             graph: bool = False) -> dict[str, Any]:
    """Time ``spec`` and return its figures (see the module docstring)."""
    if runs < 2:
        raise ValueError("a benchmark needs at least 2 timed runs (cached-output detection compares two)")
    timer = _Timer(device)
    for i in range(warmup):
        timer(spec.fn, _as_args(spec.make_inputs(seed + 1_000_000 + i)))
    timer.graph = graph and timer.cuda
    times, flags = [], []
    first_inputs = first_out = None
    compared = identical_outputs = 0
    started = time.perf_counter()
    for i in range(runs):
        args = _as_args(spec.make_inputs(seed + i))
        # The first few calls are compared: different inputs giving bit-identical outputs mean the op
        # returns a cached result instead of computing.
        inputs = _snapshot(args) if i < 4 else None
        seconds, out = timer(spec.fn, args)
        times.append(seconds)
        # An op that returns None writes into its arguments: they are its output.
        observed = out if out is not None else args
        if i == 0:
            first_inputs, first_out = inputs, _snapshot(observed)
        elif inputs is not None:
            if _identical(first_inputs, inputs):
                if "inputs_not_fresh" not in flags:
                    flags.append("inputs_not_fresh")
            else:
                compared += 1
                identical_outputs += _identical(first_out, _snapshot(observed))
        if max_seconds is not None and i >= 4 and time.perf_counter() - started > max_seconds:
            break
    if compared and identical_outputs == compared:
        flags.append("cached")
    result: dict[str, Any] = {"name": name, "device": device, "description": spec.description,
                              "params": spec.params, "bytes": spec.bytes, "flops": spec.flops,
                              **summarize_times(times), "flags": flags,
                              "timing": "graph" if timer.graph else ("eager" if timer.cuda else "cpu")}
    median = result["median_s"]
    if median > 0:
        result["bytes_per_s"] = spec.bytes / median
        result["flops_per_s"] = spec.flops / median
    if ceilings and median > 0:
        bw_frac = result["bytes_per_s"] / ceilings["copy_bytes_per_s"]
        fl_frac = result["flops_per_s"] / ceilings["matmul_flops_per_s"]
        result.update(frac_copy_bandwidth=bw_frac, frac_matmul=fl_frac,
                      bound="memory" if bw_frac >= fl_frac else "compute")
    if spec.check is not None:
        checked = spec.check(args, out)
        checked = checked if isinstance(checked, (list, tuple)) else [checked]
        result["check"] = [c.to_dict() for c in checked]
        if not all(c.passed for c in checked):
            flags.append("wrong_output")
    result["passed"] = not flags
    return result


def machine_info() -> dict[str, Any]:
    """What else was running: CPU timings on a shared, oversubscribed host are not comparable."""
    info: dict[str, Any] = {"host": platform.node(), "cpu_count": os.cpu_count()}
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = os.getloadavg()[0]
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def run_benchmarks(patterns: list[str], ctx: BenchContext, runs: int | None = None, seed: int = 0,
                   ceilings: dict[str, Any] | None = None, providers: tuple[str, ...] = registry.PROVIDERS,
                   gil_probe_ms: float | None = None, graph: bool = False,
                   progress: bool | None = None) -> dict[str, Any]:
    """Run the matching benchmarks; with ``gil_probe_ms`` each runs under a GIL probe of that threshold
    and its result carries the stalls (count, durations, the culprit frames); ``graph``: see the module;
    ``progress``: a bar over the benchmarks on stderr (``None``: when stderr is a terminal)."""
    errors = registry.load_providers(providers)
    entries = registry.select(registry.benchmarks(), patterns)
    results = []
    bar = progress_bar(len(entries), "bench", "benchmark", progress)
    for entry in entries:
        bar.set_postfix_str(entry.name)
        try:
            spec = entry.fn(ctx)
            probe = None
            if gil_probe_ms:
                from flashinfra.feedback.gil_probe import GilProbe

                probe = GilProbe(threshold_s=gil_probe_ms / 1e3, interval_s=min(0.01, gil_probe_ms / 2e3)).start()
            try:
                result = run_spec(entry.name, spec, ctx.device, runs=runs or (10 if ctx.quick else 50), seed=seed,
                                  max_seconds=None if runs else (1.0 if ctx.quick else 5.0), ceilings=ceilings,
                                  graph=graph)
            finally:
                if probe is not None:
                    probe.stop()
            if probe is not None:
                report = probe.report()
                result["gil_stalls"] = {k: report[k] for k in ("count", "total_s", "max_s", "threshold_s")}
                result["gil_stalls"]["culprits"] = sorted({line for st in probe.stalls for line in st.culprit_lines()})
            results.append(result)
        except Exception as exc:
            results.append({"name": entry.name, "error": f"{type(exc).__name__}: {exc}", "passed": False})
        bar.update(1)
    bar.close()
    return {"date": datetime.now(timezone.utc).isoformat(), "source": str(Path(registry.__file__).parent.parent),
            "machine": machine_info(), "device": ctx.device, "dtype": ctx.dtype,
            "quick": ctx.quick, "ceilings": ceilings,
            "provider_errors": [{"module": m, "error": e} for m, e in errors], "benchmarks": results}


def format_text(report: dict[str, Any]) -> str:
    lines = [f"ERROR importing provider {e['module']}:\n{e['error']}" for e in report["provider_errors"]]
    m = report.get("machine", {})
    if m.get("loadavg_1m") is not None and m.get("cpu_count") and m["loadavg_1m"] > m["cpu_count"]:
        lines.append(f"warning: load average {m['loadavg_1m']:.1f} exceeds {m['cpu_count']} CPUs; CPU timings "
                     "include waiting for other processes")
    for r in report["benchmarks"]:
        if "error" in r:
            lines.append(f"FAIL {r['name']}: {r['error']}")
            continue
        text = (f"{'ok  ' if r['passed'] else 'FLAG'} {r['name']}: median {r['median_s'] * 1e6:.1f} us "
                f"(p10 {r['p10_s'] * 1e6:.1f}, p90 {r['p90_s'] * 1e6:.1f}, n={r['runs']})")
        if "frac_copy_bandwidth" in r:
            text += (f"  {r['bytes_per_s'] / 1e9:.1f} GB/s = {100 * r['frac_copy_bandwidth']:.1f}% of copy, "
                     f"{r['flops_per_s'] / 1e12:.3f} TFLOP/s = {100 * r['frac_matmul']:.1f}% of matmul "
                     f"[{r['bound']}-bound]")
        if r["flags"]:
            text += "  flags: " + ", ".join(r["flags"])
        lines.append(text)
        if "gil_stalls" in r:
            g = r["gil_stalls"]
            lines.append(f"    GIL stalls over {g['threshold_s'] * 1e3:g} ms: {g['count']}, "
                         f"total {g['total_s'] * 1e3:.1f} ms, longest {g['max_s'] * 1e3:.1f} ms")
            lines += [f"      {c}" for c in g["culprits"][:8]]
        for c in r.get("check", []):
            if not c["passed"]:
                lines.append(f"    check {c['name']}: max_abs={c['max_abs']} rel_norm={c['rel_norm']} "
                             f"bad={c['num_bad']} at {c['bad_indices']} {c['message']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from flashinfra.cli_help import DefaultsHelpFormatter

    p = argparse.ArgumentParser(prog="flashinfra bench", description=(
        "Run microbenchmarks (names, prefixes, globs or tags), or 'ceilings' to measure this machine, or "
        "'serve ARGS...' to run the serving benchmark."), formatter_class=DefaultsHelpFormatter)
    p.add_argument("names", nargs="*", help="benchmarks to run: names, prefixes, globs or tags")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks with their tags and exit")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of the benchmarks")
    p.add_argument("--quick", action="store_true", help="small sizes, few runs")
    p.add_argument("--runs", type=int, default=None, help="timed runs per benchmark")
    p.add_argument("--seed", type=int, default=0, help="seeds the benchmarks' random inputs")
    p.add_argument("--no-roofline", action="store_true", help="skip ceilings (no fractions reported)")
    p.add_argument("--provider", action="append", default=[], help="extra module registering benchmarks")
    p.add_argument("--no-default-providers", action="store_true",
                   help="load only the --provider modules, not flashinfra's own")
    p.add_argument("--output", default=None, help="also write the JSON report here")
    p.add_argument("--graph", action="store_true",
                   help="on CUDA, time replays of each call captured in a CUDA graph (no launch overhead)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--gil-probe-ms", type=float, default=None,
                   help="run each benchmark under a GIL probe with this stall threshold")
    return p


def _serve(argv: list[str]) -> int:
    try:
        from flashinfra.server.bench_serve import main as serve_main
    except ModuleNotFoundError as exc:
        if exc.name in ("flashinfra.server", "flashinfra.server.bench_serve"):
            print("error: 'bench serve' needs flashinfra.server.bench_serve, which is not installed",
                  file=sys.stderr)
            return 2
        raise
    return int(serve_main(argv) or 0)


def cli_main(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        errors = registry.load_providers((() if args.no_default_providers else registry.PROVIDERS)
                                         + tuple(args.provider))
        for entry in sorted(registry.benchmarks().values(), key=lambda e: e.name):
            print(f"{entry.name:40s} {', '.join(entry.tags)}")
        print("serve                                    (the serving benchmark: 'bench serve --help')")
        for module, error in errors:
            print(f"error: provider {module}: {error}", file=sys.stderr)
        return 0
    if not args.names:
        parser.error("name at least one benchmark (or --list to see them)")
    device = args.device or default_device()
    if args.names == ["ceilings"]:
        from flashinfra.feedback import ceilings

        measured = ceilings.measure(device, quick=args.quick)
        path = ceilings.save(measured)
        print(json.dumps(measured, indent=2) if args.json else ceilings.format_text(measured) + f"\n  saved {path}")
        return 0
    ceil = None
    if not args.no_roofline:
        from flashinfra.feedback import ceilings

        ceil = ceilings.load_or_measure(device)
    ctx = BenchContext(device=device, dtype=args.dtype, quick=args.quick)
    try:
        report = run_benchmarks(args.names, ctx, runs=args.runs, seed=args.seed, ceilings=ceil,
                                providers=(() if args.no_default_providers else registry.PROVIDERS)
                                + tuple(args.provider), gil_probe_ms=args.gil_probe_ms,
                                graph=args.graph, progress=args.progress)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text if args.json else format_text(report))
    ok = all(r.get("passed") for r in report["benchmarks"]) and not report["provider_errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))

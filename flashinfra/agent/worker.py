"""What runs inside an evaluation subprocess: ``python -m flashinfra.agent.worker SPEC.json``.

The spec names tasks (``checks``, ``bench``, ``gil``, ``trace``), the provider modules that register the
repository's checks and benchmarks, what to run, the allowed roots and where to write. The worker imports
the trusted machinery first (``flashinfra.feedback``, torch), then arms ``flashinfra.agent.guard``, and
only then imports the providers: candidate code never runs unguarded. The result is one JSON file.
Spawning and limiting the process is ``flashinfra.agent.sandbox``'s job; reading results, the caller's.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def _checks(spec: dict) -> dict:
    from flashinfra.feedback import check

    runs, errors, seed = check.run_checks(spec.get("patterns") or None, seed=spec.get("seed"),
                                          providers=tuple(spec["providers"]))
    out = check.to_json(runs, errors, seed)
    out["text"] = check.format_text(runs, errors, seed)
    return out


def _context():
    from flashinfra.feedback import bench
    from flashinfra.feedback.registry import BenchContext

    return BenchContext(device=bench.default_device(), quick=True)


def _bench(spec: dict) -> dict:
    """Each benchmark timed in ``blocks`` blocks of ``repeats`` runs, round-robin across benchmarks so that
    a slow phase of the machine touches all of them alike; one median per block."""
    from flashinfra.feedback import bench, registry

    ctx = _context()
    entries = registry.select(registry.benchmarks(), spec.get("benchmarks") or None)
    specs = {e.name: e.fn(ctx) for e in entries}
    out: dict = {name: {"block_medians": [], "flags": []} for name in specs}
    for block in range(int(spec.get("blocks", 3))):
        for name, bspec in specs.items():
            # Warm-up once per process: later blocks run on a warm interpreter and allocator.
            r = bench.run_spec(name, bspec, ctx.device, runs=int(spec.get("repeats", 5)),
                               warmup=2 if block == 0 else 0, seed=int(spec.get("seed") or 0) + 1000 * block)
            out[name]["block_medians"].append(r["median_s"])
            out[name]["flags"] = sorted(set(out[name]["flags"]) | set(r["flags"]))
            out[name]["last"] = {k: v for k, v in r.items() if k not in ("params", "description")}
    return out


def _gil(spec: dict) -> dict:
    """The named benchmarks run under the GIL probe; stalls also go to ``events.jsonl`` in the workdir."""
    from flashinfra.feedback import bench, gil_probe, registry
    from flashinfra.feedback.events import EventLog

    ctx = _context()
    log = EventLog(Path(spec["workdir"]) / "events.jsonl")
    reports = {}
    for entry in registry.select(registry.benchmarks(), spec.get("benchmarks") or None):
        bspec = entry.fn(ctx)
        probe = gil_probe.GilProbe(threshold_s=float(spec.get("threshold_s", 0.005)), interval_s=0.002,
                                   events=log)
        with log.span("benchmark", name=entry.name), probe:
            bench.run_spec(entry.name, bspec, ctx.device, runs=int(spec.get("repeats", 3)), warmup=1)
        reports[entry.name] = {**probe.report(), "text": probe.format_text()}
    return {"reports": reports, "events": str(log.path)}


def _trace(spec: dict) -> dict:
    """One benchmark's calls under torch.profiler: a Chrome trace in the workdir and its summary."""
    from flashinfra.feedback import registry, trace

    ctx = _context()
    (entry,) = [e for e in registry.select(registry.benchmarks(), [spec["benchmark"]])
                if e.name == spec["benchmark"]] or [None]
    if entry is None:
        raise KeyError(f"no benchmark named {spec['benchmark']!r}")
    bspec = entry.fn(ctx)
    inputs = {i: bspec.make_inputs(i) for i in range(-1, int(spec.get("steps", 3)))}

    def step(i: int):
        args = inputs[max(i, -1)]
        return bspec.fn(*(args if isinstance(args, (tuple, list)) else (args,)))

    path = trace.profile_steps(step, int(spec.get("steps", 3)), ctx.device, Path(spec["workdir"]) / "trace")
    summary = trace.summarize_trace(path)
    return {"path": str(path), "text": trace.format_text(summary)}


TASKS = {"checks": _checks, "bench": _bench, "gil": _gil, "trace": _trace}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    unknown = [t for t in spec["tasks"] if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown worker tasks {unknown}; known: {sorted(TASKS)}")
    # Trusted imports before arming: the feedback machinery and torch, whatever the task needs later.
    import torch  # noqa: F401

    from flashinfra.agent import guard
    from flashinfra.feedback import bench, check, events, gil_probe, registry  # noqa: F401

    sys.path.insert(0, spec["repo"])
    guard.arm(read_roots=[spec["repo"], *guard.python_roots()], write_roots=[spec["workdir"]],
              report_path=spec["violations"], path_entries=guard.import_entries(),
              allow_subprocess=bool(spec.get("allow_subprocess")))
    result: dict = {"ok": True}
    try:
        errors = registry.load_providers(tuple(spec["providers"]))
        result["provider_errors"] = [{"module": m, "error": e} for m, e in errors]
        for task in spec["tasks"]:
            result[task] = TASKS[task](spec)
    except Exception:
        result = {"ok": False, "error": traceback.format_exc(limit=-10)}
    Path(spec["out"]).write_text(json.dumps(result, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Per-kernel timings of the hot-path kernels against their roofline floors, in one run with the ceilings.

Runs the ``hotpath.*`` benchmarks registered by ``flashinfra.kernels.checks`` (bytes and FLOPs per
call derived in ``bench/notes/<op>.md``) through ``flashinfra.feedback.bench`` (fresh inputs per call, L2
flushed, CUDA events; each call captured in a CUDA graph and its replay timed, so small batches show the
kernels' time, not the host's launch cost: a decode step runs them from a graph too), with the copy
bandwidth and matmul rate measured in the same run, and prints one row per kernel: median time, floor (the larger of
bytes / bandwidth and FLOPs / matmul rate) and the fraction of the floor reached.

usage: python bench/hotpath_kernels.py [PATTERN...] [--runs N] [--out bench/results/hotpath_kernels.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashinfra.feedback import ceilings
from flashinfra.feedback.bench import run_benchmarks
from flashinfra.feedback.registry import BenchContext


def table(report: dict) -> str:
    c = report["ceilings"]
    rows = [f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s",
            f"{'kernel':44s} {'median us':>10s} {'floor us':>9s} {'of floor':>8s}  bound   timing"]
    for r in report["benchmarks"]:
        if "error" in r:
            rows.append(f"{r['name']:44s} ERROR {r['error'][:80]}")
            continue
        t_bytes = r["bytes"] / c["copy_bytes_per_s"]
        t_flops = r["flops"] / c["matmul_flops_per_s"]
        floor = max(t_bytes, t_flops)
        rows.append(f"{r['name']:44s} {r['median_s'] * 1e6:10.1f} {floor * 1e6:9.1f} {floor / r['median_s']:8.1%}  "
                    f"{'memory' if t_bytes >= t_flops else 'compute'}  {r['timing']}"
                    f"{'  FLAGS ' + ','.join(r['flags']) if r['flags'] else ''}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", default=["hotpath"])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default="bench/results/hotpath_kernels.json")
    args = ap.parse_args()
    ceil = ceilings.measure("cuda")
    report = run_benchmarks(args.patterns, BenchContext(device="cuda", dtype="bfloat16"), runs=args.runs, ceilings=ceil,
                            providers=("flashinfra.kernels.checks", "flashinfra.kernels.dsa_benches"),
                            graph=True)
    report["command"] = "python bench/hotpath_kernels.py " + " ".join(args.patterns) + f" --runs {args.runs}"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()

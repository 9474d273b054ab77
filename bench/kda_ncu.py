"""Hardware counters of the KDA kernels (Nsight Compute): what limits each launch, ours and FLA's side by side.

One call of the chosen path runs between ``cudaProfilerStart`` / ``cudaProfilerStop`` after a warm call (so
compiling and FLA's autotuning stay outside), under ``ncu --profile-from-start off``; ``summarize`` turns the
report into a table and JSON: per kernel its time, DRAM and L2 bytes (rate x time) and DRAM throughput, achieved
occupancy, issue activity, registers, shared memory, and its three largest warp stall reasons.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        -f -o prefill python3 bench/kda_ncu.py prefill [--T 8192]
    ncu ... -o fla python3 bench/kda_ncu.py fla [--T 8192]
    ncu ... -o decode python3 bench/kda_ncu.py decode [--B 64]
    python3 bench/kda_ncu.py summarize prefill.ncu-rep fla.ncu-rep decode.ncu-rep --name kda_ncu [--out DIR]

With ``--metrics smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,
lts__t_bytes.sum`` instead of the sections, ``summarize`` reports instructions and DRAM / L2 bytes. With
``--section SourceCounters --import-source yes``, ``lines`` sums each kernel's warp stall samples per source line (a
load's latency shows on the line that first uses its value):

    python3 bench/kda_ncu.py lines prefill.ncu-rep --name kda_prefill_ncu_lines [--top 16] [--out DIR]

Shapes as ``bench/kda_prefill.py`` and ``bench/kda_decode.py`` (H=64, K=V=128).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# raw metric -> column (the sections above collect these; bytes come as rates)
METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes.sum.per_second": "dram_GBps",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "lts__t_bytes.sum.per_second": "l2_GBps",
    "l1tex__t_bytes.sum.per_second": "l1_GBps",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "launch__registers_per_thread": "regs",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "smsp__inst_executed.sum": "warp_inst",
    "dram__bytes_read.sum": "dram_read_MB",
    "dram__bytes_write.sum": "dram_write_MB",
    "lts__t_bytes.sum": "l2_bytes_MB",
}
STALL = "smsp__average_warps_issue_stalled_"
# ncu's units -> the columns' (microseconds, GB/s)
UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6,
         "byte/second": 1e-9, "Kbyte/second": 1e-6, "Mbyte/second": 1e-3, "Gbyte/second": 1.0, "Tbyte/second": 1e3,
         "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}


def run_profiled(fn) -> None:
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def prefill(args) -> None:
    from kda_prefill import inputs

    from flashinfra.kernels.kda.prefill import kda_prefill_launch

    a = inputs([args.T], seed=1 + args.T)
    run_profiled(functools.partial(kda_prefill_launch, a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"],
                                   a["cu"], [0], [True]))


def fla(args) -> None:
    import torch
    from fla.ops.kda import chunk_kda
    from kda_prefill import K, inputs

    a = inputs([args.T], seed=1 + args.T)
    kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16()[None]
    run_profiled(lambda: chunk_kda(a["q"][None], kn, a["v"][None], a["g"][None], a["beta"].bfloat16()[None],
                                   scale=K**-0.5, initial_state=a["state"], output_final_state=True))


def decode(args) -> None:
    import torch
    from kda_decode import layer_inputs

    from flashinfra.kernels.kda.decode import kda_layer_decode_launch

    for dtype in (torch.float32, torch.bfloat16):
        a = layer_inputs(args.B, dtype, seed=5)
        run_profiled(functools.partial(kda_layer_decode_launch, **a))


def summarize(args) -> None:
    from flashinfra.feedback.timing import header, write_results

    res = header() | {"reports": {}}
    for rep in args.reports:
        text = subprocess.run(["ncu", "--import", rep, "--csv", "--page", "raw"], check=True, capture_output=True,
                              text=True).stdout
        rows = list(csv.reader(io.StringIO(text)))
        names, units, body = rows[0], dict(zip(rows[0], rows[1])), rows[2:]
        kernels = []
        for r in body:
            rec = dict(zip(names, r))
            k = {"kernel": rec.get("Kernel Name", "?")[:80]}
            for metric, col in METRICS.items():
                try:
                    k[col] = float(rec[metric].replace(",", "")) * UNITS.get(units[metric], 1.0)
                except (KeyError, ValueError):
                    pass
            stalls = {}
            for m, v in rec.items():
                if m.startswith(STALL) and m.endswith("_per_issue_active.ratio") and "not_issued" not in m:
                    try:
                        stalls[m[len(STALL):-len("_per_issue_active.ratio")]] = float(v.replace(",", ""))
                    except ValueError:
                        pass
            k["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:3])
            kernels.append(k)
        res["reports"][os.path.basename(rep)] = kernels
        print(f"== {rep}")
        print(f"{'kernel':40s} {'us':>7s} {'DRAM MB':>8s} {'dram%':>6s} {'L2 MB':>7s} {'occ%':>5s} "
              f"{'issue%':>6s} {'regs':>4s}  stalls (per issue)")
        for k in kernels:
            st = " ".join(f"{n}={v:.1f}" for n, v in k["stalls"].items())
            t = k.get("us", 0.0)
            k["dram_MB"] = (k["dram_read_MB"] + k.get("dram_write_MB", 0.0) if "dram_read_MB" in k
                            else k.get("dram_GBps", 0.0) * t * 1e-3)
            k["l2_MB"] = k.get("l2_bytes_MB", k.get("l2_GBps", 0.0) * t * 1e-3)
            print(f"{k['kernel'][:40]:40s} {t:7.1f} {k['dram_MB']:8.0f} {k.get('dram_pct', 0):6.1f} {k['l2_MB']:7.0f} "
                  f"{k.get('occupancy_pct', 0):5.1f} {k.get('issue_pct', 0):6.1f} {k.get('regs', 0):4.0f}  {st}")
    write_results(args.name, res, args.out)


def lines(args) -> None:
    """Each kernel's warp stall samples summed per source line (``--page source --print-source cuda,sass``:
    the rows with a line number carry that line's totals), the ``--top`` largest as shares of the kernel's."""
    from collections import Counter, defaultdict

    from flashinfra.feedback.timing import header, write_results

    res = header() | {"reports": {}}
    for rep in args.reports:
        text = subprocess.run(["ncu", "--import", rep, "--page", "source", "--print-source", "cuda,sass", "--csv"],
                              check=True, capture_output=True, text=True).stdout
        path, fn, hdr = "?", "?", None
        samples, source, unparsed = defaultdict(Counter), {}, Counter()
        for row in csv.reader(io.StringIO(text)):
            if not row:
                continue
            if row[0] in ("File Path", "Function Name"):
                path, fn = (os.path.basename(row[1]), fn) if row[0] == "File Path" else (path, row[1])
                continue
            if row[0] == "Line No":
                hdr = row.index("Warp Stall Sampling (All Samples)")
                continue
            # the SASS listing that follows each source listing has its own header ("Address", ...): only a
            # source row starts with a line number
            if hdr is None or not row[0].isdigit() or len(row) <= hdr:
                continue
            key = f"{path}:{row[0]}"
            try:
                samples[fn][key] += float(row[hdr].replace(",", "") or 0)
            except ValueError:
                # a source line with unbalanced quotes (a docstring's) shifts the CSV's columns: left out, counted
                unparsed[fn] += 1
                continue
            source[key] = row[1].strip()[:110]
        kernels = {}
        for fn, per_line in samples.items():
            total = sum(per_line.values()) or 1.0
            kernels[fn] = {"samples": total, "unparsed_lines": unparsed[fn], "lines": [
                {"share_pct": 100 * n / total, "line": key, "source": source[key]}
                for key, n in per_line.most_common(args.top)]}
            print(f"== {fn}: {total:.0f} samples")
            for r in kernels[fn]["lines"]:
                print(f"  {r['share_pct']:5.1f}%  {r['line']:34s} {r['source']}")
        res["reports"][os.path.basename(rep)] = kernels
    write_results(args.name, res, args.out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("prefill")
    p.add_argument("--T", type=int, default=8192)
    p = sub.add_parser("fla")
    p.add_argument("--T", type=int, default=8192)
    p = sub.add_parser("decode")
    p.add_argument("--B", type=int, default=64)
    p = sub.add_parser("summarize")
    p.add_argument("reports", nargs="+")
    p.add_argument("--name", default="kda_ncu")
    p.add_argument("--out")
    p = sub.add_parser("lines")
    p.add_argument("reports", nargs="+")
    p.add_argument("--name", default="kda_ncu_lines")
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--out")
    args = ap.parse_args()
    {"prefill": prefill, "fla": fla, "decode": decode, "summarize": summarize,
     "lines": lines}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

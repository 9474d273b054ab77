"""Where the KDA layer decode's time goes inside a CUDA graph: the kernels of each launch and the gaps between them,
from a profiler trace of graph replays (each graph holds ``--calls`` back-to-back layer calls, as a decode step's
graph holds every layer), at the defaults, fp32 and bf16 state, H=64, K=V=128.

    python bench/kda_decode_timeline.py [--batches 64,256] [--calls 10] [--out DIR]
        -> bench/results/kda_decode_timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import capture_graph, header, write_results  # noqa: E402
from kda_decode import layer_inputs  # noqa: E402

from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402


def kernel_trace(fn, calls: int, replays: int = 3) -> list[dict]:
    """The kernel events (name, ts, dur in us) of ``replays`` replays of a graph of ``calls`` calls of fn."""
    graph = capture_graph(fn, calls)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def split(events: list[dict], layers: int) -> dict:
    """Median span per kernel name and per pair of consecutive kernels' gap, and the time per layer."""
    spans: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for e in events:
        spans.setdefault(e["name"], []).append(e["dur"])
    for a, b in zip(events, events[1:]):
        gaps.setdefault(f"{a['name']} -> {b['name']}", []).append(b["ts"] - a["ts"] - a["dur"])
    per_layer = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / layers
    return {"per_layer_us": per_layer, "kernels_us": {k: statistics.median(v) for k, v in spans.items()},
            "gaps_us": {k: statistics.median(v) for k, v in gaps.items()}, "kernels": len(events)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--calls", type=int, default=10, help="layer calls per graph")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    res = header()
    res["calls_per_graph"], res["rows"] = args.calls, []
    for B in [int(b) for b in args.batches.split(",")]:
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = layer_inputs(B, dt, seed=B)
            row = {"B": B, "state": name, **split(kernel_trace(lambda: kda_layer_decode_launch(**a), args.calls, 3),
                                                    3 * args.calls)}
            res["rows"].append(row)
            print(f"B={B} {name}: per layer {row['per_layer_us']:.1f} us;",
                  ", ".join(f"{k.removeprefix('kda_layer_decode_')} {v:.2f}" for k, v in row["kernels_us"].items()),
                  "; gaps", ", ".join(f"{v:.2f}" for v in row["gaps_us"].values()), flush=True)
    write_results("kda_decode_timeline", res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

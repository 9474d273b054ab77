"""``flashinfra serve`` (the built-in model) under ``bench serve`` at one concurrency, twice on the same server, with
the engine's runtime events: per run the client's figures, and for the second run the engine's steps by make-up
(mixed prefill + decode, prefill only, decode only: count, median and max time) and the gaps between steps, and
every Triton compilation after start-up (``kernel_compile`` events: a specialisation the warm-up missed) by part. Extra
arguments after ``--`` go to ``serve`` (e.g. ``--async-scheduling``). The first run shows what a fresh server
pays once (kernels compiled, graphs met late), the second its steady state.

usage: python bench/serving_steps.py --out bench/results/serving_steps.json [--concurrency 128] [-- SERVE_ARGS...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401  (names the GPU in the header)
from serve_runs import bench, running, summary

from flashinfra.feedback.timing import header, write_results

PORT = 8791
INPUT_LEN, OUTPUT_LEN = 256, 128


def _steps(events: list[dict]) -> dict:
    """The step events' times by the step's make-up, and the gaps between consecutive steps."""
    groups = {"mixed": [e for e in events if e["num_prefill_tokens"] and e["num_decode_tokens"]],
              "prefill": [e for e in events if e["num_prefill_tokens"] and not e["num_decode_tokens"]],
              "decode": [e for e in events if not e["num_prefill_tokens"]]}
    out = {k: dict(count=len(v), median_ms=1e3 * statistics.median(e["duration_s"] for e in v),
                   max_ms=1e3 * max(e["duration_s"] for e in v), total_s=sum(e["duration_s"] for e in v),
                   median_reqs=statistics.median(e["num_reqs"] for e in v))
           for k, v in groups.items() if v}
    gaps = [b["start"] - a["end"] for a, b in zip(events, events[1:])]
    out["gaps"] = dict(median_ms=1e3 * statistics.median(gaps), total_s=sum(gaps)) if gaps else {}
    out["span_s"] = events[-1]["end"] - events[0]["start"] if events else 0.0
    return out


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    c, n = args.concurrency, max(4 * args.concurrency, 32)
    log_dir = Path(tempfile.mkdtemp(prefix="serving-steps-"))
    events = log_dir / "events.jsonl"
    cmd = [sys.executable, "-m", "flashinfra", "serve", "--port", str(PORT), "--max-num-seqs", str(c),
           "--events-path", str(events), *serve_args]
    marks = []  # event lines written before each part
    with running(cmd, PORT, log_dir / "serve.log", timeout_s=600.0, stop_timeout_s=60.0) as startup_s:
        marks.append(sum(1 for _ in open(events)))
        bench(PORT, 8, 32, INPUT_LEN, OUTPUT_LEN)  # untimed: the first requests of a fresh server
        marks.append(sum(1 for _ in open(events)))
        first = bench(PORT, c, n, INPUT_LEN, OUTPUT_LEN)
        marks.append(sum(1 for _ in open(events)))
        second = bench(PORT, c, n, INPUT_LEN, OUTPUT_LEN)
    lines = [json.loads(line) for line in open(events)]
    parts = dict(zip(("first_requests", "first_run", "second_run"), zip(marks, [*marks[1:], len(lines)])))
    steps = [e for e in lines[marks[2]:] if e["kind"] == "step"]
    startup = [e for e in lines[: marks[0]] if e["kind"] == "kernel_compile"]
    compiles = {name: [dict(kernel=e["kernel"], spec=e["spec"], duration_s=e["duration_s"]) for e in lines[a:b]
                       if e["kind"] == "kernel_compile" and e.get("phase") == "serving"]
                 for name, (a, b) in parts.items()}
    # the host's CPU is in ``machine``: at concurrency 128 the built-in model's steps are host work
    result = dict(header(), serve=" ".join(cmd[1:]), concurrency=c, num_prompts=n, startup_s=startup_s,
                  first_run=summary(first), second_run=summary(second), second_run_steps=_steps(steps),
                  kernel_compiles_at_startup=dict(count=len(startup), seconds=sum(e["duration_s"] for e in startup)),
                  kernel_compiles_after_startup=compiles)
    print(json.dumps(result, indent=1))
    if args.out:
        write_results(Path(args.out).stem, result, directory=Path(args.out).parent)


if __name__ == "__main__":
    main()

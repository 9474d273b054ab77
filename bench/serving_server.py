"""The server rows of ``bench/serving.py``: ``flashinfra serve`` with the built-in model under
``flashinfra bench serve``, and the same server in front of an engine that computes nothing (the floor).

Each concurrency runs ``max(4 x concurrency, 32)`` streamed requests of 256 prompt tokens (token ids) and
128 output tokens (``ignore_eos``). The floor is ``bench/server_overhead.py``'s echo engine with a step of
``ECHO_STEP_MS``: what the API process alone allows at that concurrency.

usage: python bench/serving_server.py [--concurrency 1 16 64 128]   # these rows alone, their summaries printed
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from serve_runs import bench, log_tail, running, summary, sweep
from server_overhead import measure as measure_echo

CONCURRENCIES = (1, 16, 64, 128)
INPUT_LEN, OUTPUT_LEN = 256, 128
ECHO_STEP_MS = 0.5
PORT = 8781


def _num_prompts(concurrency: int) -> int:
    return max(4 * concurrency, 32)


def server_rows(log_dir: Path, concurrencies=CONCURRENCIES) -> dict:
    """``bench serve`` at every concurrency against the built-in model (on the GPU when there is one), then the
    echo floor at the largest; returns the reports (full and summarised) and the server's start-up log."""
    cmd = [sys.executable, "-m", "flashinfra", "serve", "--port", str(PORT), "--max-num-seqs",
           str(max(concurrencies)), "--log-level", "info"]
    log_path = log_dir / "serving_server.log"
    out: dict = {"command": " ".join(cmd[1:])}
    with running(cmd, PORT, log_path, timeout_s=600.0, stop_timeout_s=90.0) as startup_s:
        out["startup_s"] = startup_s
        bench(PORT, 8, _num_prompts(8), INPUT_LEN, OUTPUT_LEN)  # untimed: the first requests of a fresh server
        out["runs"] = sweep(PORT, concurrencies, _num_prompts, INPUT_LEN, OUTPUT_LEN)
    out["log_tail"] = log_tail(log_path)
    top = max(concurrencies)
    echo = measure_echo(top, _num_prompts(top), INPUT_LEN, OUTPUT_LEN, ECHO_STEP_MS, port=PORT + 1)
    out["echo_floor"] = dict(step_ms=ECHO_STEP_MS, concurrency=top, summary=summary(echo), report=echo)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        rows = server_rows(Path(log_dir), args.concurrency)
    print(json.dumps({"startup_s": rows["startup_s"], **{c: r["summary"] for c, r in rows["runs"].items()},
                      "echo_floor": rows["echo_floor"]["summary"]}, indent=1))


if __name__ == "__main__":
    main()

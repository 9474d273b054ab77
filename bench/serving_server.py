"""The server rows of ``bench/serving.py``: ``flashinfra serve`` with the built-in model under
``flashinfra bench serve``, and the same server in front of an engine that computes nothing (the floor).

Each concurrency runs ``max(4 x concurrency, 32)`` streamed requests of 256 prompt tokens (token ids) and
128 output tokens (``ignore_eos``). The floor is ``bench/server_overhead.py``'s echo engine with a step of
``ECHO_STEP_MS``: what the API process alone allows at that concurrency.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from server_overhead import measure as measure_echo

from flashinfra.server import bench_serve

REPO = Path(__file__).resolve().parent.parent
CONCURRENCIES = (1, 16, 64, 128)
INPUT_LEN, OUTPUT_LEN = 256, 128
ECHO_STEP_MS = 0.5
PORT = 8781


def _num_prompts(concurrency: int) -> int:
    return max(4 * concurrency, 32)


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"flashinfra serve exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"flashinfra serve was not healthy after {timeout_s:.0f} s")


def _bench(port: int, concurrency: int) -> dict:
    args = bench_serve.build_parser().parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--concurrency", str(concurrency),
        "--num-prompts", str(_num_prompts(concurrency)), "--input-len", str(INPUT_LEN),
        "--output-len", str(OUTPUT_LEN), "--token-ids", "--vocab-size", "4000", "--no-progress"])
    return asyncio.run(bench_serve.run_benchmark(args))


def summary(report: dict) -> dict:
    """The figures the table shows, from a ``bench serve`` report."""
    tpot, itl = report["tpot_ms"], report["itl_ms"]
    return dict(output_tok_s=report["output_throughput_tok_s"], completed=report["completed"],
                failed=report["failed"], ttft_p50_ms=report["ttft_ms"]["p50"], tpot_p50_ms=tpot["p50"],
                tpot_p90_ms=tpot["p90"], tpot_p99_ms=tpot["p99"], itl_p50_ms=itl["p50"], itl_p99_ms=itl["p99"],
                tpot_p99_over_p50=(tpot["p99"] / tpot["p50"]) if tpot["p50"] else None)


def server_rows(log_dir: Path) -> dict:
    """``bench serve`` at every concurrency against the built-in model on the GPU, then the echo floor at
    the largest; returns the reports (full and summarised) and the server's start-up log."""
    cmd = [sys.executable, "-m", "flashinfra", "serve", "--port", str(PORT), "--max-num-seqs",
           str(max(CONCURRENCIES)), "--log-level", "info"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = log_dir / "serving_server.log"
    out: dict = {"command": " ".join(cmd[1:]), "runs": {}}
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            out["startup_s"] = _wait_healthy(PORT, proc, 600.0)
            _bench(PORT, 8)  # untimed: the first requests of a fresh server
            for c in CONCURRENCIES:
                report = _bench(PORT, c)
                out["runs"][str(c)] = dict(summary=summary(report), report=report)
                print(f"serve c={c}: {summary(report)}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
    out["log_tail"] = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
    top = max(CONCURRENCIES)
    echo = measure_echo(top, _num_prompts(top), INPUT_LEN, OUTPUT_LEN, ECHO_STEP_MS, port=PORT + 1)
    out["echo_floor"] = dict(step_ms=ECHO_STEP_MS, concurrency=top, summary=summary(echo), report=echo)
    return out

"""``flashinfra bench serve`` against a server this process starts: start it (the repository on its PYTHONPATH),
wait until ``/health`` answers, run the benchmark at each concurrency with token-id prompts (ignore_eos), stop
it. Shared by ``serving_server.py``, ``whole_model.py`` and ``server_overhead.py``; what the server is and
which figures a script keeps stay in the script.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 4000  # prompt token ids are drawn below this: inside the vocabulary of every model served here


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until the server on ``port`` answers ``/health``; raises when ``proc`` exits or time runs out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server on port {port} was not healthy after {timeout_s:.0f} s")


def repo_env() -> dict:
    """This process's environment with the repository first on PYTHONPATH, for the servers it starts."""
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@contextmanager
def running(cmd: list[str], port: int, log_path: Path, timeout_s: float, stop_timeout_s: float) -> Iterator[float]:
    """Run ``cmd`` (its output into ``log_path``) and yield the seconds it took to be healthy; on exit terminate
    it, and kill it when it has not stopped after ``stop_timeout_s``."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=repo_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                healthy_s = wait_healthy(port, proc, timeout_s)
            except RuntimeError as e:
                log.flush()
                raise RuntimeError(f"{e}; its log ({log_path}) ends:\n" + "\n".join(log_tail(log_path))) from None
            yield healthy_s
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench(port: int, concurrency: int, num_prompts: int, input_len: int, output_len: int,
          timeout_s: float = 600.0) -> dict:
    """One ``flashinfra bench serve`` run against the server on ``port``; its report. ``timeout_s``: per request."""
    from flashinfra.server import bench_serve

    args = bench_serve.build_parser().parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--concurrency", str(concurrency), "--num-prompts",
        str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len), "--token-ids",
        "--vocab-size", str(VOCAB_SIZE), "--no-progress", "--timeout", str(timeout_s)])
    return asyncio.run(bench_serve.run_benchmark(args))


def summary(report: dict) -> dict:
    """The figures the tables show, from a ``bench serve`` report."""
    tpot, itl = report["tpot_ms"], report["itl_ms"]
    return dict(output_tok_s=report["output_throughput_tok_s"], completed=report["completed"],
                failed=report["failed"], ttft_p50_ms=report["ttft_ms"]["p50"], tpot_p50_ms=tpot["p50"],
                tpot_p90_ms=tpot["p90"], tpot_p99_ms=tpot["p99"], itl_p50_ms=itl["p50"], itl_p99_ms=itl["p99"],
                tpot_p99_over_p50=(tpot["p99"] / tpot["p50"]) if tpot["p50"] else None,
                errors=report["errors"][:3])


def sweep(port: int, concurrencies, num_prompts: Callable[[int], int], input_len: int, output_len: int,
          timeout_s: float = 600.0) -> dict:
    """``bench`` at each concurrency with ``num_prompts(concurrency)`` requests -> {concurrency: {summary, report}},
    each summary printed as it comes."""
    runs = {}
    for c in concurrencies:
        report = bench(port, c, num_prompts(c), input_len, output_len, timeout_s)
        runs[str(c)] = dict(summary=summary(report), report=report)
        print(f"serve c={c}: {summary(report)}", flush=True)
    return runs


def log_tail(path: Path) -> list[str]:
    """The last lines of a server's log, kept in the results."""
    return path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]

"""``flashinfra serve --tensor-parallel-size 2 --expert-parallel-size 2`` (CPU gloo ranks) answers greedy
completions exactly as the one-rank server does, and a bad world size stops ``serve`` at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from flashinfra.model.factory import write_tiny_checkpoint
from tests.server.conftest import start_server

PROMPTS = ["The quick brown fox", "Hello, world! How are", "Numbers: 0 1 2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_serve"), seed=2, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])


def _greedy(tmp_path, model_dir, *args) -> list[str]:
    server = start_server(tmp_path, model_dir, "--num-blocks", "64", "--max-num-seqs", "4", *args)
    try:
        out = []
        for prompt in PROMPTS:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out
    finally:
        server.stop()


def test_tp2_ep2_server_greedy_equals_one_rank(tmp_path, model_dir):
    one = _greedy(tmp_path, model_dir)
    assert _greedy(tmp_path, model_dir, "--tensor-parallel-size", "2", "--expert-parallel-size", "2") == one


def test_serve_refuses_a_world_size_that_does_not_divide_heads(model_dir):
    r = subprocess.run([sys.executable, "-m", "flashinfra", "serve", "--model", str(model_dir), "--device", "cpu",
                        "--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "is not divisible by 3" in r.stderr, r.stderr


def _ranks_of(server_pid: int) -> list[int]:
    """Worker ranks started by the server's engine process (children of its children)."""
    def ppid(pid: int) -> int:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])

    out = []
    for entry in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            if entry.isdigit() and b"flashinfra.parallel.engine" in cmd and ppid(ppid(int(entry))) == server_pid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.slow  # the failure itself takes seconds; the server's shutdown after its engine died, a minute
def test_killed_rank_fails_requests_with_a_clear_error(tmp_path, model_dir):
    server = start_server(tmp_path, model_dir, "--num-blocks", "64", "--tensor-parallel-size", "2",
                          "--dist-timeout-s", "20")
    try:
        (rank,) = _ranks_of(server.proc.pid)
        os.kill(rank, signal.SIGKILL)
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert time.monotonic() - start < 30
        assert r.status_code >= 500, r.text
        assert "tensor-parallel worker lost" in r.text and "rank 1" in r.text, r.text
    finally:
        server.stop()

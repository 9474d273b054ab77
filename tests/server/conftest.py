"""Shared fixtures of the server tests: the tiny checkpoint's tokenizer, and a real ``flashinfra serve``
process on loopback (one per test module; killed in teardown)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from flashinfra.model.factory import write_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from flashinfra.server.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A two-layer checkpoint of the tiny architecture (one KDA and one MLA/DSA layer, a dense and an MoE
    MLP, the default tokenizer and chat template): the server tests exercise serving, not depth, and CPU
    time per engine step grows with the layer count."""
    from flashinfra.model.factory import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=0, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metric(self, name: str) -> float | None:
        """One unlabelled sample of /metrics, or None when absent."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else None

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(tmp_path: Path, model_dir: Path | None, *args: str, api_key: str | None = None,
                 timeout: float = 300.0) -> ServerProcess:
    """``flashinfra serve`` in a subprocess on a free loopback port, ready (health 200) when returned.
    ``model_dir=None`` gives no ``--model``: the built-in default model, served as "default"."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    model = ["--model", str(model_dir), "--served-model-name", "tiny"] if model_dir is not None else []
    cmd = [sys.executable, "-m", "flashinfra", "serve", *model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--log-level", "warning", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FLASHINFRA_API_KEY", None)
    if api_key:
        env["FLASHINFRA_API_KEY"] = api_key  # what --api-key defaults to
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()}")
        time.sleep(0.05)

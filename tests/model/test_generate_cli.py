"""``flashinfra generate`` runs end to end on the built-in default model."""

from __future__ import annotations

import subprocess
import sys


def test_generate_on_default_model(tmp_path):
    env = {"FLASHINFRA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "flashinfra", "generate", "--max-tokens", "5", "The capital of France is"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("The capital of France is")
    assert len(first.stdout.strip()) > len("The capital of France is")
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.stdout == first.stdout  # greedy and the default model is deterministic

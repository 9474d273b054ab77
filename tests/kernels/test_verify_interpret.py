"""Runs ``interpret_verify.py`` (the ReplaySSM verify kernel under Triton's CPU interpreter) in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_verify_kernel_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", FLASHINFRA_REFERENCE="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           str(Path(__file__).with_name("interpret_verify.py"))]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]

"""Every Triton kernel under Triton's CPU interpreter: each ``interpret_*.py`` module of this folder runs in its
own subprocess, since ``TRITON_INTERPRET`` must be set before triton is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODULES = sorted(p.name for p in HERE.glob("interpret_*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_kernels_under_triton_interpreter(module):
    env = dict(os.environ, TRITON_INTERPRET="1", FLASHINFRA_REFERENCE="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE / module)]
    r = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_every_interpreter_module_is_found():
    assert {"interpret_kda.py", "interpret_hotpath.py", "interpret_quant.py", "interpret_verify.py",
            "interpret_batch_invariant.py", "interpret_kda_chain.py", "interpret_step_graphs.py"} <= set(MODULES)

"""Every Triton kernel under Triton's CPU interpreter: each ``interpret_*.py`` module of this folder runs in its
own subprocess, since ``TRITON_INTERPRET`` must be set before triton is imported. The interpreter runs a kernel's
programs one after another in one thread, so the selected modules run up to ``PARALLEL`` at a time (one torch thread
each, ``_Runs``), and each test waits for its own module's result."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODULES = sorted(p.name for p in HERE.glob("interpret_*.py"))
PARALLEL = max(1, min(4, os.cpu_count() or 1))
TIMEOUT_S = 900


class _Runs:
    """The interpreter subprocesses of the modules this session selected, in order, ``PARALLEL`` running at once: while
    a test waits for its module, each one that ends makes room for the next."""

    def __init__(self, modules: list[str]):
        self.waiting, self.procs = list(modules), {}

    def _start(self, module: str) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", FLASHINFRA_REFERENCE="0", OMP_NUM_THREADS="1")
        out = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", str(HERE / module)]
        self.procs[module] = (subprocess.Popen(cmd, cwd=HERE.parents[1], env=env, stdout=out, stderr=subprocess.STDOUT,
                                               text=True), out, time.monotonic())

    def _fill(self) -> None:
        while self.waiting and sum(p.poll() is None for p, _, _ in self.procs.values()) < PARALLEL:
            self._start(self.waiting.pop(0))

    def result(self, module: str) -> tuple[int, str]:
        """Wait for ``module``'s subprocess (started now if it is not yet): its exit code and output."""
        if module not in self.procs:
            if module in self.waiting:
                self.waiting.remove(module)
            self._start(module)
        proc, out, start = self.procs.pop(module)
        while proc.poll() is None and time.monotonic() - start < TIMEOUT_S:
            self._fill()
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        self._fill()
        out.seek(0)
        text = out.read()
        out.close()
        return code, text


@pytest.fixture(scope="session")
def runs(request):
    selected = [item.callspec.params["module"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_kernels_under_triton_interpreter"]
    r = _Runs(selected)
    yield r
    for proc, out, _ in r.procs.values():  # started ahead for tests that did not run (-x)
        proc.kill()
        proc.wait()
        out.close()


@pytest.mark.parametrize("module", MODULES)
def test_kernels_under_triton_interpreter(module, runs):
    code, output = runs.result(module)
    assert code == 0, output[-9000:]


def test_every_interpreter_module_is_found():
    assert {"interpret_kda.py", "interpret_hotpath.py", "interpret_quant.py", "interpret_verify.py",
            "interpret_batch_invariant.py", "interpret_kda_chain.py", "interpret_step_graphs.py"} <= set(MODULES)

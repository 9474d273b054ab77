"""Kernel checks where no GPU is: re-run them in a child process under Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when Triton is imported, so a process that has imported it without the
interpreter cannot switch. A check module asks ``kernel_device()`` where its kernels run ("cuda"; "cpu"
when this process already interprets; None otherwise) and, for None, ``run_in_interpreter(module, name)``
runs ``python -m flashinfra.kernels.interpreted MODULE NAME`` with the interpreter on and returns the
child's ``CheckResult``s.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import torch

from flashinfra import env
from flashinfra.feedback.registry import CheckResult, checks, failed
from flashinfra.kernels.dispatch import use_triton

TIMEOUT_S = 600


def kernel_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if use_triton(torch.empty(0)) else None


def run_in_interpreter(module: str, name: str) -> list[CheckResult]:
    cmd = [sys.executable, "-m", "flashinfra.kernels.interpreted", module, name]
    try:
        r = subprocess.run(cmd, env=env.triton_interpreter_environ(), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [failed(name, f"the interpreter run took more than {TIMEOUT_S} s")]
    if r.returncode != 0:
        return [failed(name, f"the interpreter run failed: {r.stderr[-2000:]}")]
    results = [CheckResult.from_dict(d) for d in json.loads(r.stdout.strip().splitlines()[-1])]
    for res in results:
        res.message = (res.message + "; " if res.message else "") + "Triton CPU interpreter"
    return results


def main(argv: list[str]) -> int:
    module, names = argv[0], argv[1:]
    importlib.import_module(module)
    outcome: list[CheckResult] = []
    for name in names:
        res = checks()[name].fn()
        outcome.extend(res if isinstance(res, list) else [res])
    print(json.dumps([r.to_dict() for r in outcome]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

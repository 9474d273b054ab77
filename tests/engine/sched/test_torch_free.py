"""The scheduler half of the engine imports no torch: it must run (and be reasoned about) without a device."""

import pkgutil
import subprocess
import sys

import flashinfra.engine.sched as sched


def test_sched_modules_import_without_torch():
    modules = ["flashinfra.engine.config"] + [f"flashinfra.engine.sched.{m.name}"
                                              for m in pkgutil.iter_modules(sched.__path__)]
    # torch is made unimportable before anything loads; any import of it raises ModuleNotFoundError
    code = "import sys; sys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(modules) >= 6, modules

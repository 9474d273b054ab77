"""A module of this repository as it was at another revision, loaded beside the current one, for the scripts that
time (or compile) a change against the code before it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def revision_module(rev: str, path: str, exported: str | None = None):
    """The module at ``path`` (from the repository root) as it was at ``rev``: from ``git show``, or the file of that
    name in the folder ``exported`` (for a machine without the repository's history). It is written to a real file,
    since ``triton.jit`` reads a kernel's source through ``inspect``, and registered as ``<stem>_before``."""
    if exported:
        text = (Path(exported) / Path(path).name).read_text()
    else:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout
    name = Path(path).stem + "_before"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module

"""The only reader of ``os.environ``.

Every setting that the environment may change is read here, once, into plain values; the rest of the
package receives them as arguments.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated artefacts (the built-in default model, compiled kernels) live."""
    root = os.environ.get("FLASHINFRA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flashinfra"
    )
    return Path(root)


def use_reference_kernels() -> bool:
    """``FLASHINFRA_REFERENCE=1`` forces every op onto its pure-PyTorch reference, even on CUDA."""
    return os.environ.get("FLASHINFRA_REFERENCE", "0") not in ("", "0", "false", "False")


def triton_interpret() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

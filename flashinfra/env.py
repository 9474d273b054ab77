"""The only reader of ``os.environ``.

Every setting that the environment may change is read here, once, into plain values; the rest of the
package receives them as arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def programmatic_launch() -> bool:
    """``FLASHINFRA_PDL=0`` launches every kernel after the one before it has finished (no programmatic dependent
    launch), to compare against; on by default where the GPU has it (``kernels/launch.py``)."""
    return os.environ.get("FLASHINFRA_PDL", "1") not in ("", "0", "false", "False")


def agent_endpoint() -> tuple[str | None, str | None, str | None]:
    """(base URL, model, API key) of the Infra Agent's chat-completions endpoint:
    ``FLASHINFRA_AGENT_BASE_URL`` / ``FLASHINFRA_AGENT_MODEL`` / ``FLASHINFRA_AGENT_API_KEY``, falling back
    to ``OPENAI_BASE_URL`` / ``OPENAI_MODEL`` / ``OPENAI_API_KEY``. Command-line flags take precedence."""
    get = os.environ.get
    return (get("FLASHINFRA_AGENT_BASE_URL") or get("OPENAI_BASE_URL") or None,
            get("FLASHINFRA_AGENT_MODEL") or get("OPENAI_MODEL") or None,
            get("FLASHINFRA_AGENT_API_KEY") or get("OPENAI_API_KEY") or None)


SANDBOX_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "FLASHINFRA_REFERENCE", "TRITON_INTERPRET",
                       "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def sandbox_passthrough() -> dict[str, str]:
    """The only variables the Infra Agent passes on to candidate code (never keys or tokens)."""
    return {k: os.environ[k] for k in SANDBOX_PASSTHROUGH if k in os.environ}


def triton_interpreter_environ() -> dict[str, str]:
    """This process's environment plus ``TRITON_INTERPRET=1``: for a child process that runs Triton kernels
    on the CPU (the variable must be set before Triton compiles anything)."""
    return dict(os.environ, TRITON_INTERPRET="1")


def server_api_key() -> str | None:
    """``FLASHINFRA_API_KEY``: the key ``flashinfra serve`` requires when ``--api-key`` is not given (so the
    key need not appear in the process list)."""
    return os.environ.get("FLASHINFRA_API_KEY") or None


@dataclass(frozen=True)
class TorchrunEnv:
    """The rendezvous a ``torchrun``-style launcher (torchrun, Slurm or Kubernetes wrappers of it) gives a process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> TorchrunEnv | None:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` when a launcher set
    ``RANK`` and ``WORLD_SIZE``; None otherwise (the engine then starts its own ranks)."""
    get = os.environ.get
    if get("RANK") is None or get("WORLD_SIZE") is None:
        return None
    return TorchrunEnv(int(get("RANK")), int(get("WORLD_SIZE")), int(get("LOCAL_RANK", "0")),
                       get("MASTER_ADDR", "127.0.0.1"), int(get("MASTER_PORT", "29500")))

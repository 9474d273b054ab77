"""The one rule deciding whether an op runs its Triton kernel or its reference.

Kernels run on CUDA tensors (or on CPU tensors under ``TRITON_INTERPRET=1``) unless
``FLASHINFRA_REFERENCE=1`` forces the references. A caller that needs one path for a block of code (the
layer-by-layer comparison of the two) says so with ``with kernel_path(enabled):``, which holds for that
thread or task only and is undone on exit.

``with deterministic(True):`` asks every op within the block for its batch-invariant form: reductions in an
order fixed by the op's shapes apart from the token count (one tile configuration, no split chosen by the
batch), so a row's result is the same bits whatever else runs beside it. The engine sets it around each step
when ``EngineConfig.deterministic`` is on; ops read it with ``is_deterministic()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

from flashinfra import env

_kernel_path: contextvars.ContextVar[bool | None] = contextvars.ContextVar("flashinfra_kernel_path", default=None)
_deterministic: contextvars.ContextVar[bool] = contextvars.ContextVar("flashinfra_deterministic", default=False)


@functools.cache
def _reference_forced() -> bool:
    return env.use_reference_kernels()


@functools.cache
def interpreting() -> bool:
    return env.triton_interpret()


@contextlib.contextmanager
def kernel_path(enabled: bool) -> Iterator[None]:
    """Within the block, every op runs its kernel (where the tensors' device runs one) when ``enabled``, else
    its reference, whatever ``FLASHINFRA_REFERENCE`` says."""
    token = _kernel_path.set(bool(enabled))
    try:
        yield
    finally:
        _kernel_path.reset(token)


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Within the block, ops run their batch-invariant forms when ``enabled``."""
    token = _deterministic.set(bool(enabled))
    try:
        yield
    finally:
        _deterministic.reset(token)


def is_deterministic() -> bool:
    return _deterministic.get()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    chosen = _kernel_path.get()
    if chosen is False or (chosen is None and _reference_forced()):
        return False
    return all(t.is_cuda for t in tensors) or interpreting()


def register_cap(maxnreg: int | None) -> dict:
    """A launch's register cap as Triton launch options: ``{"maxnreg": n}``, or none when uncapped or on the CPU
    interpreter (which runs no register allocation)."""
    return {} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}

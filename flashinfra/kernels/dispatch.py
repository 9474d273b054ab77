"""The one rule deciding whether an op runs its Triton kernel or its reference."""

from __future__ import annotations

import functools

import torch

from flashinfra import env


@functools.cache
def _reference_forced() -> bool:
    return env.use_reference_kernels()


@functools.cache
def interpreting() -> bool:
    return env.triton_interpret()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if _reference_forced():
        return False
    return all(t.is_cuda for t in tensors) or interpreting()


def register_cap(maxnreg: int | None) -> dict:
    """A launch's register cap as Triton launch options: ``{"maxnreg": n}``, or none when uncapped or on the CPU
    interpreter (which runs no register allocation)."""
    return {} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}

"""The one rule deciding whether an op runs its Triton kernel or its reference."""

from __future__ import annotations

import functools

import torch

from flashinfra import env


@functools.cache
def _reference_forced() -> bool:
    return env.use_reference_kernels()


@functools.cache
def _unverified_allowed() -> bool:
    return env.unverified_kernels()


@functools.cache
def _interpreting() -> bool:
    return env.triton_interpret()


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if _reference_forced():
        return False
    return all(t.is_cuda for t in tensors) or _interpreting()


def use_unverified_triton(*tensors: torch.Tensor) -> bool:
    """For kernels whose float64 tests have passed under the CPU interpreter but not yet on a GPU (the
    interpreter does not model GPU numerics, e.g. its bf16 matrix products). They run under the
    interpreter, and on CUDA only when ``FLASHINFRA_UNVERIFIED_KERNELS=1``; a GPU run of their tests moves
    their ops to ``use_triton``."""
    if _reference_forced():
        return False
    if _interpreting():
        return True
    return all(t.is_cuda for t in tensors) and _unverified_allowed()

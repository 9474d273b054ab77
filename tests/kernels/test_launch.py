"""``launch.fast`` (flashinfra/kernels/launch.py): a kernel launched through it computes what Triton's own launch
does for every specialisation it meets in turn (a pointer off 16-byte alignment, an integer that is 1, one not
divisible by 16), so a kept compiled kernel is never reused where Triton would have compiled another; and later
launches skip Triton's binding."""

from __future__ import annotations

import contextlib

import pytest
import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import FastKernel, fast


@triton.jit
def _scaled_rows_kernel(x, y, stride_x, N, D, scale, BT: tl.constexpr, BD: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < N)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + o_t[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y + o_t[:, None] * D + o_d[None, :], (b_x * scale).to(y.dtype.element_ty), mask=m)


@contextlib.contextmanager
def _triton_launches(fn):
    """A list that gains an item per launch of ``fn`` through Triton's own ``run`` (its binding) in the block."""
    calls, jit_run = [], fn.run

    def counted(*args, **kwargs):
        calls.append(1)
        return jit_run(*args, **kwargs)

    fn.run = counted
    try:
        yield calls
    finally:
        fn.run = jit_run


def _run(kernel, x: torch.Tensor, D: int, scale: float) -> torch.Tensor:
    N = x.shape[0]
    y = torch.full((N, D), float("nan"), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(N, 16),)](x, y, x.stride(0), N, D, scale, BT=16, BD=triton.next_power_of_2(D))
    return y


def test_arguments_in_the_wrong_place_are_refused():
    kernel = FastKernel(_scaled_rows_kernel)
    with pytest.raises(TypeError, match="by name"):  # a constexpr by position
        kernel.launch((1,), (None,) * 7, {})
    with pytest.raises(TypeError, match="by position"):  # a runtime argument by name
        kernel.launch((1,), (None,) * 5, {"scale": 1.0, "BT": 16, "BD": 16})


def test_non_jit_objects_pass_through():
    marker = object()
    assert fast(marker) is marker
    assert fast(_scaled_rows_kernel) is fast(_scaled_rows_kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_specialisation_matches_the_reference():
    kernel = FastKernel(_scaled_rows_kernel)
    base = torch.randn(70, 48, device="cuda", dtype=torch.bfloat16)
    cases = [  # (rows, row stride's tensor, D): each changes a specialisation of the one before
        (base[:32], 32),  # aligned, N and D multiples of 16
        (base[:32], 32),  # the same: the kept kernel
        (base[1:33, 1:], 32),  # x 2 bytes off alignment, stride 48
        (base[:1], 32),  # N == 1
        (base[:17, :20], 20),  # N, D not multiples of 16
        (base[:32], 32),  # the first again
    ]
    with _triton_launches(_scaled_rows_kernel) as calls:
        for i, (x, D) in enumerate(cases):
            calls.clear()
            y = _run(kernel, x, D, 0.5)
            ref = (x[:, :D].float() * 0.5).to(x.dtype)
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
            assert len(calls) == (0 if i in (1, 5) else 1), i  # Triton binds only a new specialisation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiler_hooks_see_every_launch():
    """A launch hook (as profilers install through Triton's knobs) is called for the kept kernel's launches too."""
    kernel = FastKernel(_scaled_rows_kernel)
    seen = []

    def hook(metadata):  # Triton's LazyDict
        seen.append(metadata.get()["name"] if metadata is not None else None)

    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(hook)
    try:
        x = torch.randn(32, 32, device="cuda")
        for _ in range(3):  # the first through Triton, then the kept kernel
            _run(kernel, x, 32, 2.0)
    finally:
        hooks.remove(hook)
    assert seen == ["_scaled_rows_kernel"] * 3, seen


@triton.jit
def _tile_copy_kernel(x_d, y, BT: tl.constexpr, BD: tl.constexpr):
    """y's [BT, BD] tile i = x's, read through the host descriptor ``x_d``."""
    i = tl.program_id(0)
    b_x = x_d.load([i * BT, 0])
    o_t = i * BT + tl.arange(0, BT)
    tl.store(y + o_t[:, None] * BD + tl.arange(0, BD)[None, :], b_x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_descriptor_first_takes_the_kept_kernel():
    """A kernel whose first runtime argument is a host tensor descriptor (as the prefill's state pass) is launched
    through the kept compiled kernel after its first launch, and copies what it should each time."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = FastKernel(_tile_copy_kernel)
    with _triton_launches(_tile_copy_kernel) as calls:
        for _ in range(3):
            x = torch.randn(64, 32, device="cuda")
            y = torch.full_like(x, float("nan"))
            kernel[(4,)](TensorDescriptor.from_tensor(x, [16, 32]), y, BT=16, BD=32)
            torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert len(calls) == 1  # Triton's own launch once, then the kept kernel


def test_without_pdl_holds_programmatic_launch_off_within_its_block(monkeypatch):
    from flashinfra.kernels import launch

    monkeypatch.setitem(launch._pdl_devices, 7, launch._PDL_ON)  # a device that has it
    assert launch.pdl_options(7) == launch._PDL_ON
    with launch.without_pdl():
        with launch.without_pdl():
            assert launch.pdl_options(7) == {}
        assert launch.pdl_options(7) == {}
    assert launch.pdl_options(7) == launch._PDL_ON

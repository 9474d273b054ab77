"""Checks and benchmarks of the feedback tooling itself: the roofline ceilings (copy bandwidth, matmul) that the
benchmarks' figures are measured against. The kernels' own checks live beside them (``flashinfra.kernels.kda``'s
in kernels/kda/checks.py)."""

from __future__ import annotations

import torch

from flashinfra.feedback import ceilings
from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, register_benchmark, \
    register_check


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@register_check("ceilings", tags=("feedback",))
def check_ceilings() -> list[CheckResult]:
    """The ops that ``bench ceilings`` times compute what their byte and FLOP counts assume."""
    src = torch.randn(1000, 37, device=_device())
    dst = torch.full_like(src, float("nan"))
    dst.copy_(src)
    a, b = torch.randn(63, 130, device=_device()), torch.randn(130, 17, device=_device())
    return [compare("ceilings.copy", dst, src.double(), atol=0, rtol=0),
            compare("ceilings.matmul", torch.mm(a, b), a.double() @ b.double(), atol=1e-4, rtol=1e-4)]


@register_benchmark("ceilings.copy", tags=("feedback", "roofline"))
def bench_copy(ctx: BenchContext) -> BenchSpec:
    """The copy ``bench ceilings`` measures: its fraction of the copy ceiling should come out near 1."""
    n = ceilings.copy_numel(ctx.device, ctx.quick)
    dst = torch.empty(n, device=ctx.device)

    def make_inputs(seed: int):
        return dst, torch.randn(n, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(seed))

    return BenchSpec(fn=lambda d, s: d.copy_(s), make_inputs=make_inputs, bytes=2 * n * 4,
                     check=lambda inputs, out: compare("ceilings.copy", out, inputs[1], atol=0, rtol=0),
                     params={"numel": n}, description="float32 device copy")


@register_benchmark("ceilings.matmul", tags=("feedback", "roofline"))
def bench_matmul(ctx: BenchContext) -> BenchSpec:
    n = ceilings.matmul_size(ctx.device, ctx.quick)
    dtype = ctx.torch_dtype() if ctx.device.startswith("cuda") else torch.float32

    def make_inputs(seed: int):
        gen = torch.Generator(ctx.device).manual_seed(seed)
        return (torch.randn(n, n, device=ctx.device, generator=gen).to(dtype),
                torch.randn(n, n, device=ctx.device, generator=gen).to(dtype))

    def check(inputs, out):
        rows = slice(0, 7)  # a float64 product of the full matrices would dominate the run
        ref = inputs[0][rows].double() @ inputs[1].double()
        return compare("ceilings.matmul", out[rows], ref, dtype=dtype,
                       atol=1e-2 * n**0.5, rtol=1e-2 if dtype != torch.float32 else 1e-4)

    return BenchSpec(fn=torch.mm, make_inputs=make_inputs, flops=2 * n**3, bytes=3 * n * n * dtype.itemsize,
                     check=check, params={"n": n, "dtype": str(dtype)}, description="square matmul")

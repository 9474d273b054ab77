"""The batch-invariant GEMM on a CUDA device at GLM-5.3-Flash widths: bf16 and float32 against float64, and each
row the same bits whatever M is (where cuBLAS's rows change with M), and the deterministic MoE likewise."""

import pytest
import torch

from flashinfra.kernels.batch_invariant import linear
from flashinfra.kernels.dispatch import deterministic
from flashinfra.kernels.fused_moe import fused_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K", [(1, 6144, 4096), (300, 4096, 1536), (1000, 513, 4096)])
def test_linear_against_float64(M, N, K, dtype):
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).to(dtype)
    with deterministic(True):
        y = linear(x, w)
    ref = x.double() @ w.double().t()
    scale = (x.double().abs() @ w.double().abs().t()).amax(1, keepdim=True)
    err = float(((y.double() - ref).abs() / scale).max())
    # one rounding to the output dtype, plus the float32 accumulation of K products, a random walk of roundings
    # (float32 in K order: up to ~3 eps32 at these sizes, past 2 eps alone); tf32 products would land 4-10x above
    assert err <= 2 * torch.finfo(dtype).eps + torch.finfo(torch.float32).eps * K**0.5, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_same_bits_whatever_m(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 4096, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(2048, 4096, device="cuda", generator=gen) * 0.02).to(dtype)
    with deterministic(True):
        full = linear(x, w)
        for lo, hi in [(0, 1), (5, 6), (0, 7), (100, 229), (999, 1000), (0, 512)]:
            assert torch.equal(linear(x[lo:hi], w), full[lo:hi]), (lo, hi)


def test_moe_rows_same_bits_whatever_t():
    gen = torch.Generator(device="cuda").manual_seed(1)
    T, E, D, I, k = 300, 64, 1024, 256, 8
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    s13 = (torch.randn(2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    s2 = (torch.randn(D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, device="cuda", generator=gen)
    with deterministic(True):
        full = fused_moe(x, w13, w2, wts, ids, 10.0, s13, s2)
        for lo, hi in [(0, 1), (7, 8), (0, 33), (100, 300)]:
            assert torch.equal(fused_moe(x[lo:hi], w13, w2, wts[lo:hi], ids[lo:hi], 10.0, s13, s2), full[lo:hi])

"""The batch-invariant GEMM on a CUDA device at GLM-5.3-Flash widths: bf16 and float32 against float64, and each
row the same bits whatever M is (where cuBLAS's rows change with M), and the deterministic MoE likewise. The
widths include the slice's split weights (``split_plan`` S > 1), whose splits run in programs of their own for a
batch of up to one row tile and in one program above, so the row comparisons cross the two paths."""

import pytest
import torch

from flashinfra.kernels import batch_invariant
from flashinfra.kernels.batch_invariant import TILES, linear, matmul_nt, matmul_nt_launch, split_plan, spread
from flashinfra.kernels.dispatch import deterministic
from flashinfra.kernels.fused_moe import fused_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# (M, N, K): unsplit (the vocabulary head's width), split in programs of their own (M <= BM) and in one program;
# K=1800 ends its last split with steps past K
LINEAR_SHAPES = [(1, 6144, 4096), (300, 4096, 1536), (1000, 513, 4096), (1, 4096, 8192), (128, 2048, 4096),
                 (129, 2048, 4096), (17, 4096, 1800), (5, 16384, 1536), (3, 65536, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K", LINEAR_SHAPES)
def test_linear_against_float64(M, N, K, dtype, monkeypatch):
    monkeypatch.setattr(batch_invariant, "_workspace", lambda S, Bt, m, n, device: torch.full(
        (S, Bt, m, n), float("nan"), dtype=torch.float32, device=device))
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).to(dtype)
    bias = torch.randn(N, device="cuda", generator=gen).to(dtype) * 0.1
    y = matmul_nt_launch(x[None], w[None], bias, out=torch.full((1, M, N), float("nan"), dtype=dtype,
                                                                 device="cuda"))[0]
    with deterministic(True):
        assert torch.equal(linear(x, w, bias), y)
    ref = x.double() @ w.double().t() + bias.double()
    scale = (x.double().abs() @ w.double().abs().t()).amax(1, keepdim=True)
    err = float(((y.double() - ref).abs() / scale).max())
    # one rounding to the output dtype, plus the float32 accumulation of K products, a random walk of roundings
    # (float32 in K order: up to ~3 eps32 at these sizes, past 2 eps alone); tf32 products would land 4-10x above
    assert err <= 2 * torch.finfo(dtype).eps + torch.finfo(torch.float32).eps * K**0.5, err


# the slice's dense weights [N, K] (q/k/v in-projection, KDA and MLA output, MLA q_a/kv_a and q_b, indexer q_b and
# its x projection, the shared expert's gate/up and down) and one width that is not a multiple of the tile
ROW_WEIGHTS = [(24832, 4096), (4096, 8192), (4096, 16384), (2048, 4096), (16384, 1536), (4096, 1536), (288, 4096),
               (4096, 4096), (4096, 2048), (1000, 1800)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K", ROW_WEIGHTS)
def test_rows_same_bits_whatever_m(N, K, dtype):
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(1000, K, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).to(dtype)
    size = x.element_size()
    S, BM = split_plan(1, N, K, size)[0], TILES[size][0]
    with deterministic(True):
        full = linear(x, w)
        for lo, hi in [(0, 1), (5, 6), (0, 3), (0, 7), (40, 57), (3, 67), (0, BM), (0, BM + 1), (100, 229),
                       (999, 1000), (0, 512)]:
            assert torch.equal(linear(x[lo:hi], w), full[lo:hi]), (lo, hi, S, spread(hi - lo, S, size))


def test_head_products_rows_same_bits_whatever_m():
    # the MLA absorb products: 64 heads, [T, 256] x [512, 256]^T and [T, 512] x [256, 512]^T (the latter split)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for N, K in [(512, 256), (256, 512)]:
        a = torch.randn(64, 700, K, device="cuda", generator=gen).bfloat16()
        b = (torch.randn(64, N, K, device="cuda", generator=gen) * K**-0.5).bfloat16()
        with deterministic(True):
            full = matmul_nt(a, b)
            for lo, hi in [(0, 1), (9, 10), (0, 17), (3, 131), (600, 700)]:
                assert torch.equal(matmul_nt(a[:, lo:hi], b), full[:, lo:hi]), (N, K, lo, hi)


def test_moe_rows_same_bits_whatever_t():
    gen = torch.Generator(device="cuda").manual_seed(1)
    T, E, D, I, k = 1200, 64, 1024, 256, 8  # 150 pairs an expert: the wide tile; the slices below the narrow one
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    w2 = (torch.randn(E, D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    s13 = (torch.randn(2 * I, D, device="cuda", generator=gen) * D**-0.5).bfloat16()
    s2 = (torch.randn(D, I, device="cuda", generator=gen) * I**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, device="cuda", generator=gen)
    with deterministic(True):
        full = fused_moe(x, w13, w2, wts, ids, 10.0, s13, s2)
        for lo, hi in [(0, 1), (7, 8), (0, 33), (100, 300), (0, 700), (500, 1200)]:
            assert torch.equal(fused_moe(x[lo:hi], w13, w2, wts[lo:hi], ids[lo:hi], 10.0, s13, s2), full[lo:hi])

"""The batch-invariant GEMM and deterministic mode under Triton's CPU interpreter: the GEMM against float64 at
small, odd sizes with its output poisoned before the run, and its rows the same bits whatever M is, with and
without a split reduction (the splits in programs of their own for a small M, in one program for a large one; the
split workspace poisoned too). The interpreter's bf16 products are not exact: bf16 runs live in the GPU tests.
Collected only through ``test_interpret.py``, which runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

import pytest
import torch

from flashinfra.kernels import batch_invariant
from flashinfra.kernels.batch_invariant import (MAX_SPLITS, TILES, linear, matmul_nt, matmul_nt_launch, split_plan,
                                                spread)
from flashinfra.kernels.dispatch import deterministic


def _tol(dtype: torch.dtype, K: int) -> float:
    # a sum of K products, each input rounded once to the dtype: error grows like sqrt(K) eps of the row's scale
    return 4 * torch.finfo(dtype).eps * K**0.5


@pytest.mark.parametrize("Bt,M,N,K,bias,dtype", [(1, 1, 45, 100, True, torch.float32),
                                                 (3, 37, 20, 63, False, torch.float32),
                                                 (1, 70, 33, 129, True, torch.float32)])
def test_matmul_against_float64(Bt, M, N, K, bias, dtype):
    gen = torch.Generator().manual_seed(M + N + K)
    a = torch.randn(Bt, K, M, generator=gen).to(dtype).transpose(1, 2)  # strided operands, as the MLA heads pass
    b = torch.randn(Bt, N, K, generator=gen).to(dtype)
    bb = torch.randn(N, generator=gen).to(dtype) if bias else None
    out = torch.full((Bt, M, N), float("nan"), dtype=dtype)
    got = matmul_nt_launch(a, b, bb, out=out)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    ref = a.double() @ b.double().transpose(1, 2) + (bb.double() if bias else 0)
    scale = (a.double().abs() @ b.double().abs().transpose(1, 2)).amax()
    err = float((got.double() - ref).abs().max() / scale)
    assert err <= _tol(dtype, K) + torch.finfo(dtype).eps, err


@pytest.mark.parametrize("dtype", [torch.float32])
def test_rows_are_the_same_bits_whatever_m(dtype):
    gen = torch.Generator().manual_seed(5)
    BM = TILES[torch.tensor([], dtype=dtype).element_size()][0]
    M, N, K = 2 * BM + 3, 50, 97
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)
    with deterministic(True):
        full = linear(x, w)
        for lo, hi in [(0, 1), (M - 1, M), (BM - 2, BM + 3), (7, 7 + BM)]:
            part = linear(x[lo:hi], w)
            assert torch.equal(part, full[lo:hi]), (lo, hi)
        heads = matmul_nt(x.view(1, M, K).expand(2, M, K), w.view(1, N, K).expand(2, N, K))
        assert torch.equal(heads[1], full) and torch.equal(matmul_nt(x[None, 3:4], w[None])[0], full[3:4])



def _nan_workspace(monkeypatch):
    """Every split workspace the launches allocate starts as NaN, so a partial sum read before it is written
    shows."""
    made = []

    def poisoned(S, Bt, M, N, device):
        made.append(torch.full((S, Bt, M, N), float("nan"), dtype=torch.float32, device=device))
        return made[-1]

    monkeypatch.setattr(batch_invariant, "_workspace", poisoned)
    return made


# weights whose reduction is split (fp32 tile: BN = BK = 32): K=1001 in 8 splits of 4 steps, the last step partial;
# K=900 in 4 splits of 8 steps, the last split ending in 3 steps past K
SPLIT_SHAPES = [(1, 45, 1001), (1, 45, 900), (3, 20, 700)]


@pytest.mark.parametrize("Bt,N,K", SPLIT_SHAPES)
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_split_rows_are_the_same_bits_as_in_a_larger_batch(Bt, N, K, M, monkeypatch):
    size = torch.tensor([], dtype=torch.float32).element_size()
    S, CH = split_plan(Bt, N, K, size)
    assert S > 1 and (S - 1) * CH * TILES[size][2] < K <= S * CH * TILES[size][2]
    big = 200
    assert spread(M, S, size) == (M <= TILES[size][0]) and not spread(big, S, size)
    made = _nan_workspace(monkeypatch)
    gen = torch.Generator().manual_seed(M * 1000 + K)
    a = torch.randn(Bt, big, K, generator=gen)
    b = torch.randn(Bt, N, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    full = matmul_nt_launch(a, b, bias, out=torch.full((Bt, big, N), float("nan")))
    assert not made
    for lo in (0, 5, big - M):
        part = matmul_nt_launch(a[:, lo:lo + M], b, bias, out=torch.full((Bt, M, N), float("nan")))
        assert torch.equal(part, full[:, lo:lo + M]), (lo, M)
    assert len(made) == (3 if M <= TILES[size][0] else 0)
    ref = a.double() @ b.double().transpose(1, 2) + bias.double()
    scale = (a.double().abs() @ b.double().abs().transpose(1, 2)).amax()
    err = float((full.double() - ref).abs().max() / scale)
    assert err <= _tol(torch.float32, K) + torch.finfo(torch.float32).eps, err


@pytest.mark.parametrize("M,N,K,bias", [(1, 45, 1001, True), (17, 33, 777, False), (70, 45, 900, True)])
def test_split_against_float64(M, N, K, bias, monkeypatch):
    made = _nan_workspace(monkeypatch)
    gen = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen)
    bb = torch.randn(N, generator=gen) if bias else None
    S, _ = split_plan(1, N, K, x.element_size())
    assert S > 1
    with deterministic(True):
        y = linear(x, w, bb)
    assert not y.isnan().any() and len(made) == spread(M, S, x.element_size())
    ref = x.double() @ w.double().t() + (bb.double() if bias else 0)
    scale = (x.double().abs() @ w.double().abs().t()).amax()
    assert float((y.double() - ref).abs().max() / scale) <= _tol(torch.float32, K) + torch.finfo(torch.float32).eps


def test_split_plan_covers_k_with_non_empty_splits():
    for Bt, N, K in [(1, 4096, 8192), (1, 2048, 4096), (64, 256, 512), (1, 154880, 4096), (1, 24832, 4096)]:
        S, CH = split_plan(Bt, N, K, 2)
        assert 1 <= S <= MAX_SPLITS and (S - 1) * CH < -(-K // TILES[2][2]) <= S * CH
    assert split_plan(1, 154880, 4096, 2)[0] == 1 and split_plan(1, 4096, 8192, 2)[0] > 1

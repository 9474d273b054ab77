"""The batch-invariant GEMM and deterministic mode under Triton's CPU interpreter: the GEMM against float64 at
small, odd sizes with its output poisoned before the run, and its rows the same bits whatever M is (the
interpreter's bf16 products are not exact: bf16 runs live in the GPU tests). Collected only through
``test_interpret.py``, which runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

import pytest
import torch

from flashinfra.kernels.batch_invariant import TILES, linear, matmul_nt, matmul_nt_launch
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


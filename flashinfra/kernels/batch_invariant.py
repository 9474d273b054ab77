"""Dense products (``linear``, ``matmul_nt``) whose rows do not depend on the batch, for deterministic mode.

cuBLAS chooses its algorithm (tile shape, split-K, stream-K) by the problem's shape, so the same row of
``x @ w^T`` can round differently when ``x`` has 1 row or 300: a token's output depends on what else is in
the batch. ``bi_matmul_kernel`` computes every output tile with one fixed configuration per dtype (``TILES``)
and no split of the reduction: output ``[m, n]`` is the sum over ``k`` in ``BK``-wide steps from 0 to ``K``,
each step one ``tl.dot`` into a float32 accumulator, whatever ``M`` is. Rows beyond ``M`` in the last tile
are masked loads of zero and never change another row's products, so row ``m`` is the same bits alone or
inside any larger ``M``.

Outside ``dispatch.deterministic`` (or off the kernel path) the ops are ``F.linear`` / ``torch.matmul``,
the default path's speed. Float32 inputs use ``input_precision="ieee"`` (no tf32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import fast

# one tile per operand width, never chosen by M: (BM, BN, BK, num_warps, num_stages)
TILES = {2: (64, 64, 64, 4, 3), 4: (32, 32, 32, 4, 2)}


@triton.jit
def bi_matmul_kernel(a, b, bias, c, M, N, K, stride_ab, stride_am, stride_ak, stride_bb, stride_bn, stride_bk,
                     stride_cb, stride_cm, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, IEEE: tl.constexpr):
    """c[i_b] [M, N] = a[i_b] [M, K] @ b[i_b] [N, K]^T (+ bias [N]), one program per (BM, BN) tile."""
    i_m, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_a = a + i_b.to(tl.int64) * stride_ab + o_m[:, None].to(tl.int64) * stride_am
    p_b = b + i_b.to(tl.int64) * stride_bb + o_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_a = tl.load(p_a + o_k[None, :] * stride_ak, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b + o_k[:, None] * stride_bk, mask=m_k[:, None] & m_n[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(b_a, b_b, input_precision="ieee")
        else:
            acc += tl.dot(b_a, b_b)
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    p_c = c + i_b.to(tl.int64) * stride_cb + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :]
    tl.store(p_c, acc.to(c.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def matmul_nt_launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, N, K]^T (+ bias [N]) -> [Bt, M, N] in a's dtype (into ``out`` when given, rows of
    unit stride), any input strides."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"matmul_nt: a {tuple(a.shape)} and b {tuple(b.shape)} are not [Bt, M, K] and [Bt, N, K]")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul_nt: a is {a.dtype} but b is {b.dtype}")
    if a.element_size() not in TILES:
        raise ValueError(f"matmul_nt: no tile for {a.dtype}")
    Bt, M, K = a.shape
    N = b.shape[1]
    c = torch.empty(Bt, M, N, dtype=a.dtype, device=a.device) if out is None else out
    if c.shape != (Bt, M, N) or c.dtype != a.dtype or (c.numel() and c.stride(2) != 1):
        raise ValueError(f"matmul_nt: out must be [{Bt}, {M}, {N}] {a.dtype} with unit column stride")
    if c.numel() == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.to(c.dtype).expand_as(c))
    BM, BN, BK, warps, stages = TILES[a.element_size()]
    fast(bi_matmul_kernel)[(triton.cdiv(M, BM), triton.cdiv(N, BN), Bt)](
        a, b, c if bias is None else bias, c, M, N, K, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1),
        b.stride(2), c.stride(0), c.stride(1), HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK,
        IEEE=a.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return c


def linear_launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through ``bi_matmul_kernel``: x [..., K], w [N, K] -> [..., N]."""
    lead = x.shape[:-1]
    out = matmul_nt_launch(x.reshape(1, -1, x.shape[-1]), w.unsqueeze(0), bias)
    return out.view(*lead, w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; in deterministic mode on the kernel path, the batch-invariant GEMM."""
    if is_deterministic() and use_triton(x, w):
        return linear_launch(x, w, bias)
    return F.linear(x, w, bias)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, N, K]^T -> [Bt, M, N]; in deterministic mode on the kernel path, the batch-invariant
    GEMM (per-head products: a batch of ``Bt`` independent GEMMs)."""
    if is_deterministic() and use_triton(a, b):
        return matmul_nt_launch(a, b)
    return torch.matmul(a, b.transpose(1, 2))

"""Dense products (``linear``, ``matmul_nt``) whose rows do not depend on the batch, for deterministic mode.

cuBLAS chooses its algorithm (tile shape, split-K, stream-K) by the problem's shape, so the same row of
``x @ w^T`` can round differently when ``x`` has 1 row or 300: a token's output depends on what else is in
the batch. ``bi_matmul_kernel`` computes every output tile with one fixed configuration per dtype (``TILES``)
and a split of the reduction that depends on the weight alone (``split_plan``: its ``Bt``, ``N`` and ``K``, never
``M``). Output ``[m, n]`` is, for every ``M``:

    part_s = sum over the BK-wide steps of split s (steps s*CH .. s*CH+CH-1), each one ``tl.dot`` into a float32
             accumulator that starts at zero
    total  = ((0 + part_0) + part_1) + ... + part_{S-1}, then + bias, then one rounding to the output dtype

Rows beyond ``M`` in the last tile are masked loads of zero and never change another row's products, so row ``m``
is the same bits alone or inside any larger ``M``.

Only weights too narrow to keep the GPU's memory busy at M=1 are split. Where the splits run is a matter of speed
alone, chosen by ``M`` (``spread``): a batch of at most one row tile gives each split its own program, which
writes ``part_s`` to a float32 workspace ``[S, Bt, M, N]`` that ``bi_split_sum_kernel`` then adds in split order;
a larger one runs a tile's splits one after the other in one program (one flattened, pipelined loop). Both paths
run the same tile, the same ``tl.dot`` steps and the same float32 additions in the same order, so they give the
same bits; the tile itself is never chosen by ``M``.

Outside ``dispatch.deterministic`` (or off the kernel path) the ops are ``F.linear`` / ``torch.matmul``,
the default path's speed. Float32 inputs use ``input_precision="ieee"`` (no tf32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import cdiv, fast

# one tile per operand width, never chosen by M: (BM, BN, BK, num_warps, num_stages)
TILES = {2: (128, 128, 64, 8, 3), 4: (32, 32, 32, 4, 2)}
# the split rule's aim in (tile, split) programs per weight: two per SM of a 132-SM H100. A constant, not the
# device's SM count, so that the split, and with it every output's bits, is the same on every device
SPLIT_PROGRAMS = 264
MIN_SPLIT_STEPS = 4  # BK-wide steps per split at least
MAX_SPLITS = 16
SUM_BN = 512  # columns per program of the split sum


@triton.jit
def _split_part(p_a, p_b, m_m, m_n, K, i_s, CH, stride_ak, stride_bk, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, IEEE: tl.constexpr):
    """part_s [BM, BN]: the CH BK-wide steps of split ``i_s``, each one ``tl.dot`` into a float32 accumulator that
    starts at zero. Steps past K (the last split's tail) load zeros and add exact zeros."""
    part = tl.zeros([BM, BN], dtype=tl.float32)
    for j in range(0, CH):
        o_k = (i_s * CH + j) * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_a = tl.load(p_a + o_k[None, :] * stride_ak, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b + o_k[:, None] * stride_bk, mask=m_k[:, None] & m_n[None, :], other=0.0)
        if IEEE:
            part = tl.dot(b_a, b_b, part, input_precision="ieee")
        else:
            part = tl.dot(b_a, b_b, part)
    return part


@triton.jit
def bi_matmul_kernel(a, b, bias, c, ws, M, N, K, S, CH, stride_ab, stride_am, stride_ak, stride_bb, stride_bn,
                     stride_bk, stride_cb, stride_cm, HAS_BIAS: tl.constexpr, SPREAD: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """c[i_b] [M, N] = a[i_b] [M, K] @ b[i_b] [N, K]^T (+ bias [N]) as ``S`` splits of ``CH`` BK-wide steps.
    ``SPREAD``: one program per (BM, BN) tile and split, writing the split's float32 sum to ws [S, Bt, M, N];
    else one program per tile, adding its splits in order."""
    i_m, i_n, i_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b = i_z // S if SPREAD else i_z
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_a = a + i_b.to(tl.int64) * stride_ab + o_m[:, None].to(tl.int64) * stride_am
    p_b = b + i_b.to(tl.int64) * stride_bb + o_n[None, :].to(tl.int64) * stride_bn
    if SPREAD:
        i_s = i_z % S
        part = _split_part(p_a, p_b, m_m, m_n, K, i_s, CH, stride_ak, stride_bk, BM, BN, BK, IEEE)
        # ws[i_s, i_b]; Bt = programs / S
        p_w = ws + ((i_s * (tl.num_programs(2) // S) + i_b).to(tl.int64) * M + o_m[:, None]) * N + o_n[None, :]
        tl.store(p_w, part, mask=m_m[:, None] & m_n[None, :])
    else:
        total = tl.zeros([BM, BN], dtype=tl.float32)
        # the step loop's bounds do not depend on the split, so the compiler flattens the two loops into one
        # pipelined loop
        for i_s in tl.range(0, S, flatten=True):
            total += _split_part(p_a, p_b, m_m, m_n, K, i_s, CH, stride_ak, stride_bk, BM, BN, BK, IEEE)
        if HAS_BIAS:
            total += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        p_c = c + i_b.to(tl.int64) * stride_cb + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :]
        tl.store(p_c, total.to(c.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def bi_split_sum_kernel(ws, bias, c, M, N, S, stride_cb, stride_cm, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
    """c[i_b, i_m] [N] = ((0 + ws[0, i_b, i_m]) + ws[1, i_b, i_m]) + ... + ws[S-1, i_b, i_m] (+ bias), rounded once:
    the splits of ``bi_matmul_kernel`` added in the order its one-program path adds them."""
    i_m, i_n, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    split = tl.num_programs(2).to(tl.int64) * M * N  # elements per split: [Bt, M, N]
    p_w = ws + (i_b.to(tl.int64) * M + i_m) * N + o_n
    total = tl.zeros([BN], dtype=tl.float32)
    for i_s in range(0, S):
        total += tl.load(p_w + i_s * split, mask=m_n, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    p_c = c + i_b.to(tl.int64) * stride_cb + i_m.to(tl.int64) * stride_cm + o_n
    tl.store(p_c, total.to(c.dtype.element_ty), mask=m_n)


def split_plan(Bt: int, N: int, K: int, element_size: int) -> tuple[int, int]:
    """(splits S, BK-wide steps per split CH) of the reduction for a weight [Bt, N, K]: a property of the weight's
    shape and the tile, never of M, so every row's sum is the same whatever the batch. A weight of at least
    ``SPLIT_PROGRAMS / 2`` tiles is not split (at M=1 its tiles alone keep enough loads in flight to stream it);
    a narrower one is split towards ``SPLIT_PROGRAMS`` (tile, split) pairs, in a power of two of splits of at
    least ``MIN_SPLIT_STEPS`` steps, at most ``MAX_SPLITS``. Every split is non-empty."""
    _, BN, BK, _, _ = TILES[element_size]
    steps, tiles = cdiv(K, BK), Bt * cdiv(N, BN)
    if 2 * tiles >= SPLIT_PROGRAMS:
        return 1, steps
    S = max(1, min(cdiv(SPLIT_PROGRAMS, tiles), steps // MIN_SPLIT_STEPS, MAX_SPLITS))
    S = 1 << (S.bit_length() - 1)  # a power of two divides the step count of the usual K (multiples of 512)
    CH = cdiv(steps, S)
    return cdiv(steps, CH), CH


def spread(M: int, S: int, element_size: int) -> bool:
    """Whether the splits run as programs of their own: the reduction is split and the batch fits one row tile
    (so the workspace holds at most S x BM rows). A choice of speed alone: both paths give the same bits."""
    return S > 1 and M <= TILES[element_size][0]


def _workspace(S: int, Bt: int, M: int, N: int, device: torch.device) -> torch.Tensor:
    return torch.empty(S, Bt, M, N, dtype=torch.float32, device=device)


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
    size = a.element_size()
    BM, BN, BK, warps, stages = TILES[size]
    S, CH = split_plan(Bt, N, K, size)
    ws = _workspace(S, Bt, M, N, a.device) if spread(M, S, size) else None
    fast(bi_matmul_kernel)[(cdiv(M, BM), cdiv(N, BN), Bt * (S if ws is not None else 1))](
        a, b, c if bias is None else bias, c, c if ws is None else ws, M, N, K, S, CH, a.stride(0), a.stride(1),
        a.stride(2), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), HAS_BIAS=bias is not None,
        SPREAD=ws is not None, BM=BM, BN=BN, BK=BK, IEEE=a.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
    if ws is not None:
        fast(bi_split_sum_kernel)[(M, cdiv(N, SUM_BN), Bt)](
            ws, c if bias is None else bias, c, M, N, S, c.stride(0), c.stride(1), HAS_BIAS=bias is not None,
            BN=SUM_BN, num_warps=4)
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

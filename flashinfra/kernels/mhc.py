"""mHC (hyper-connection) ops: weights + Sinkhorn + collapse (``hc_pre``); the expand is ``mhc_expand.py``.

``hc_pre``: streams ``[T, n, D]`` -> the block input ``sum_i pre_i * stream_i`` ``[T, D]`` plus the
``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` weights (float32). The weights come from one projection of
the RMS-normalised flattened streams: since the norm is a scalar per token, ``mix = rstd * (x @ fn^T)``,
so one pass over ``x`` accumulates the sum of squares and the ``(2 + n) n`` dot products together.
``hc_pre_norm``: ``hc_pre`` and then the block's input RMSNorm of the collapsed rows (with W8A8 projections, its
int8 codes), as ``norms.rms_norm`` / ``norm_act.rms_norm_int8`` compute it: in the collapse's kernel where a
program holds its tokens' whole rows (a decode step's token), one launch less a block. ``hc_embed`` makes the first
layer's streams from the embedding, ``hc_collapse_norm`` the final hidden states from the last layer's.

Triton path: ``hc_mix_kernel`` (split over the ``n D`` axis so that a decode step of a few tokens still
fills the chip) writes partial dot products and sums of squares, unless the expand that made the streams formed
them already (``HANDED_OVER``); ``hc_pre_kernel`` (``BT`` tokens per program, and for a decode batch's few tokens
a slice of the width each) adds the partials, applies sigmoid / softmax / Sinkhorn on the ``n x n`` matrices in
registers and collapses the streams (for a decode step's single token, whose streams it loads before the weights'
math so that the load's latency overlaps it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.norms import rms_norm, rms_norm_rows, unweighted_rms_norm_ref
from flashinfra.kernels.quant.act import int8_rows
from flashinfra.kernels.quant.norm_act import rms_norm_int8


def hc_weights_ref(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    """streams [T, n, D] -> (pre [T, n], post [T, n], comb [T, n, n]), all float32."""
    flat = unweighted_rms_norm_ref(streams.flatten(1).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre_ref(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    """-> (collapsed [T, D] in the streams' dtype, post [T, n], comb [T, n, n])."""
    pre, post, comb = hc_weights_ref(streams, fn, base, scale, n, iters, eps, norm_eps)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype), post, comb


@triton.jit
def hc_mix_kernel(x, fn, part, sumsq, T, K, KS, NM: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_n = tl.arange(0, BN)
    m_t, m_n = o_t < T, o_n < NM
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(i_s * KS, tl.minimum(i_s * KS + KS, K), BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(x + o_t[:, None].to(tl.int64) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(fn + o_n[None, :] * K + o_k[:, None], mask=m_n[None, :] & m_k[:, None], other=0.0)
        xf = b_x.to(tl.float32)
        ss += tl.sum(xf * xf, 1)
        if IEEE:
            acc += tl.dot(xf, b_w.to(tl.float32), input_precision="ieee")
        else:  # the rows' operand from registers, not from the tile's shared-memory buffer: read there both by the
            # sum of squares and by an asynchronous MMA, Triton's pipeliner (3.6 to 3.9) gives that buffer one slot
            # too few and the copy two steps ahead overwrites it under the MMA (``tests/kernels/test_pipelines.py``;
            # rounding toward zero, exact here, keeps the compiler from folding the conversion back into the load)
            acc += tl.dot(xf.to(b_x.dtype, fp_downcast_rounding="rtz"), b_w.to(b_x.dtype))
    base = (i_s * T + o_t)
    tl.store(part + base[:, None] * BN + o_n[None, :], acc, mask=m_t[:, None])
    tl.store(sumsq + base, ss, mask=m_t)


@triton.jit(do_not_specialize=["T", "SPLIT", "iters", "width"])  # the step's token count: one compilation for all
def hc_pre_kernel(x, part, sumsq, base, scale, y, post, comb, T, D, SPLIT, iters, eps, norm_eps, width,
                  w_norm, q, s, rms_eps, N: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                  SP: tl.constexpr, WHOLE: tl.constexpr, NORM: tl.constexpr = False, CODES: tl.constexpr = False,
                  STORE_Y: tl.constexpr = True, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_i = tl.arange(0, N)
    o_ij = o_i[:, None] * N + o_i[None, :]
    rows = o_t.to(tl.int64) * N * D
    if WHOLE:  # the tokens' whole streams in one tile, asked for first: their loads overlap the weights' math
        o_d = tl.arange(0, BD)
        m_x = m_t[:, None, None] & (o_d < D)[None, None, :]
        b_xw = tl.load(x + rows[:, None, None] + o_i[None, :, None] * D + o_d[None, None, :], mask=m_x, other=0.0)
        if NORM:
            b_wn = tl.load(w_norm + o_d, mask=o_d < D, other=0.0)
    # the split partials of all tokens in one load each, summed over the split axis (a loop over the
    # splits would add up their load latencies)
    o_s = tl.arange(0, SP)
    p = part + (o_s[:, None] * T + o_t[None, :]) * BN  # [SP, BT]
    m_2 = (o_s < SPLIT)[:, None] & m_t[None, :]
    m_st = m_2[:, :, None]
    w_pre = tl.sum(tl.load(p[:, :, None] + o_i[None, None, :], mask=m_st, other=0.0), 0)  # [BT, N]
    w_post = tl.sum(tl.load(p[:, :, None] + N + o_i[None, None, :], mask=m_st, other=0.0), 0)
    o_nn = tl.arange(0, N * N)
    w_comb = tl.reshape(tl.sum(tl.load(p[:, :, None] + 2 * N + o_nn[None, None, :], mask=m_st, other=0.0), 0),
                        [BT, N, N])
    ss = tl.sum(tl.load(sumsq + o_s[:, None] * T + o_t[None, :], mask=m_2, other=0.0), 0)
    rstd = tl.rsqrt(ss / (N * D) + norm_eps)
    s_pre, s_post, s_comb = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)
    pre = tl.sigmoid(w_pre * rstd[:, None] * s_pre + tl.load(base + o_i)[None, :]) + eps
    pst = 2 * tl.sigmoid(w_post * rstd[:, None] * s_post + tl.load(base + N + o_i)[None, :])
    c = w_comb * rstd[:, None, None] * s_comb + tl.load(base + 2 * N + o_ij)[None, :, :]
    c = tl.exp(c - tl.max(c, 2)[:, :, None])
    c = c / tl.sum(c, 2)[:, :, None] + eps
    c = c / (tl.sum(c, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + eps)
        c = c / (tl.sum(c, 1)[:, None, :] + eps)
    if WHOLE:
        b_y = tl.sum(pre[:, :, None] * b_xw.to(tl.float32), 1)
        m_y = m_t[:, None] & (o_d < D)[None, :]
        if NORM:  # the block's input norm on the collapsed rows (and its codes), as rms_norm / rms_norm_int8
            b_y = rms_norm_rows(b_y.to(y.dtype.element_ty).to(tl.float32), b_wn, D, rms_eps, y.dtype.element_ty)
            if CODES:
                codes, b_s = int8_rows(b_y.to(tl.float32))
                tl.store(q + o_t[:, None].to(tl.int64) * D + o_d[None, :], codes, mask=m_y)
                tl.store(s + o_t, b_s, mask=m_t)
        if STORE_Y:
            tl.store(y + o_t[:, None].to(tl.int64) * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_y)
    else:
        for d0 in range(i_s * width, tl.minimum(i_s * width + width, D), BD):  # this program's slice of the width
            o_d = d0 + tl.arange(0, BD)
            m = m_t[:, None, None] & (o_d < D)[None, None, :]
            b_x = tl.load(x + rows[:, None, None] + o_i[None, :, None] * D + o_d[None, None, :], mask=m, other=0.0)
            b_y = tl.sum(pre[:, :, None] * b_x.to(tl.float32), 1)
            tl.store(y + o_t[:, None].to(tl.int64) * D + o_d[None, :], b_y.to(y.dtype.element_ty),
                     mask=m_t[:, None] & (o_d < D)[None, :])
    # the weights last: a load after a store waits for it (the compiler cannot tell the pointers apart)
    m_w = o_t < tl.where(i_s == 0, T, 0)  # every width slice's program computes the weights; the first stores them
    tl.store(post + o_t[:, None] * N + o_i[None, :], pst, mask=m_w[:, None])
    tl.store(comb + o_t[:, None, None] * N * N + o_ij[None, :, :], c, mask=m_w[:, None, None])


def _check(streams: torch.Tensor, n: int, name: str) -> tuple[int, int]:
    if streams.dim() != 3 or streams.shape[1] != n or not streams.is_contiguous():
        raise ValueError(f"{name}: streams must be contiguous [T, {n}, D], got {tuple(streams.shape)}")
    if n & (n - 1):
        raise ValueError(f"{name}: the Triton path needs a power-of-two number of streams, got {n}")
    return streams.shape[0], streams.shape[2]


DETERMINISTIC_SPLIT = 16  # K-splits of the mix product in deterministic mode, whatever T is
# Tokens per program of the mix product: every program reads the whole [(2 + n) n, n D] projection, so a prompt's
# programs together read it T / MIX_TOKENS times (from L2); 64 rows are also the least a Hopper wgmma takes.
MIX_TOKENS = 64
# Most elements of the streams ``hc_pre`` loads as one tile (128 a thread over its 4 warps).
WHOLE_TILE = 16384
# Programs ``hc_pre`` makes at least, splitting the collapse over the width while its tokens make fewer: a batch of
# 32 decode rows is 8 programs of 4 tokens, each reading 128 KB of streams in 16 dependent steps.
COLLAPSE_PROGRAMS = 128
# The attribute of streams that carries their mix product with the next hyper-connection's projection, as
# (projection, ``Mixed``), where the expand that made them formed it (``mhc_expand.hc_post_launch``).
HANDED_OVER = "hc_mixed"


def _tokens_per_program(streams: torch.Tensor, T: int) -> int:
    """Tokens per program of the per-token kernels; their tile shape sets the order of a token's reductions,
    so deterministic mode keeps it whatever T is."""
    most = 4 if streams.is_cuda else 16
    return most if is_deterministic() else min(most, next_power_of_2(T))


def hc_collapse(streams: torch.Tensor) -> torch.Tensor:
    """The last layer's streams [T, n, D] -> their unweighted mean [T, D]; in deterministic mode as a sum in
    stream order (elementwise adds: no reduction kernel whose strategy follows the shape)."""
    if not is_deterministic():
        return streams.mean(dim=1)
    acc = streams[:, 0].float()
    for i in range(1, streams.shape[1]):
        acc = acc + streams[:, i].float()
    return (acc / streams.shape[1]).to(streams.dtype)


@triton.jit
def hc_embed_kernel(ids, table, y, D, N: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """One token's embedding row (columns ``BD`` of it) copied into each of its ``N`` streams."""
    pdl_wait(PDL)
    row, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m = o_d < D
    b_x = tl.load(table + tl.load(ids + row).to(tl.int64) * D + o_d, mask=m)
    for i in tl.static_range(N):
        tl.store(y + (row * N + i) * D + o_d, b_x, mask=m)


def hc_embed(input_ids: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first layer's streams [T, n, D]: each token's embedding row in every stream; one launch on the Triton path
    (the lookup, then the expanded copy, otherwise)."""
    T, D = input_ids.shape[0], table.shape[1]
    if not use_triton(input_ids, table):
        return F.embedding(input_ids, table).unsqueeze(1).expand(-1, n, -1).contiguous()
    y = torch.empty(T, n, D, dtype=table.dtype, device=table.device)
    if T:
        BD = min(1024, next_power_of_2(D))
        fast(hc_embed_kernel)[(T, cdiv(D, BD))](input_ids.contiguous(), table, y, D, N=n, BD=BD, num_warps=4)
    return y


@triton.jit
def hc_collapse_norm_kernel(x, w, y, D, eps, N: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    """One token's final hidden state: its streams' mean (a float32 sum in stream order, rounded to their dtype, as
    ``hc_collapse`` in deterministic mode) and the final RMSNorm of it (``norms.rms_norm_rows``)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = o_d < D
    acc = tl.load(x + row * N * D + o_d, mask=m, other=0.0).to(tl.float32)
    for i in tl.static_range(1, N):
        acc += tl.load(x + row * N * D + i * D + o_d, mask=m, other=0.0).to(tl.float32)
    dt = y.dtype.element_ty
    b_y = rms_norm_rows((acc / N).to(dt).to(tl.float32)[None, :], tl.load(w + o_d, mask=m, other=0.0), D, eps, dt)
    tl.store(y + row * D + o_d[None, :], b_y, mask=m[None, :])


def hc_collapse_norm_launch(streams, weight, eps: float) -> torch.Tensor:
    n = streams.shape[1] if streams.dim() == 3 else 0
    T, D = _check(streams, n, "hc_collapse_norm")
    if weight.shape != (D,):
        raise ValueError(f"hc_collapse_norm: norm weight {tuple(weight.shape)} does not fit width {D}")
    y = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        BD = next_power_of_2(D)
        fast(hc_collapse_norm_kernel)[(T,)](streams, weight, y, D, eps, N=n, BD=BD, num_warps=4 if BD <= 2048 else 8)
    return y


def hc_collapse_norm(streams, weight, eps: float) -> torch.Tensor:
    """The final hidden states: ``norms.rms_norm`` of ``hc_collapse``, in one kernel on the Triton path."""
    if use_triton(streams, weight):
        return hc_collapse_norm_launch(streams, weight, eps)
    return rms_norm(hc_collapse(streams), weight, eps)


def _check_weights(fn, base, scale, n: int, D: int) -> None:
    NM, K = (2 + n) * n, n * D
    if fn.shape != (NM, K) or base.shape != (NM,) or scale.shape != (3,):
        raise ValueError(f"hc_pre: fn {tuple(fn.shape)} base {tuple(base.shape)} scale {tuple(scale.shape)} "
                         f"do not fit {n} streams of width {D}")


class Mixed(NamedTuple):
    """Some streams' mix product with one projection, as split partials for ``hc_pre_kernel`` to add up."""

    part: torch.Tensor  # [split, T, bn] float32 dot products
    sumsq: torch.Tensor  # [split, T] float32 sums of squares
    split: int
    bn: int


def _mix(streams, fn, n: int) -> Mixed:
    """The mix product's split partials and sums of squares (``hc_mix_kernel``)."""
    T, D = streams.shape[0], streams.shape[2]
    NM, K = (2 + n) * n, n * D
    BT, BN = MIX_TOKENS, max(16, next_power_of_2(NM))
    BK = 64 if streams.dtype == torch.float32 else 128  # float32 tiles of 128 spill registers
    blocks = cdiv(T, BT)
    # the split of the K reduction fills the GPU at small T; deterministic mode fixes it by K alone
    SPLIT = max(1, min(DETERMINISTIC_SPLIT if is_deterministic() else min(64, 256 // blocks), cdiv(K, BK)))
    KS = cdiv(cdiv(K, SPLIT), BK) * BK
    SPLIT = cdiv(K, KS)
    part = torch.empty(SPLIT, T, BN, dtype=torch.float32, device=streams.device)
    sumsq = torch.empty(SPLIT, T, dtype=torch.float32, device=streams.device)
    fast(hc_mix_kernel)[(blocks, SPLIT)](streams, fn.contiguous(), part, sumsq, T, K, KS, NM=NM, BT=BT, BN=BN, BK=BK,
                                         IEEE=streams.dtype == torch.float32, num_warps=4)
    return Mixed(part, sumsq, SPLIT, BN)


def _whole(streams, T: int, D: int, n: int) -> bool:
    """Whether the collapse's programs take their tokens' whole streams as one tile (a decode step's token)."""
    return _tokens_per_program(streams, T) * n * next_power_of_2(D) <= WHOLE_TILE


def fused_norm(streams, n: int) -> bool:
    """Whether ``hc_pre_norm``'s norm fits the collapse's kernel: tokens whose streams fit one tile a program."""
    return streams.shape[0] > 0 and _whole(streams, streams.shape[0], streams.shape[2], n)


def _collapse(streams, base, scale, n, iters, eps, norm_eps, y, post, comb, mixed, norm=None, **norm_consts):
    """``hc_pre_kernel`` over the ``mixed`` partials (``_mix``); ``norm``: (weight, codes, scales, eps) of a fused
    input norm (whole tiles only)."""
    T, D = streams.shape[0], streams.shape[2]
    part, sumsq, SPLIT, BN = mixed
    # 4 tokens per program on the GPU keeps the [BT, n, BD] tiles in registers; the interpreter prefers
    # fewer, larger programs
    BT2 = _tokens_per_program(streams, T)
    whole = _whole(streams, T, D, n)
    BD = next_power_of_2(D) if whole else max(16, min(1024 // BT2, next_power_of_2(D)))
    # a decode batch's few programs split the collapse over the width too (each recomputing its tokens' weights)
    slices = 1 if whole else max(1, min(cdiv(D, BD), COLLAPSE_PROGRAMS // cdiv(T, BT2)))
    width = cdiv(cdiv(D, slices), BD) * BD
    w_norm, q, s, rms_eps = norm if norm is not None else (post, post, post, 0.0)
    fast(hc_pre_kernel)[(cdiv(T, BT2), cdiv(D, width))](
        streams, part, sumsq, base.contiguous(), scale.contiguous(), y, post, comb, T, D, SPLIT, iters, eps, norm_eps,
        width, w_norm, q, s, rms_eps, N=n, BN=BN, BT=BT2, BD=BD, SP=next_power_of_2(SPLIT), WHOLE=whole,
        num_warps=4, **norm_consts)


def _mixed(streams, fn, n: int) -> Mixed:
    """The streams' mix product with ``fn``: the one the expand that made them handed over with them
    (``hc_post_launch``), else ``hc_mix_kernel``'s."""
    held = getattr(streams, HANDED_OVER, None)
    return held[1] if held is not None and held[0] is fn else _mix(streams, fn, n)


def hc_pre_launch(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    T, D = _check(streams, n, "hc_pre")
    _check_weights(fn, base, scale, n, D)
    dev = streams.device
    y = torch.empty(T, D, dtype=streams.dtype, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T:
        _collapse(streams, base, scale, n, iters, eps, norm_eps, y, post, comb, _mixed(streams, fn, n))
    return y, post, comb


def hc_pre_norm_launch(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float, weight,
                       rms_eps: float, codes: bool, keep_normed: bool):
    """``hc_pre_norm`` in one kernel, for tokens whose streams fit one tile (``fused_norm``)."""
    T, D = _check(streams, n, "hc_pre")
    if not fused_norm(streams, n):
        raise ValueError(f"hc_pre_norm: {T} tokens of width {D} do not fit one tile a program")
    _check_weights(fn, base, scale, n, D)
    if weight.shape != (D,):
        raise ValueError(f"hc_pre_norm: norm weight {tuple(weight.shape)} does not fit width {D}")
    dev = streams.device
    y = torch.empty(T, D, dtype=streams.dtype, device=dev) if keep_normed or not codes else None
    q = torch.empty(T, D, dtype=torch.int8, device=dev) if codes else None
    s = torch.empty(T, dtype=torch.float32, device=dev) if codes else None
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    # the buffers not made stand in for their pointers, never written (y's dtype sets the norm's roundings)
    _collapse(streams, base, scale, n, iters, eps, norm_eps, streams if y is None else y, post, comb,
              _mixed(streams, fn, n), (weight, post if q is None else q, post if s is None else s, rms_eps),
              NORM=True, CODES=codes, STORE_Y=y is not None)
    return y, q, s, post, comb


def hc_pre(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float):
    if use_triton(streams, fn, base, scale):
        return hc_pre_launch(streams, fn, base, scale, n, iters, eps, norm_eps)
    return hc_pre_ref(streams, fn, base, scale, n, iters, eps, norm_eps)


def hc_pre_norm(streams, fn, base, scale, n: int, iters: int, eps: float, norm_eps: float, weight, rms_eps: float,
                codes: bool, keep_normed: bool):
    """``hc_pre``, then the block's input RMSNorm of the collapsed rows: ``norms.rms_norm``, or with ``codes``
    ``norm_act.rms_norm_int8`` (its int8 codes and scales, and the normed rows where ``keep_normed``) -> (normed rows
    or None, codes or None, scales or None, post, comb). One kernel where the tokens' streams fit one tile (a decode
    step's token), the norm's own kernel after the collapse otherwise."""
    if use_triton(streams, fn, base, scale, weight) and fused_norm(streams, n):
        return hc_pre_norm_launch(streams, fn, base, scale, n, iters, eps, norm_eps, weight, rms_eps, codes,
                                  keep_normed)
    collapsed, post, comb = hc_pre(streams, fn, base, scale, n, iters, eps, norm_eps)
    if codes:
        return (*rms_norm_int8(collapsed, weight, rms_eps, keep_normed), post, comb)
    return rms_norm(collapsed, weight, rms_eps), None, None, post, comb

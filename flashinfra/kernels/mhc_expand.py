"""mHC's expand (``hc_post``): ``out_streams[i] = post_i * out + sum_j comb[j, i] * stream_j`` from the block's output
and the weights its collapse (``mhc.hc_pre``) made.

Triton path: ``hc_post_kernel`` (per ``BT`` tokens and ``D`` block). For a decode batch of a few tokens, it also
forms the next hyper-connection's mix product from the new streams it writes, as
``mhc.hc_mix_kernel``'s split partials, and the new streams carry it to that collapse (``mhc.HANDED_OVER``): a mix
launch less for every block after the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.mhc import HANDED_OVER, Mixed, _check, _tokens_per_program


def hc_post_ref(streams, out, post, comb):
    """streams [T, n, D], block output [T, D] -> new streams [T, n, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@triton.jit
def hc_post_kernel(x, out, post, comb, y, fn, part, sumsq, T, D, N: tl.constexpr, BT: tl.constexpr,
                   BD: tl.constexpr, MIX: tl.constexpr = False, NM: tl.constexpr = 1, BN: tl.constexpr = 1,
                   PDL: tl.constexpr = False):
    """The expand of ``BT`` tokens over ``BD`` columns. With ``MIX``, also the next hyper-connection's mix product
    (projection ``fn``) over this program's columns of every stream: its split ``i_d`` of the partials and sums of
    squares that ``hc_mix_kernel`` writes (``[SPLIT, T, BN]``, ``[SPLIT, T]``), from the rounded new streams as that
    kernel would load them. Every load comes before the store of the new streams, which the compiler cannot move a
    load past."""
    pdl_wait(PDL)
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_i = tl.arange(0, N)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    dt = y.dtype.element_ty
    rows = o_t.to(tl.int64) * N * D
    m2 = m_t[:, None] & m_d[None, :]
    if MIX:  # the projection's columns of this block in every stream, as one [BN, N BD] tile (stream-major)
        o_m, o_c = tl.arange(0, BN), tl.arange(0, N * BD)
        c_d = i_d * BD + o_c % BD
        b_w = tl.load(fn + o_m[:, None] * (N * D) + (o_c // BD)[None, :] * D + c_d[None, :],
                      mask=(o_m < NM)[:, None] & (c_d < D)[None, :], other=0.0).to(dt).to(tl.float32)
    # the reference rounds the weights to the streams' dtype before using them
    pst = tl.load(post + o_t[:, None] * N + o_i[None, :], mask=m_t[:, None], other=0.0).to(dt).to(tl.float32)
    b_o = tl.load(out + o_t[:, None].to(tl.int64) * D + o_d[None, :], mask=m2, other=0.0).to(tl.float32)
    acc = pst[:, :, None] * b_o[:, None, :]  # [BT, N(i), BD]
    for j in tl.static_range(N):
        c_j = tl.load(comb + o_t[:, None] * N * N + j * N + o_i[None, :], mask=m_t[:, None], other=0.0)  # [BT, i]
        x_j = tl.load(x + rows[:, None] + j * D + o_d[None, :], mask=m2, other=0.0).to(tl.float32)  # [BT, BD]
        acc += c_j.to(dt).to(tl.float32)[:, :, None] * x_j[:, None, :]
    b_y = acc.to(dt)
    m3 = m_t[:, None, None] & m_d[None, None, :]
    tl.store(y + rows[:, None, None] + o_i[None, :, None] * D + o_d[None, None, :], b_y, mask=m3)
    if MIX:  # the rows flattened as the projection's tile is: one product over every stream's columns
        yf = tl.reshape(b_y.to(tl.float32), [BT, N * BD])
        acc_m = tl.sum(yf[:, None, :] * b_w[None, :, :], 2)  # [BT, BN]
        split = i_d * T + o_t
        tl.store(part + split[:, None] * BN + o_m[None, :], acc_m, mask=m_t[:, None])
        tl.store(sumsq + split, tl.sum(yf * yf, 1), mask=m_t)


# Decode batches up to this many tokens (one program's on the GPU) have the expand form the next hyper-connection's
# mix product in its programs (``hc_post_kernel`` with ``MIX``), in this many column splits at most: no mix launch of
# their own, which at a few tokens is bound by its latency, not by the 1.5 MB of projection it reads. Each further
# program of tokens reads the projection again and multiplies on the CUDA cores (at 32 tokens the expand took 8x the
# mix launch it saves: ``notes/mhc.md``).
POST_MIX_TOKENS = 4
POST_MIX_SPLIT = 64


def post_mix(T: int, next_fn) -> bool:
    """Whether the expand forms the next hyper-connection's mix product (``next_fn``: its projection, or None)."""
    return next_fn is not None and 0 < T <= POST_MIX_TOKENS and not is_deterministic()


def hc_post_launch(streams, out, post, comb, next_fn=None):
    """The new streams; with ``next_fn`` (``post_mix``) they carry the next hyper-connection's mix product, which
    its ``hc_pre`` then takes instead of a mix launch (``_mixed``)."""
    n = streams.shape[1] if streams.dim() == 3 else 0
    T, D = _check(streams, n, "hc_post")
    if out.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n):
        raise ValueError(f"hc_post: out {tuple(out.shape)} post {tuple(post.shape)} comb {tuple(comb.shape)} "
                         f"do not fit streams {tuple(streams.shape)}")
    y = torch.empty_like(streams)
    BT = _tokens_per_program(streams, T)
    args = (streams, out.contiguous(), post.contiguous(), comb.contiguous(), y)
    if post_mix(T, next_fn):
        NM, BN = (2 + n) * n, max(16, next_power_of_2((2 + n) * n))
        if next_fn.shape != (NM, n * D):
            raise ValueError(f"hc_post: next fn {tuple(next_fn.shape)} does not fit {n} streams of width {D}")
        BD = max(16, next_power_of_2(cdiv(D, POST_MIX_SPLIT)))
        split = cdiv(D, BD)
        part = torch.empty(split, T, BN, dtype=torch.float32, device=streams.device)
        sumsq = torch.empty(split, T, dtype=torch.float32, device=streams.device)
        fast(hc_post_kernel)[(cdiv(T, BT), split)](*args, next_fn.contiguous(), part, sumsq, T, D, N=n, BT=BT, BD=BD,
                                                   MIX=True, NM=NM, BN=BN, num_warps=4)
        setattr(y, HANDED_OVER, (next_fn, Mixed(part, sumsq, split, BN)))
    elif T:
        BD = max(16, min(1024 // BT, next_power_of_2(D)))
        fast(hc_post_kernel)[(cdiv(T, BT), cdiv(D, BD))](*args, y, y, y, T, D, N=n, BT=BT, BD=BD, num_warps=4)
    return y


def hc_post(streams, out, post, comb, next_fn=None):
    """The expand; ``next_fn``: the next hyper-connection's projection, whose mix product the expand's kernel forms
    too where it can (``post_mix``)."""
    if use_triton(streams, out, post, comb):
        return hc_post_launch(streams, out, post, comb, next_fn)
    return hc_post_ref(streams, out, post, comb)

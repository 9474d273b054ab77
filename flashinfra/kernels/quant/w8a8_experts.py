"""W8A8 INT8 fused MoE experts: ``fused_moe``'s sorted dispatch and grouped GEMMs on int8 tensor cores.

Structure as ``kernels.fused_moe`` (``moe_align`` groups the (token, expert) pairs by expert in ``BM``-row
blocks; ``moe_sum_kernel`` adds each token's pair outputs), with int8 operands:

1. ``quant_int8_per_token`` on ``x``: int8 rows and one scale per token.
2. ``w8a8_moe_gemm1_kernel``: gate and up products in int32, scaled by the token's and the channel's scales,
   then ``silu(min(gate, L)) * clamp(up, -L, L)``, written once per pair in the activation dtype.
3. ``quant_int8_per_token`` on those pair rows (one scale per pair: a pair's row spans every ``BN`` program, so
   the scale cannot be found inside gemm1's epilogue).
4. ``w8a8_moe_gemm2_kernel``: the down projection in int32, times the pair's scale, the channel's scale and the
   routing weight.

Weights: int8 ``w13`` [E, 2I, D] with scales [E, 2I], ``w2`` [E, D, I] with scales [E, D]. The shared expert is
the caller's: stacked as expert ``E - 1`` with a weight-1 pair per token, it runs in the same launches
(``flashinfra.quant.linear.moe_experts`` does that). ``w8a8_moe_ref`` is the same arithmetic in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.fused_moe import moe_align, moe_sum_kernel
from flashinfra.kernels.launch import fast
from flashinfra.kernels.quant.act import quant_int8_per_token, quant_int8_per_token_ref


def w8a8_moe_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    """x [T, D] -> sum over each token's pairs of ``weight * expert(x)`` in x's dtype (float64 arithmetic)."""
    T, D = x.shape
    N = w13.shape[1] // 2
    xq, sx = quant_int8_per_token_ref(x)
    out = torch.zeros(T, D, dtype=torch.float64, device=x.device)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gu = (xq[token].double() @ w13[e].double().t()) * sx[token].double()[:, None] * s13[e].double()[None, :]
        gate, up = gu[:, :N].clamp(max=limit), gu[:, N:].clamp(min=-limit, max=limit)
        h = (gate * torch.sigmoid(gate) * up).to(x.dtype)
        hq, sh = quant_int8_per_token_ref(h)
        y = (hq.double() @ w2[e].double().t()) * sh.double()[:, None] * s2[e].double()[None, :]
        out.index_add_(0, token, (y * topk_weights[token, slot].double()[:, None]).to(x.dtype).double())
    return out.to(x.dtype)


@triton.jit
def w8a8_moe_gemm1_kernel(xq, sx, w, sw, h, sorted_ids, expert_ids, used, num_pairs, limit, N: tl.constexpr,
                          K: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m * BM >= tl.load(used):
        return
    pair = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_p = pair < num_pairs
    tok = (pair // TOPK).to(tl.int64)
    e = tl.load(expert_ids + i_m).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_g = w + e * (2 * N * K) + o_n[None, :].to(tl.int64) * K
    p_u = p_g + N * K
    acc_g = tl.zeros([BM, BN], dtype=tl.int32)
    acc_u = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(xq + tok[:, None] * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0)
        m_w = m_k[:, None] & m_n[None, :]
        acc_g += tl.dot(b_x, tl.load(p_g + o_k[:, None], mask=m_w, other=0))
        acc_u += tl.dot(b_x, tl.load(p_u + o_k[:, None], mask=m_w, other=0))
    b_sx = tl.load(sx + tok, mask=m_p, other=0.0)[:, None]
    s_g = tl.load(sw + e * 2 * N + o_n, mask=m_n, other=0.0)[None, :]
    s_u = tl.load(sw + e * 2 * N + N + o_n, mask=m_n, other=0.0)[None, :]
    gate = tl.minimum(acc_g.to(tl.float32) * b_sx * s_g, limit)
    up = tl.minimum(tl.maximum(acc_u.to(tl.float32) * b_sx * s_u, -limit), limit)
    b_h = gate * tl.sigmoid(gate) * up
    tl.store(h + pair[:, None].to(tl.int64) * N + o_n[None, :], b_h.to(h.dtype.element_ty),
             mask=m_p[:, None] & m_n[None, :])


@triton.jit
def w8a8_moe_gemm2_kernel(hq, sh, w, sw, out, topk_w, sorted_ids, expert_ids, used, num_pairs, N: tl.constexpr,
                          K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    if i_m * BM >= tl.load(used):
        return
    pair = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_p = pair < num_pairs
    rows = pair.to(tl.int64)
    e = tl.load(expert_ids + i_m).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_w = w + e * (N * K) + o_n[None, :].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_h = tl.load(hq + rows[:, None] * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0)
        acc += tl.dot(b_h, tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0))
    scale = tl.load(sh + rows, mask=m_p, other=0.0) * tl.load(topk_w + rows, mask=m_p, other=0.0)
    y = acc.to(tl.float32) * scale[:, None] * tl.load(sw + e * N + o_n, mask=m_n, other=0.0)[None, :]
    tl.store(out + rows[:, None] * N + o_n[None, :], y.to(out.dtype.element_ty), mask=m_p[:, None] & m_n[None, :])


def _config(num_pairs: int, num_experts: int) -> dict:
    per_expert = num_pairs / max(num_experts, 1)
    if num_pairs <= 64 or per_expert <= 16:
        return dict(BM=16, BN1=64, BN2=64, BK=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BM=32, BN1=64, BN2=64, BK=128, num_warps=4, num_stages=4)
    return dict(BM=128, BN1=128, BN2=128, BK=128, num_warps=8, num_stages=3)


def w8a8_moe_launch(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    T, D = x.shape
    E, N2, K = w13.shape
    N = N2 // 2
    if K != D or w2.shape != (E, D, N) or s13.shape != (E, N2) or s2.shape != (E, D):
        raise ValueError(f"w8a8_moe: w13 {tuple(w13.shape)} / {tuple(s13.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(s2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"w8a8_moe: topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} do not "
                         f"fit {T} tokens")
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    k = topk_ids.shape[1]
    xq, sx = quant_int8_per_token(x)
    cfg = _config(T * k, E)
    BM, BK = cfg["BM"], cfg["BK"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_ids, expert_ids, used = moe_align(topk_ids, E, BM)
    h = torch.empty(T * k, N, dtype=x.dtype, device=x.device)
    fast(w8a8_moe_gemm1_kernel)[(sorted_ids.numel() // BM, triton.cdiv(N, cfg["BN1"]))](
        xq, sx, w13, s13, h, sorted_ids, expert_ids, used, T * k, float(limit), N=N, K=K, TOPK=k, BM=BM,
        BN=cfg["BN1"], BK=BK, **launch)
    hq, sh = quant_int8_per_token(h)
    pairs = torch.empty(T * k, D, dtype=x.dtype, device=x.device)
    fast(w8a8_moe_gemm2_kernel)[(sorted_ids.numel() // BM, triton.cdiv(D, cfg["BN2"]))](
        hq, sh, w2, s2, pairs, topk_weights.float().contiguous(), sorted_ids, expert_ids, used, T * k, N=D, K=N,
        BM=BM, BN=cfg["BN2"], BK=BK, **launch)
    BD = min(1024, triton.next_power_of_2(D))
    fast(moe_sum_kernel)[(T, triton.cdiv(D, BD))](pairs, y, D, TOPK=k, BD=BD, num_warps=4)
    return y


def w8a8_moe(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    """x [T, D] float; int8 experts (see the module docstring) -> [T, D] in x's dtype."""
    if use_triton(x, w13, w2):
        return w8a8_moe_launch(x, w13, s13, w2, s2, topk_weights, topk_ids, limit)
    return w8a8_moe_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit)

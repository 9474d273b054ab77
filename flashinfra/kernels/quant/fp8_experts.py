"""Block-FP8 fused MoE experts: ``w8a8_moe``'s structure with e4m3 operands and 128 x 128 weight block scales.

Activations are quantized per token per 128 channels (``act.quant_fp8_per_group``), the intermediate per
pair per 128 channels; every ``BK = 128`` step's float32 product is scaled by its activation block scale and the
weight tile's scale before it is accumulated (as ``fp8_block_linear``). Weights: e4m3 ``w13`` [E, 2I, D] with
scales [E, ceil(2I/128), ceil(D/128)], ``w2`` [E, D, I] with scales [E, ceil(D/128), ceil(I/128)]; the gate and
up halves must each start on a block boundary (``I % 128 == 0``, true of the released checkpoints) unless the
scales were made for the stacked ``[2I, D]`` (the quantizer here does that, so any ``I`` works).
``fp8_moe_ref`` is the same arithmetic in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.quant.fp8_gemm import fp8_matmul_ref
from flashinfra.kernels.fused_moe import moe_align, moe_sum_kernel
from flashinfra.kernels.launch import fast
from flashinfra.kernels.quant.act import quant_fp8_per_group, quant_fp8_per_group_ref

GROUP = 128


def fp8_moe_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    T, D = x.shape
    N = w13.shape[1] // 2
    xq, sx = quant_fp8_per_group_ref(x, GROUP)
    out = torch.zeros(T, D, dtype=torch.float64, device=x.device)
    blk = (GROUP, GROUP)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gu = fp8_matmul_ref(xq[token], sx[token], w13[e], s13[e], blk, out_dtype=torch.float64)
        gate, up = gu[:, :N].clamp(max=limit), gu[:, N:].clamp(min=-limit, max=limit)
        h = (gate * torch.sigmoid(gate) * up).to(x.dtype)
        hq, sh = quant_fp8_per_group_ref(h, GROUP)
        y = fp8_matmul_ref(hq, sh, w2[e], s2[e], blk, out_dtype=torch.float64)
        out.index_add_(0, token, (y * topk_weights[token, slot].double()[:, None]).to(x.dtype).double())
    return out.to(x.dtype)


@triton.jit
def fp8_moe_gemm1_kernel(xq, sx, w, sw, h, sorted_ids, expert_ids, used, num_pairs, limit, N: tl.constexpr,
                         K: tl.constexpr, KB: tl.constexpr, NB2: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
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
    p_sg = sw + e * (NB2 * KB) + (o_n // BK) * KB
    p_su = sw + e * (NB2 * KB) + ((o_n + N) // BK) * KB
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, KB):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(xq + tok[:, None] * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0.0)
        b_sx = tl.load(sx + tok * KB + kb, mask=m_p, other=0.0)[:, None]
        m_w = m_k[:, None] & m_n[None, :]
        acc_g += tl.dot(b_x, tl.load(p_g + o_k[:, None], mask=m_w, other=0.0)) * b_sx * \
            tl.load(p_sg + kb, mask=m_n, other=0.0)[None, :]
        acc_u += tl.dot(b_x, tl.load(p_u + o_k[:, None], mask=m_w, other=0.0)) * b_sx * \
            tl.load(p_su + kb, mask=m_n, other=0.0)[None, :]
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    b_h = gate * tl.sigmoid(gate) * up
    tl.store(h + pair[:, None].to(tl.int64) * N + o_n[None, :], b_h.to(h.dtype.element_ty),
             mask=m_p[:, None] & m_n[None, :])


@triton.jit
def fp8_moe_gemm2_kernel(hq, sh, w, sw, out, topk_w, sorted_ids, expert_ids, used, num_pairs, N: tl.constexpr,
                         K: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr):
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
    p_sw = sw + e * (NB * KB) + (o_n // BK) * KB
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, KB):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_h = tl.load(hq + rows[:, None] * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0.0)
        b_sh = tl.load(sh + rows * KB + kb, mask=m_p, other=0.0)[:, None]
        acc += tl.dot(b_h, tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)) * b_sh * \
            tl.load(p_sw + kb, mask=m_n, other=0.0)[None, :]
    acc = acc * tl.load(topk_w + rows, mask=m_p, other=0.0)[:, None]
    tl.store(out + rows[:, None] * N + o_n[None, :], acc.to(out.dtype.element_ty), mask=m_p[:, None] & m_n[None, :])


def _config(num_pairs: int, num_experts: int) -> dict:
    per_expert = num_pairs / max(num_experts, 1)
    if num_pairs <= 64 or per_expert <= 16:
        return dict(BM=16, BN1=64, BN2=64, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BM=32, BN1=64, BN2=64, num_warps=4, num_stages=4)
    return dict(BM=128, BN1=128, BN2=128, num_warps=8, num_stages=3)


def fp8_moe_launch(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    T, D = x.shape
    E, N2, K = w13.shape
    N = N2 // 2
    KB1, KB2 = triton.cdiv(D, GROUP), triton.cdiv(N, GROUP)
    NB2, NB = triton.cdiv(N2, GROUP), triton.cdiv(D, GROUP)
    if K != D or w2.shape != (E, D, N) or s13.shape != (E, NB2, KB1) or s2.shape != (E, NB, KB2):
        raise ValueError(f"fp8_moe: w13 {tuple(w13.shape)} / {tuple(s13.shape)}, w2 {tuple(w2.shape)} / "
                         f"{tuple(s2.shape)} do not fit x {tuple(x.shape)} with {GROUP}x{GROUP} blocks")
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    k = topk_ids.shape[1]
    xq, sx = quant_fp8_per_group(x, GROUP)
    cfg = _config(T * k, E)
    BM = cfg["BM"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_ids, expert_ids, used = moe_align(topk_ids, E, BM)
    h = torch.empty(T * k, N, dtype=x.dtype, device=x.device)
    fast(fp8_moe_gemm1_kernel)[(sorted_ids.numel() // BM, triton.cdiv(N, cfg["BN1"]))](
        xq, sx, w13, s13.contiguous(), h, sorted_ids, expert_ids, used, T * k, float(limit), N=N, K=K, KB=KB1,
        NB2=NB2, TOPK=k, BM=BM, BN=cfg["BN1"], BK=GROUP, **launch)
    hq, sh = quant_fp8_per_group(h, GROUP)
    pairs = torch.empty(T * k, D, dtype=x.dtype, device=x.device)
    fast(fp8_moe_gemm2_kernel)[(sorted_ids.numel() // BM, triton.cdiv(D, cfg["BN2"]))](
        hq, sh, w2, s2.contiguous(), pairs, topk_weights.float().contiguous(), sorted_ids, expert_ids, used, T * k,
        N=D, K=N, KB=KB2, NB=NB, BM=BM, BN=cfg["BN2"], BK=GROUP, **launch)
    BD = min(1024, triton.next_power_of_2(D))
    fast(moe_sum_kernel)[(T, triton.cdiv(D, BD))](pairs, y, D, TOPK=k, BD=BD, num_warps=4)
    return y


def fp8_moe(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float):
    """x [T, D] float; block-FP8 experts (see the module docstring) -> [T, D] in x's dtype."""
    if use_triton(x, w13, w2):
        return fp8_moe_launch(x, w13, s13, w2, s2, topk_weights, topk_ids, limit)
    return fp8_moe_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit)

"""The prep and norm launches of the KDA layer decode with several heads of one sequence per program
(``prep_heads`` / ``norm_heads`` > 1 in ``kda_layer_decode_launch``).

Same outputs as ``kda_layer_decode_prep_kernel`` and ``kda_layer_decode_norm_kernel`` (one program per
(sequence, head), 128-wide vectors): the scratch rows q, k, decay (v) and beta, the conv slot shifted, the
gated RMSNorm in place. What changes is the shape of the work: a program takes ``HB`` heads as [HB, K]
tiles, so the channels it reads (q|k|v row, g_raw, dt_bias, the scratch rows) are contiguous runs of HB * K
elements (vector loads and stores), each thread has HB times the independent loads in flight, and there are
HB times fewer programs (at B=64, H=64: 1024 programs for HB=4, one wave, against 4096 in two). The conv
reads each channel's slot taps and its weights as one [HB, K, W] tile (the weights as one 16-byte vector per
channel instead of W strided loads), with x in the last tap column, and the shift stores that same tile one
column to the left (tap j + 1 into slot column j, x into the last one): no second read of the slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda_gate import kda_log_decay


@triton.jit
def _conv_heads(x_row, conv_w, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """Conv + SiLU of the channels ``ch`` [HB, N] (float32, rounded through x's dtype as the unfused conv output
    is), then the slot of those channels shifted in place: the tile t[c, j] holds slot column j for j < W - 1
    and x at j = W - 1, and column j >= 1 is stored into slot column j - 1."""
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    o_j = tl.arange(0, BW)[None, None, :]
    ch3, m3 = ch[:, :, None], m[:, :, None]
    p_t = cs_slot + ch3 * (W - 1) + o_j
    b_t = tl.load(p_t, mask=m3 & (o_j < W - 1), other=0.0)
    b_w = tl.load(conv_w + ch3 * W + o_j, mask=m3 & (o_j < W), other=0.0).to(tl.float32)
    b_taps = tl.where(o_j == W - 1, b_x[:, :, None], b_t.to(b_x.dtype)).to(tl.float32)
    acc = tl.sum(b_taps * b_w, 2)
    acc = acc * tl.sigmoid(acc)
    b_new = tl.where(o_j == W - 1, b_x[:, :, None].to(b_t.dtype), b_t)
    tl.debug_barrier()  # every thread's slot reads are done before the tile goes back one column to the left
    tl.store(p_t - 1, b_new, mask=m3 & (o_j >= 1) & (o_j < W))
    return acc.to(b_x.dtype).to(tl.float32)


@triton.jit
def kda_layer_decode_prep_heads_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, PREP_V: tl.constexpr, BVF: tl.constexpr,
    EVICT: tl.constexpr,
):
    """Grid (B * cdiv(H, HB),): heads HB * j .. HB * j + HB - 1 of sequence i; ``heads`` [B * H, 4 or 5, R] as
    ``kda_layer_decode_prep_kernel`` writes it (rows q, k, decay, (v,) beta in the first column)."""
    NHB: tl.constexpr = (H + HB - 1) // HB
    pid = tl.program_id(0)
    i_b = pid // NHB
    o_h = (pid % NHB) * HB + tl.arange(0, HB)
    m_h = o_h < H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_hk = m_h[:, None] & m_k[None, :]
    slot = tl.load(state_slots + i_b).to(tl.int64)
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    ch_q = o_h[:, None] * K + o_k[None, :]
    b_g = tl.load(g_raw + i_b * stride_g + ch_q, mask=m_hk, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + ch_q, mask=m_hk, other=0.0)
    b_rate = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    b_decay = tl.exp(kda_log_decay(b_g, b_rate[:, None], lower_bound, HAS_LOWER_BOUND))
    b_beta = tl.sigmoid(tl.load(beta_logits + i_b * stride_b + o_h, mask=m_h, other=0.0).to(tl.float32))
    NR: tl.constexpr = 5 if PREP_V else 4
    p_h = heads + ((i_b * H + o_h) * (NR * R))[:, None] + o_k[None, :]
    m_hr = m_h[:, None] & (o_k < R)[None, :]
    b_q = _conv_heads(x_row, conv_w, cs_slot, ch_q, m_hk, W, BW)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None] * scale
    tl.store(p_h, b_q, mask=m_hr, eviction_policy=EVICT)
    b_k = _conv_heads(x_row, conv_w, cs_slot, H * K + ch_q, m_hk, W, BW)
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    tl.store(p_h + R, b_k, mask=m_hr, eviction_policy=EVICT)
    tl.store(p_h + 2 * R, b_decay, mask=m_hr, eviction_policy=EVICT)
    b_beta_row = tl.where((o_k == 0)[None, :], b_beta[:, None], 0.0)
    if PREP_V:
        o_f = tl.arange(0, BVF)
        m_hf = m_h[:, None] & (o_f < V)[None, :]
        b_v = _conv_heads(x_row, conv_w, cs_slot, 2 * H * K + o_h[:, None] * V + o_f[None, :], m_hf, W, BW)
        p_v = heads + ((i_b * H + o_h) * (NR * R))[:, None] + 3 * R + o_f[None, :]
        tl.store(p_v, b_v, mask=m_h[:, None] & (o_f < R)[None, :], eviction_policy=EVICT)
        tl.store(p_h + 4 * R, b_beta_row, mask=m_hr, eviction_policy=EVICT)
    else:
        tl.store(p_h + 3 * R, b_beta_row, mask=m_hr, eviction_policy=EVICT)


@triton.jit
def kda_layer_decode_norm_heads_kernel(
    gate, norm_w, eps, out, stride_gate,
    H: tl.constexpr, V: tl.constexpr, BVF: tl.constexpr, HB: tl.constexpr,
):
    """Grid (B * cdiv(H, HB),): the gated RMSNorm of HB heads' output rows of one sequence, in place (each
    row's reduction reads the whole row before any of it is stored)."""
    NHB: tl.constexpr = (H + HB - 1) // HB
    pid = tl.program_id(0)
    i_b = pid // NHB
    o_h = (pid % NHB) * HB + tl.arange(0, HB)
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    m = (o_h < H)[:, None] & m_f[None, :]
    p_o = out + (i_b * H + o_h)[:, None] * V + o_f[None, :]
    b_o = tl.load(p_o, mask=m, other=0.0).to(tl.float32)
    b_gate = tl.load(gate + i_b * stride_gate + o_h[:, None] * V + o_f[None, :], mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(norm_w + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = b_o / tl.sqrt(tl.sum(b_o * b_o, 1) / V + eps)[:, None]
    b_o = b_o * b_w[None, :] * tl.sigmoid(b_gate)
    tl.debug_barrier()
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m)


def check_heads(prep_heads: int, norm_heads: int) -> None:
    for name, n in (("prep_heads", prep_heads), ("norm_heads", norm_heads)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"kda_layer_decode: {name} must be a power of two >= 1, got {n}")


def prep_heads_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb, state_slots,
                      heads: torch.Tensor, sizes: dict, has_lower_bound: bool, R: int, prep_v: bool, BVF: int,
                      evict: str, prep_heads: int, num_warps: int) -> None:
    """The prep launch, ``prep_heads`` heads of one sequence per program."""
    B, H = qkv.shape[0], sizes["H"]
    sizes = dict(sizes, BW=triton.next_power_of_2(sizes["W"]))  # the slot's W - 1 taps and x in one tile row
    kda_layer_decode_prep_heads_kernel[(B * triton.cdiv(H, prep_heads),)](
        qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb, state_slots, heads,
        qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), sizes["K"] ** -0.5, **sizes,
        HAS_LOWER_BOUND=has_lower_bound, R=R, HB=prep_heads, PREP_V=prep_v, BVF=BVF, EVICT=evict,
        num_warps=num_warps)


def norm_heads_launch(gate, norm_weight, eps: float, out: torch.Tensor, norm_heads: int, num_warps: int) -> None:
    """The norm launch, ``norm_heads`` heads of one sequence per program."""
    B, H, V = out.shape
    kda_layer_decode_norm_heads_kernel[(B * triton.cdiv(H, norm_heads),)](
        gate, norm_weight, float(eps), out, gate.stride(0), H=H, V=V, BVF=triton.next_power_of_2(V), HB=norm_heads,
        num_warps=num_warps)

"""The prep and norm launches of the KDA layer decode's prep layout, with ``HB`` heads of one sequence per program
(``decode_config``: 1 or 2 heads per prep program, 4 per norm program): the scratch rows q, k, decay and beta,
the q/k conv slot shifted, and the gated RMSNorm in place. A program takes ``HB`` heads as [HB, K] tiles, so the
channels it reads (q|k row, g_raw, dt_bias, the scratch rows) are contiguous runs of HB * K elements (vector loads
and stores), each thread has HB times the independent loads in flight, and the per-program setup (slot index,
addresses, the per-head reductions' barriers) is paid once per HB heads. The conv reads each slot tap once and
shifts the slot from those registers (one load and one store per slot element; conv widths up to 4, whose taps
are named), and the q/k L2 norm and the RMSNorm divide once per head and multiply per element. Every tile of a
program is [HB, K] in one register layout, except the contiguous x row, which the compiler converts once per conv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda.common import kda_log_decay
from flashinfra.kernels.kda.common import conv_slot
from flashinfra.kernels.launch import cdiv, next_power_of_2, pdl_wait


@triton.jit
def _conv_heads(x_row, conv_w, cs_slot, ch, m, W: tl.constexpr):
    """Conv + SiLU of the channels ``ch`` [HB, N] (float32, rounded through x's dtype as the unfused conv output
    is; the taps summed in ``conv_silu``'s order), then the slot of those channels shifted in place from the
    taps already in registers: one load and one store per slot element. W <= 4 (the taps are named)."""
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    p_s = cs_slot + ch * (W - 1)
    p_w = conv_w + ch * W
    b_t0 = tl.load(p_s, mask=m, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(p_w + W - 1, mask=m, other=0.0).to(tl.float32)
    acc += b_t0.to(b_x.dtype).to(tl.float32) * tl.load(p_w, mask=m, other=0.0).to(tl.float32)
    if W > 2:
        b_t1 = tl.load(p_s + 1, mask=m, other=0.0)
        acc += b_t1.to(b_x.dtype).to(tl.float32) * tl.load(p_w + 1, mask=m, other=0.0).to(tl.float32)
    if W > 3:
        b_t2 = tl.load(p_s + 2, mask=m, other=0.0)
        acc += b_t2.to(b_x.dtype).to(tl.float32) * tl.load(p_w + 2, mask=m, other=0.0).to(tl.float32)
    acc = acc * tl.sigmoid(acc)
    tl.debug_barrier()  # every thread's slot reads are done before any of the shifted slot is stored
    b_new = b_x.to(b_t0.dtype)
    if W == 3:
        tl.store(p_s, b_t1, mask=m)
    if W == 4:
        tl.store(p_s, b_t1, mask=m)
        tl.store(p_s + 1, b_t2, mask=m)
    tl.store(p_s + W - 2, b_new, mask=m)
    return acc.to(b_x.dtype).to(tl.float32)


@triton.jit
def kda_layer_decode_prep_heads_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, W: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * cdiv(H, HB),): heads HB * j .. HB * j + HB - 1 of sequence i into ``heads`` [B * H, 4, BK]
    float32 (rows q (normalised, times ``scale``), k (normalised), decay, and beta in the first column; the rest of
    the beta row is left unwritten), which the block kernel reads with ``PREPPED``."""
    pdl_wait(PDL)
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
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    ch_q = o_h[:, None] * K + o_k[None, :]
    b_g = tl.load(g_raw + i_b * stride_g + ch_q, mask=m_hk, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + ch_q, mask=m_hk, other=0.0)
    b_rate = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    b_decay = tl.exp(kda_log_decay(b_g, b_rate[:, None], lower_bound, HAS_LOWER_BOUND))
    b_beta = tl.sigmoid(tl.load(beta_logits + i_b * stride_b + o_h, mask=m_h, other=0.0).to(tl.float32))
    p_h = heads + ((i_b * H + o_h) * (4 * BK))[:, None] + o_k[None, :]
    m_hr = m_h[:, None] & (o_k < BK)[None, :]
    b_q = _conv_heads(x_row, conv_w, cs_slot, ch_q, m_hk, W)
    b_q = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6))[:, None]  # one division per head
    tl.store(p_h, b_q, mask=m_hr)
    b_k = _conv_heads(x_row, conv_w, cs_slot, H * K + ch_q, m_hk, W)
    b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6))[:, None]
    tl.store(p_h + BK, b_k, mask=m_hr)
    tl.store(p_h + 2 * BK, b_decay, mask=m_hr)
    b_beta_row = tl.where((o_k == 0)[None, :], b_beta[:, None], 0.0)
    m_beta = m_h[:, None] & (o_k == 0)[None, :]  # the state kernels read the beta row's first column only
    tl.store(p_h + 3 * BK, b_beta_row, mask=m_beta)


@triton.jit
def kda_layer_decode_norm_heads_kernel(
    gate, norm_w, eps, out, stride_gate,
    H: tl.constexpr, V: tl.constexpr, BVF: tl.constexpr, HB: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * cdiv(H, HB),): the gated RMSNorm of HB heads' output rows of one sequence, in place (each
    row's reduction reads the whole row before any of it is stored)."""
    pdl_wait(PDL)
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
    b_o = b_o * (1.0 / tl.sqrt(tl.sum(b_o * b_o, 1) / V + eps))[:, None]
    b_o = b_o * b_w[None, :] * tl.sigmoid(b_gate)
    tl.debug_barrier()
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m)


def prep_heads_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb, state_slots,
                      heads: torch.Tensor, sizes: dict, has_lower_bound: bool, prep_heads: int, num_warps: int,
                      pdl: dict) -> None:
    """The prep launch, ``prep_heads`` heads of one sequence per program (``pdl``: ``launch.pdl_options``)."""
    B, H = qkv.shape[0], sizes["H"]
    sizes = {n: v for n, v in sizes.items() if n != "BW"}
    kda_layer_decode_prep_heads_kernel[(B * cdiv(H, prep_heads),)](
        qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb, state_slots, heads,
        qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), sizes["K"] ** -0.5, **sizes,
        HAS_LOWER_BOUND=has_lower_bound, HB=prep_heads, num_warps=num_warps, **pdl)


def norm_heads_launch(gate, norm_weight, eps: float, out: torch.Tensor, norm_heads: int, num_warps: int,
                      pdl: dict) -> None:
    """The norm launch, ``norm_heads`` heads of one sequence per program."""
    B, H, V = out.shape
    kda_layer_decode_norm_heads_kernel[(B * cdiv(H, norm_heads),)](
        gate, norm_weight, float(eps), out, gate.stride(0), H=H, V=V, BVF=next_power_of_2(V), HB=norm_heads,
        num_warps=num_warps, **pdl)

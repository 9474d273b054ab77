"""The ReplaySSM verify step of one KDA layer, fused: every token of a sequence's short run (the fed token and
its drafts) through the decode update from the committed checkpoint, which is read and never written.

One program per (sequence, head, block of ``BV`` value columns) loads the checkpoint's state block into registers
and loops over the sequence's tokens. Per token it does what the decode kernel's block layout does for one
(decode.py: the same helpers, in the same order): the causal conv with SiLU, whose window is the committed conv
slot followed by the sequence's earlier tokens in this run (read from ``qkv``, since the slot is not shifted),
the gate, beta and the q/k L2 norm, then the delta-rule step; the new state is rounded to the state's dtype each
step, as the decode kernel's store and reload round it. So the outputs are, bit for bit, those of the decode
kernel stepped token by token, and the working state dies with the program. Each token's ring entry (its raw
q|k|v, k and v after the conv, log-decay and beta: ``flashinfra.model.replay.ReplayRing``) is written for the
fold, which replays the accepted entries onto the checkpoint. A second launch applies the gated RMSNorm to each
(token, head) output row, as the decode's single-sequence norm launch does.

The ring's ``R`` entries per slot bound a sequence's run; the caller checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda.common import conv_slot, state_step_store, state_tile
from flashinfra.kernels.kda.decode import gated_norm, head_gate_beta, head_qk_norm
from flashinfra.kernels.launch import cdiv, next_power_of_2

# the decode kernel's single-sequence block layout: [K, 32] state blocks on 2 warps
BV_VERIFY, VERIFY_WARPS, NORM_WARPS = 32, 2, 4


@triton.jit
def window_conv_silu(qkv, stride_x, t, i, w, cs_slot, ch, m, W: tl.constexpr):
    """``decode.conv_silu`` of the run's token ``i`` (row ``t`` of ``qkv``) on channels ``ch``: tap ``j`` reads the
    token ``W - 1 - j`` back, from ``qkv`` while it lies in the run, else from the committed slot's column
    ``i + j``. Same products and sum order as the decode kernel's."""
    b_x = tl.load(qkv + t * stride_x + ch, mask=m, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(w + ch * W + W - 1, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        p = i - (W - 1) + j  # the tap's token, relative to the run's first
        in_run = (tl.zeros_like(ch) + p) >= 0
        b_r = tl.load(qkv + (t - i + tl.maximum(p, 0)) * stride_x + ch, mask=m & in_run, other=0.0)
        b_c = tl.load(cs_slot + ch * (W - 1) + tl.minimum(i + j, W - 2), mask=m & ~in_run, other=0.0)
        b_h = tl.where(in_run, b_r, b_c.to(b_x.dtype)).to(tl.float32)
        acc += b_h * tl.load(w + ch * W + j, mask=m, other=0.0).to(tl.float32)
    acc = acc * tl.sigmoid(acc)
    return acc.to(b_x.dtype).to(tl.float32)


@triton.jit
def kda_layer_verify_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, state_slots, cu_seqlens, out,
    ring_x, ring_k, ring_v, ring_g, ring_beta, stride_x, stride_g, stride_b, scale, R,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, W: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr,
):
    """Grid (cdiv(V, BV), B * H): one [K, BV] state block stepped over the sequence's tokens; each token's
    unnormalised output block (rounded to out's dtype) and its ring entry: the v channels of the block by every
    program, the head's q/k channels, k, log-decay and beta by the head's first block."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    n = tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    ch_q, ch_k, ch_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_h * V + o_v
    first = i_v == 0
    for i in range(0, n):
        t = bos + i
        e = slot * R + i  # the token's ring entry
        b_q = window_conv_silu(qkv, stride_x, t, i, conv_w, cs_slot, ch_q, m_k, W)
        b_k = window_conv_silu(qkv, stride_x, t, i, conv_w, cs_slot, ch_k, m_k, W)
        b_v = window_conv_silu(qkv, stride_x, t, i, conv_w, cs_slot, ch_v, m_v, W)
        b_g, b_beta = head_gate_beta(g_raw + t * stride_g, dt_bias, A_log, beta_logits + t * stride_b + i_h,
                                     lower_bound, i_h, o_k, m_k, K, HAS_LOWER_BOUND)
        p_x = ring_x + e * (2 * H * K + H * V)
        tl.store(p_x + ch_v, tl.load(qkv + t * stride_x + ch_v, mask=m_v), mask=m_v)
        tl.store(ring_v + (e * H + i_h) * V + o_v, b_v.to(ring_v.dtype.element_ty), mask=m_v)
        if first:
            tl.store(p_x + ch_q, tl.load(qkv + t * stride_x + ch_q, mask=m_k), mask=m_k)
            tl.store(p_x + ch_k, tl.load(qkv + t * stride_x + ch_k, mask=m_k), mask=m_k)
            tl.store(ring_k + (e * H + i_h) * K + o_k, b_k.to(ring_k.dtype.element_ty), mask=m_k)
            tl.store(ring_g + (e * H + i_h) * K + o_k, b_g, mask=m_k)
            tl.store(ring_beta + e * H + i_h, b_beta)
        b_q, b_k = head_qk_norm(b_q, b_k, scale)
        b_s = state_step_store(b_s, b_q, b_k, tl.exp(b_g), b_beta, b_v, out + (t * H + i_h) * V, o_v, m_v)
        b_s = b_s.to(state.dtype.element_ty).to(tl.float32)  # the decode kernel's store and reload


@triton.jit
def kda_layer_verify_norm_kernel(gate, norm_w, eps, out, stride_gate, H: tl.constexpr, V: tl.constexpr,
                                 BVF: tl.constexpr):
    """Grid (T * H,): the gated RMSNorm of one (token, head) output row in place."""
    i_th = tl.program_id(0)
    i_t, i_h = i_th // H, i_th % H
    gated_norm(out + i_th * V, gate + i_t * stride_gate + i_h * V, norm_w, eps, V, BVF)


def _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, ring, state_slots, cu_seqlens):
    if state.dim() != 4 or not state.is_contiguous():
        raise ValueError(f"kda_layer_verify: state must be contiguous [slots, H, K, V], got {tuple(state.shape)}")
    T = qkv.shape[0]
    H, K, V = state.shape[1:]
    C, W = conv_weight.shape
    S, R = state.shape[0], ring.x.shape[1]
    problems = []
    if qkv.dim() != 2 or qkv.shape[1] != 2 * H * K + H * V or qkv.stride(1) != 1:
        problems.append(f"qkv {tuple(qkv.shape)}")
    if C != qkv.shape[1] or not 2 <= W <= 4 or conv_state.shape != (S, C, W - 1) or not conv_state.is_contiguous():
        problems.append(f"conv_weight {tuple(conv_weight.shape)} conv_state {tuple(conv_state.shape)}")
    if g_raw.shape != (T, H * K) or g_raw.stride(1) != 1 or beta_logits.shape != (T, H) or beta_logits.stride(1) != 1:
        problems.append(f"g_raw {tuple(g_raw.shape)} beta_logits {tuple(beta_logits.shape)}")
    if gate.shape != (T, H * V) or gate.stride(1) != 1:
        problems.append(f"gate {tuple(gate.shape)}")
    want = dict(x=(S, R, C), k=(S, R, H, K), v=(S, R, H, V), g=(S, R, H, K), beta=(S, R, H))
    for name, shape in want.items():
        t = getattr(ring, name)
        if t.shape != shape or not t.is_contiguous():
            problems.append(f"ring.{name} {tuple(t.shape)} (want contiguous {shape})")
    if ring.g.dtype != torch.float32 or ring.beta.dtype != torch.float32:
        problems.append("ring.g and ring.beta must be float32")
    if cu_seqlens.shape != (state_slots.shape[0] + 1,):
        problems.append(f"state_slots {tuple(state_slots.shape)} cu_seqlens {tuple(cu_seqlens.shape)}")
    if problems:
        raise ValueError(f"kda_layer_verify: H={H} K={K} V={V}, bad shapes: " + "; ".join(problems))


def kda_layer_verify_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                            norm_weight, eps, state, ring, state_slots: torch.Tensor, cu_seqlens: torch.Tensor,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``kda_layer_verify``: ``state_slots`` [B] and ``cu_seqlens`` [B + 1] int tensors on qkv's device;
    a sequence's length must not exceed the ring's entries (not checked here: it would read the host)."""
    _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, ring, state_slots, cu_seqlens)
    T = qkv.shape[0]
    H, K, V = state.shape[1:]
    if out is None:
        out = torch.empty((T, H, V), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (T, H, V) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"kda_layer_verify: out must be contiguous [{T}, {H}, {V}] {qkv.dtype}")
    B = state_slots.shape[0]
    if T == 0 or B == 0:
        return out
    BVF = next_power_of_2(V)
    BV = min(BV_VERIFY, BVF)
    kda_layer_verify_kernel[(cdiv(V, BV), B * H)](
        qkv, conv_weight, conv_state, g_raw, beta_logits, A_log.contiguous(), dt_bias.float().contiguous(),
        float(lower_bound) if lower_bound is not None else 0.0, state, state_slots, cu_seqlens, out,
        ring.x, ring.k, ring.v, ring.g, ring.beta, qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), K**-0.5,
        ring.x.shape[1], H=H, K=K, V=V, BK=next_power_of_2(K), BV=BV, W=conv_weight.shape[1],
        HAS_LOWER_BOUND=lower_bound is not None, num_warps=VERIFY_WARPS)
    kda_layer_verify_norm_kernel[(T * H,)](gate, norm_weight.contiguous(), float(eps), out, gate.stride(0), H=H, V=V,
                                           BVF=BVF, num_warps=NORM_WARPS)
    return out

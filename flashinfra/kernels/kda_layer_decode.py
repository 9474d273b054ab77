"""The whole decode step of one KDA layer between its input and output projections, in one pass.

Per sequence (one new token) and head: the causal conv update with SiLU over the head's q, k and v
channels (the conv slot read and shifted in place), the forget gate with its lower bound, beta, the q/k
L2 norm, the delta-rule step on the recurrent state (read from and written back to its slot in place)
and the gated RMSNorm of the output. The unfused path runs ``causal_conv1d_decode``, ``kda_gate``,
``sigmoid``, ``kda_decode`` and the gated norm as separate ops, each reading and writing memory; here
the only traffic is the inputs, the output (written, read back for the norm, written again) and the two
slots. Measured on an H200 in bench/notes/kda_decode.md (77% of copy bandwidth at B=64 with fp32 state).

The reference ``kda_layer_decode_ref`` is that unfused composition; the kernel rounds where it rounds
(conv output and recurrence output to the activation dtype) so both agree to that dtype's precision.
The recurrent state may be float32 or bfloat16 (half the bytes; rounded once per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.causal_conv1d import causal_conv1d_decode_ref
from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.kda_decode import kda_decode_ref
from flashinfra.kernels.kda_gate import kda_gate_ref
from flashinfra.kernels.norms import gated_rms_norm_ref


def kda_layer_decode_ref(
    qkv: torch.Tensor,  # [B, H*K + H*K + H*V] q|k|v before the conv, one token per sequence
    conv_weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    g_raw: torch.Tensor,  # [B, H*K] f_b(f_a(x)) before the bias
    beta_logits: torch.Tensor,  # [B, H]
    gate: torch.Tensor,  # [B, H*V] output gate, before its sigmoid
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H*K]
    lower_bound: float | None,
    norm_weight: torch.Tensor,  # [V]
    eps: float,
    state: torch.Tensor,  # [num_slots, H, K, V], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, H, V] in qkv's dtype
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    y = causal_conv1d_decode_ref(qkv, conv_weight, conv_state, state_slots)
    q, k, v = y[:, : H * K].view(B, H, K), y[:, H * K : 2 * H * K].view(B, H, K), y[:, 2 * H * K :].view(B, H, V)
    g = kda_gate_ref(g_raw.view(B, H, K), A_log, dt_bias, lower_bound)
    o = kda_decode_ref(q, k, v, g, torch.sigmoid(beta_logits.float()), state, state_slots)
    return gated_rms_norm_ref(o, gate.view(B, H, V), norm_weight, eps)


@triton.jit
def _conv_silu(x_row, w, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """Conv + SiLU of one token on channels ``ch`` (the slot is only read), float32, rounded through x's
    dtype as the unfused conv output is."""
    o_j = tl.arange(0, BW)
    mm = m[:, None] & (o_j < W - 1)[None, :]
    b_h = tl.load(cs_slot + ch[:, None] * (W - 1) + o_j[None, :], mask=mm, other=0.0)
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    b_w = tl.load(w + ch[:, None] * W + o_j[None, :], mask=mm, other=0.0).to(tl.float32)
    b_wl = tl.load(w + ch * W + W - 1, mask=m, other=0.0).to(tl.float32)
    acc = tl.sum(b_h.to(b_x.dtype).to(tl.float32) * b_w, 1) + b_x.to(tl.float32) * b_wl
    acc = acc * tl.sigmoid(acc)
    return acc.to(b_x.dtype).to(tl.float32)


@triton.jit
def _conv_shift(x_row, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """Shift the token into the slot of channels ``ch``: new column j is old column j + 1, the last is x."""
    o_j = tl.arange(0, BW)
    mm = m[:, None] & (o_j < W - 1)[None, :]
    p_s = cs_slot + ch[:, None] * (W - 1) + o_j[None, :]
    b_next = tl.load(p_s + 1, mask=mm & (o_j < W - 2)[None, :], other=0.0)
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    b_next = tl.where((o_j == W - 2)[None, :], b_x[:, None].to(b_next.dtype), b_next)
    tl.debug_barrier()
    tl.store(p_s, b_next, mask=mm)


@triton.jit
def kda_layer_decode_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound, norm_w, eps,
    state, state_slots, out,
    stride_x, stride_g, stride_b, stride_gate, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    """Grid (B * H,). One program per head: it walks the head's state in [K, BV] blocks (the next block's
    load issued before the current block's arithmetic, so a block's memory latency hides behind the
    previous one), keeping the register footprint of one block while the RMSNorm still sees the whole
    output. The unnormalised output goes through ``out`` (rounded to its dtype, as the unfused path rounds
    it before the norm); the conv slot is shifted last, after every read of it."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BV)
    m_k = o_k < K
    p_s0 = state + (slot * H + i_h) * K * V + o_k[:, None] * V
    # The first state block goes first: it is the big load, and nothing it needs comes from the conv.
    b_s = tl.load(p_s0 + o_b[None, :], mask=m_k[:, None] & (o_b < V)[None, :], other=0.0).to(tl.float32)
    C = 2 * H * K + H * V
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * C * (W - 1)
    b_q = _conv_silu(x_row, conv_w, cs_slot, i_h * K + o_k, m_k, W, BW)
    b_k = _conv_silu(x_row, conv_w, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)
    b_g = tl.load(g_raw + i_b * stride_g + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    b_rate = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    if HAS_LOWER_BOUND:
        b_g = lower_bound * tl.sigmoid(b_rate * b_g)
    else:
        b_g = -b_rate * tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(b_g)))
    b_decay = tl.exp(b_g)
    b_beta = tl.sigmoid(tl.load(beta_logits + i_b * stride_b + i_h).to(tl.float32))
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_ss = tl.zeros([BV], dtype=tl.float32)  # per-lane partial sums of o^2
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + o_b
        m_v = o_v < V
        m_n = (o_v + BV) < V
        b_next = tl.load(p_s0 + (o_v + BV)[None, :], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_v = _conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W, BW)
        b_s = b_s * b_decay[:, None]
        b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        tl.store(p_s0 + o_v[None, :], b_s.to(state.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
        b_o = tl.sum(b_s * b_q[:, None], 0).to(out.dtype.element_ty)
        tl.store(out + i_bh * V + o_v, b_o, mask=m_v)
        b_o = b_o.to(tl.float32)
        b_ss += tl.where(m_v, b_o * b_o, 0.0)
        b_s = b_next.to(tl.float32)
    tl.debug_barrier()  # this program's own output stores are read back below, by other threads
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    b_o = tl.load(out + i_bh * V + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = b_o / tl.sqrt(tl.sum(b_ss) / V + eps)
    b_gate = tl.load(gate + i_b * stride_gate + i_h * V + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = b_o * tl.load(norm_w + o_f, mask=m_f, other=0.0).to(tl.float32) * tl.sigmoid(b_gate)
    tl.debug_barrier()
    tl.store(out + i_bh * V + o_f, b_o.to(out.dtype.element_ty), mask=m_f)
    _conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
    _conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)
    _conv_shift(x_row, cs_slot, 2 * H * K + i_h * V + o_f, m_f, W, BW)


def kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                            norm_weight, eps, state, state_slots, BV: int | None = None, num_warps: int = 4,
                            out: torch.Tensor | None = None):
    B = qkv.shape[0]
    if state.dim() != 4 or not state.is_contiguous():
        raise ValueError(f"kda_layer_decode: state must be contiguous [slots, H, K, V], got {tuple(state.shape)}")
    H, K, V = state.shape[1:]
    C, W = conv_weight.shape
    problems = []
    if qkv.dim() != 2 or qkv.shape[1] != 2 * H * K + H * V or qkv.stride(1) != 1:
        problems.append(f"qkv {tuple(qkv.shape)} (want [B, {2 * H * K + H * V}], contiguous channels)")
    if C != 2 * H * K + H * V or W < 2:
        problems.append(f"conv_weight {tuple(conv_weight.shape)}")
    if conv_state.shape[1:] != (C, W - 1) or not conv_state.is_contiguous():
        problems.append(f"conv_state {tuple(conv_state.shape)}")
    if g_raw.shape != (B, H * K) or g_raw.stride(1) != 1:
        problems.append(f"g_raw {tuple(g_raw.shape)}")
    if beta_logits.shape != (B, H) or beta_logits.stride(1) != 1:
        problems.append(f"beta_logits {tuple(beta_logits.shape)}")
    if gate.shape != (B, H * V) or gate.stride(1) != 1:
        problems.append(f"gate {tuple(gate.shape)}")
    if A_log.shape != (H,) or dt_bias.shape != (H * K,) or norm_weight.shape != (V,):
        problems.append(f"A_log {tuple(A_log.shape)} dt_bias {tuple(dt_bias.shape)} norm_weight {tuple(norm_weight.shape)}")
    if state_slots.shape != (B,):
        problems.append(f"state_slots {tuple(state_slots.shape)}")
    if problems:
        raise ValueError(f"kda_layer_decode: H={H} K={K} V={V}, bad shapes: " + "; ".join(problems))
    if out is None:
        out = torch.empty((B, H, V), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (B, H, V) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"kda_layer_decode: out must be contiguous [{B}, {H}, {V}] {qkv.dtype}")
    if B == 0:
        return out
    BVF = triton.next_power_of_2(V)
    BV = min(BV or 32, BVF)
    kda_layer_decode_kernel[(B * H,)](
        qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log.contiguous(), dt_bias.float().contiguous(),
        float(lower_bound) if lower_bound is not None else 0.0, norm_weight.contiguous(), float(eps),
        state, state_slots, out,
        qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), gate.stride(0), K**-0.5,
        H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, BVF=BVF, W=W,
        BW=triton.next_power_of_2(W - 1), HAS_LOWER_BOUND=lower_bound is not None, num_warps=num_warps,
    )
    return out


def kda_layer_decode(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                     norm_weight, eps, state, state_slots):
    if use_triton(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, state_slots):
        return kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                       lower_bound, norm_weight, eps, state, state_slots)
    return kda_layer_decode_ref(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                lower_bound, norm_weight, eps, state, state_slots)

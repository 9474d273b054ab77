"""The whole decode step of one KDA layer between its input and output projections, fused.

Per sequence (one new token) and head: the causal conv update with SiLU over the head's q, k and v
channels (the conv slot read and shifted in place), the forget gate with its lower bound, beta, the q/k
L2 norm, the delta-rule step on the recurrent state (read from and written back to its slot in place)
and the gated RMSNorm of the output. The unfused path runs ``causal_conv1d_decode``, ``kda_gate``,
``sigmoid``, ``kda_decode`` and the gated norm as separate ops, each reading and writing memory; here
the only traffic is the inputs, the output (written, read back for the norm, written again) and the two
slots.

Two kernel layouts, chosen per batch size and state dtype by ``decode_config`` (measured on an H200 in
bench/notes/kda_decode.md):
- ``"block"``: one program per (sequence, head, block of ``BV`` value columns), so many state loads are in
  flight at once, then a second small launch per (sequence, head) for the gated RMSNorm (it needs the
  head's whole output) and the q/k conv shift (every V block of the head reads those channels first).
  Stream order between the launches replaces any synchronisation between programs.
- ``"prep"``: the block layout with the head's q/k conv, L2 norms, gate and beta computed once per
  (sequence, head) by a first small launch (which also shifts the q/k conv slot) into a float32 scratch, so
  the state programs do only the recurrence and the v conv; three launches (the default from B=2).
- ``"head"``: one launch, one program per (sequence, head) walking its state in ``BV``-column blocks with
  the next block's load issued before the current block's arithmetic.

The reference ``kda_layer_decode_ref`` is that unfused composition; the kernels round where it rounds
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
from flashinfra.kernels.kda_gate import kda_gate_ref, kda_log_decay
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
def _conv_silu(x_row, w, cs_slot, ch, m, W: tl.constexpr):
    """Conv + SiLU of one token on channels ``ch`` (the slot is only read), float32, rounded through x's
    dtype as the unfused conv output is. One 1-D load per tap, so the result comes in the vector layout the
    state block's rows take, not that of a [channels, taps] tile (which made the compiler move the whole
    state block between layouts through shared memory)."""
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(w + ch * W + W - 1, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        b_h = tl.load(cs_slot + ch * (W - 1) + j, mask=m, other=0.0).to(b_x.dtype).to(tl.float32)
        acc += b_h * tl.load(w + ch * W + j, mask=m, other=0.0).to(tl.float32)
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
def _head_inputs(x_row, conv_w, cs_slot, g_row, dt_bias, A_log, beta_ptr, lower_bound, i_h, o_k, m_k, scale,
                 H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """The head's normalised q (times ``scale``) and k after the conv, its per-channel decay and beta."""
    b_q = _conv_silu(x_row, conv_w, cs_slot, i_h * K + o_k, m_k, W)
    b_k = _conv_silu(x_row, conv_w, cs_slot, H * K + i_h * K + o_k, m_k, W)
    b_g = tl.load(g_row + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    b_g = kda_log_decay(b_g, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, HAS_LOWER_BOUND)
    b_beta = tl.sigmoid(tl.load(beta_ptr).to(tl.float32))
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k, tl.exp(b_g), b_beta


@triton.jit
def _step(b_s, b_q, b_k, b_decay, b_beta, b_v):
    """One delta-rule step on a [K, BV] state block: the new block and its [BV] output."""
    b_s = b_s * b_decay[:, None]
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], 0)


@triton.jit
def _gated_norm(o_row, gate_row, norm_w, eps, V: tl.constexpr, BVF: tl.constexpr):
    """Gated RMSNorm of one head's output row in place (the row holds the recurrence output, rounded)."""
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    b_o = tl.load(o_row + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = b_o / tl.sqrt(tl.sum(b_o * b_o) / V + eps)
    b_gate = tl.load(gate_row + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = b_o * tl.load(norm_w + o_f, mask=m_f, other=0.0).to(tl.float32) * tl.sigmoid(b_gate)
    tl.debug_barrier()
    tl.store(o_row + o_f, b_o.to(o_row.dtype.element_ty), mask=m_f)


@triton.jit
def kda_layer_decode_head_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound, norm_w, eps,
    state, state_slots, out,
    stride_x, stride_g, stride_b, stride_gate, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    """Grid (B * H,). One program per head walks the head's state in [K, BV] blocks (the next block's load
    issued before the current block's arithmetic), keeping the register footprint of one block while the
    RMSNorm still sees the whole output. The unnormalised output goes through ``out`` (rounded to its dtype,
    as the unfused path rounds it before the norm); the conv slot is shifted last, after every read of it."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BV)
    m_k = o_k < K
    p_s0 = state + (slot * H + i_h) * K * V + o_k[:, None] * V
    # The first state block goes first: it is the big load, and nothing it needs comes from the conv.
    b_s = tl.load(p_s0 + o_b[None, :], mask=m_k[:, None] & (o_b < V)[None, :], other=0.0).to(tl.float32)
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    b_q, b_k, b_decay, b_beta = _head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                             beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k, scale,
                                             H, K, W, BW, HAS_LOWER_BOUND)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + o_b
        m_v = o_v < V
        m_n = (o_v + BV) < V
        b_next = tl.load(p_s0 + (o_v + BV)[None, :], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_v = _conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W)
        b_s, b_o = _step(b_s, b_q, b_k, b_decay, b_beta, b_v)
        tl.store(p_s0 + o_v[None, :], b_s.to(state.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
        tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        b_s = b_next.to(tl.float32)
    tl.debug_barrier()  # this program's own output stores are read back below, by other threads
    _gated_norm(out + i_bh * V, gate + i_b * stride_gate + i_h * V, norm_w, eps, V, BVF)
    _conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
    _conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)
    _conv_shift(x_row, cs_slot, 2 * H * K + i_h * V + tl.arange(0, BVF), tl.arange(0, BVF) < V, W, BW)


@triton.jit
def kda_layer_decode_block_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, state_slots, out, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, PREPPED: tl.constexpr,
):
    """Grid (cdiv(V, BV), B * H): the recurrence of one [K, BV] state block, its unnormalised output
    (rounded to out's dtype) and the shift of its own v channels' conv slot (no other program reads
    them). The head's q, k, decay and beta are either recomputed by each V block (q/k conv and gate, a
    few KB from L2) or, with ``PREPPED``, read from ``heads`` as the prep kernel wrote them."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # issued first: the big load
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    if PREPPED:
        p_h = heads + i_bh * 4 * BK + o_k
        b_q, b_k, b_decay = tl.load(p_h), tl.load(p_h + BK), tl.load(p_h + 2 * BK)
        b_beta = tl.load(heads + i_bh * 4 * BK + 3 * BK)
    else:
        b_q, b_k, b_decay, b_beta = _head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                                 beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k,
                                                 scale, H, K, W, BW, HAS_LOWER_BOUND)
    b_v = _conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W)
    b_s, b_o = _step(b_s, b_q, b_k, b_decay, b_beta, b_v)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)
    _conv_shift(x_row, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W, BW)


@triton.jit
def kda_layer_decode_norm_kernel(
    qkv, conv_state, gate, norm_w, eps, state_slots, out, stride_x, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, SHIFT_QK: tl.constexpr,
):
    """Grid (B * H,), after the block kernel: the head's gated RMSNorm and, unless the prep kernel did it,
    its q/k conv shift."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    _gated_norm(out + i_bh * V, gate + i_b * stride_gate + i_h * V, norm_w, eps, V, BVF)
    if SHIFT_QK:
        _conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
        _conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)


@triton.jit
def kda_layer_decode_prep_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr,
):
    """Grid (B * H,), before the block kernel: the head's q, k (conv, L2 norm, scale), decay and beta, once,
    into ``heads`` [B * H, 4, BK] float32 (rows q, k, decay, then beta in the first column), and the q/k
    conv shift (this program is the only reader of those channels)."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    b_q, b_k, b_decay, b_beta = _head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                             beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k, scale,
                                             H, K, W, BW, HAS_LOWER_BOUND)
    p_h = heads + i_bh * 4 * BK + o_k
    tl.store(p_h, tl.where(m_k, b_q, 0.0))
    tl.store(p_h + BK, tl.where(m_k, b_k, 0.0))
    tl.store(p_h + 2 * BK, b_decay)
    tl.store(p_h + 3 * BK, tl.where(o_k == 0, b_beta, 0.0))
    _conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
    _conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)


def decode_config(B: int, state_dtype: torch.dtype) -> dict:
    """Kernel layout, V block and warps per batch size and state dtype: the fastest of the variants timed in
    a CUDA graph on an H200 at B=1, 16, 64, 256 (H=64, K=V=128; bench/results/kda_decode.json). At B=1 the
    block layout ([K, 32] on 2 warps) wins: the prep launch costs more than the head work it saves for one
    sequence. From B=16 the prep layout wins in both dtypes (fp32 state: [K, 64] blocks on 4 warps; bf16
    state: [K, 32] on 2 warps, 15-17% faster than the block layout at B=64 and 256)."""
    if B <= 1:
        return dict(grid="block", BV=32, num_warps=2)
    if state_dtype == torch.float32:
        return dict(grid="prep", BV=64, num_warps=4)
    return dict(grid="prep", BV=32, num_warps=2)


def _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, norm_weight, state,
                state_slots):
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


def kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                            norm_weight, eps, state, state_slots, grid: str | None = None, BV: int | None = None,
                            num_warps: int | None = None, out: torch.Tensor | None = None):
    """``grid``, ``BV`` and ``num_warps`` left out come from ``decode_config``."""
    _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, norm_weight, state,
                state_slots)
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    W = conv_weight.shape[1]
    if out is None:
        out = torch.empty((B, H, V), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (B, H, V) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"kda_layer_decode: out must be contiguous [{B}, {H}, {V}] {qkv.dtype}")
    cfg = decode_config(B, state.dtype)
    grid, num_warps = grid or cfg["grid"], num_warps or cfg["num_warps"]
    if grid not in ("block", "prep", "head"):
        raise ValueError(f"kda_layer_decode: grid must be 'block', 'prep' or 'head', got {grid!r}")
    if B == 0:
        return out
    BVF = triton.next_power_of_2(V)
    BV = min(BV or cfg["BV"], BVF)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    A_log, dt_bias, norm_weight = A_log.contiguous(), dt_bias.float().contiguous(), norm_weight.contiguous()
    sizes = dict(H=H, K=K, V=V, BK=triton.next_power_of_2(K), W=W, BW=triton.next_power_of_2(W - 1))
    if grid == "head":
        kda_layer_decode_head_kernel[(B * H,)](
            qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lb, norm_weight, float(eps),
            state, state_slots, out, qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), gate.stride(0), K**-0.5,
            **sizes, BV=BV, BVF=BVF, HAS_LOWER_BOUND=lower_bound is not None, num_warps=num_warps,
        )
        return out
    head_args = (qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb)
    strides = (qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), K**-0.5)
    prepped = grid == "prep"
    heads = torch.empty((B * H, 4, sizes["BK"]) if prepped else (1,), dtype=torch.float32, device=qkv.device)
    if prepped:
        kda_layer_decode_prep_kernel[(B * H,)](*head_args, state_slots, heads, *strides, **sizes,
                                               HAS_LOWER_BOUND=lower_bound is not None, num_warps=4)
    kda_layer_decode_block_kernel[(triton.cdiv(V, BV), B * H)](
        *head_args, state, state_slots, out, heads, *strides,
        **sizes, BV=BV, HAS_LOWER_BOUND=lower_bound is not None, PREPPED=prepped, num_warps=num_warps,
    )
    kda_layer_decode_norm_kernel[(B * H,)](
        qkv, conv_state, gate, norm_weight, float(eps), state_slots, out, qkv.stride(0), gate.stride(0),
        **sizes, BVF=BVF, SHIFT_QK=not prepped, num_warps=4,
    )
    return out


def kda_layer_decode(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                     norm_weight, eps, state, state_slots):
    if use_triton(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, state_slots):
        return kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                       lower_bound, norm_weight, eps, state, state_slots)
    return kda_layer_decode_ref(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                lower_bound, norm_weight, eps, state, state_slots)

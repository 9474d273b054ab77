"""Triton pieces shared by the KDA decode kernels (``kda_layer_decode``, ``kda_layer_decode_prep``,
``kda_layer_decode_stream``; the state's addressing and read also by the bare recurrence, ``kda_decode``, and the
v2 prefill, ``kda_prefill_split``): where a sequence's slot keeps its state and conv taps, the conv update of a
token on a set of channels, a head's normalised q/k with its decay and beta, the read of a state block to be
updated in place, one delta-rule step on a [K, BV] state block (for a bf16 block, optionally with its two sums
over K as one tensor-core product), and the gated RMSNorm of a head's output row."""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.gate import kda_log_decay


@triton.jit
def state_tile(state, slot, i_h, o_k, o_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointers and mask of head ``i_h``'s state block at rows ``o_k`` and columns ``o_v`` in ``slot`` (int64):
    each slot holds H [K, V] states, row-major."""
    p = state + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    return p, (o_k < K)[:, None] & (o_v < V)[None, :]


@triton.jit
def conv_slot(conv_state, slot, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr):
    """A sequence's conv slot (``slot`` int64): the last W - 1 inputs of its 2 H K + H V channels (q, k, then v),
    [channels, W - 1]."""
    return conv_state + slot * (2 * H * K + H * V) * (W - 1)


@triton.jit
def conv_silu(x_row, w, cs_slot, ch, m, W: tl.constexpr):
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
def conv_shift(x_row, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """Shift the token into the slot of channels ``ch``: new column j is old column j + 1, the last is x."""
    b_next = conv_shift_load(x_row, cs_slot, ch, m, W, BW)
    tl.debug_barrier()
    conv_shift_store(cs_slot, ch, m, b_next, W, BW)


@triton.jit
def conv_shift_load(x_row, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """The shifted slot of channels ``ch`` as ``conv_shift_store`` writes it ([channels, BW]), read early: a
    program that loads it beside its other inputs and stores it at its end (after a barrier, as every thread's
    reads of the slot must come first) saves the round trip that a load just before the store would wait."""
    o_j = tl.arange(0, BW)
    mm = m[:, None] & (o_j < W - 2)[None, :]
    b_next = tl.load(cs_slot + ch[:, None] * (W - 1) + o_j[None, :] + 1, mask=mm, other=0.0)
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    return tl.where((o_j == W - 2)[None, :], b_x[:, None].to(b_next.dtype), b_next)


@triton.jit
def conv_shift_store(cs_slot, ch, m, b_next, W: tl.constexpr, BW: tl.constexpr):
    """Store the shifted slot that ``conv_shift_load`` read (after a barrier)."""
    o_j = tl.arange(0, BW)
    tl.store(cs_slot + ch[:, None] * (W - 1) + o_j[None, :], b_next, mask=m[:, None] & (o_j < W - 1)[None, :])


@triton.jit
def head_inputs(x_row, conv_w, cs_slot, g_row, dt_bias, A_log, beta_ptr, lower_bound, i_h, o_k, m_k, scale,
                 H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """The head's normalised q (times ``scale``) and k after the conv, its per-channel decay and beta."""
    b_q = conv_silu(x_row, conv_w, cs_slot, i_h * K + o_k, m_k, W)
    b_k = conv_silu(x_row, conv_w, cs_slot, H * K + i_h * K + o_k, m_k, W)
    b_g = tl.load(g_row + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    b_g = kda_log_decay(b_g, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, HAS_LOWER_BOUND)
    b_beta = tl.sigmoid(tl.load(beta_ptr).to(tl.float32))
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k, tl.exp(b_g), b_beta


@triton.jit
def load_state(p, m, MASKED: tl.constexpr = True):
    """A state block, read to be written back in place by the same program (``store_state``; MASKED False: the
    block lies inside the state, no mask): kept in L2 as evict_last, so that the write-back finds its lines
    there. On an H200 (bench/notes/kda_decode.md, "The state read as evict_last") the bare fp32 recurrence at
    B=64 / 256 took 135.0 / 515.1 us this way against 137.9 / 533.5 without the hint (as fast as writing to
    another buffer; evict_first on the load 141.9 / 549.7)."""
    if MASKED:
        b = tl.load(p, mask=m, other=0.0, eviction_policy="evict_last")
    else:
        b = tl.load(p, eviction_policy="evict_last")
    return b


@triton.jit
def store_state(p, b_s, m, MASKED: tl.constexpr = True):
    """Write back, rounded to the state's dtype, the block that ``load_state`` read with the same mask. Without
    the masks (a block inside the state) the bare bf16 ``dot_sums`` program, [K, 64] on 4 warps, compiles to 760
    instructions and 83 registers against 808 and 96 (Triton 3.6, sm_90): 75.0 against 77.3 us at B=64 on an
    H200 (bench/notes/kda_decode.md, "The two sums on the tensor cores, timed")."""
    if MASKED:
        tl.store(p, b_s.to(p.dtype.element_ty), mask=m)
    else:
        tl.store(p, b_s.to(p.dtype.element_ty))


@triton.jit
def state_step(b_s, b_q, b_k, b_decay, b_beta, b_v):
    """One delta-rule step on a [K, BV] state block: the new block and its [BV] output."""
    b_s = b_s * b_decay[:, None]
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], 0)


@triton.jit
def gate_apply(b_y, gate_row, norm_w, o_v, m_v):
    """The gated RMSNorm's last step on a normalised output block at columns ``o_v``: times the norm weight and
    sigmoid(gate)."""
    b_gate = tl.load(gate_row + o_v, mask=m_v, other=0.0).to(tl.float32)
    return b_y * tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32) * tl.sigmoid(b_gate)


@triton.jit
def gated_norm(o_row, gate_row, norm_w, eps, V: tl.constexpr, BVF: tl.constexpr):
    """Gated RMSNorm of one head's output row in place (the row holds the recurrence output, rounded)."""
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    b_o = tl.load(o_row + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = gate_apply(b_o / tl.sqrt(tl.sum(b_o * b_o) / V + eps), gate_row, norm_w, o_f, m_f)
    tl.debug_barrier()
    tl.store(o_row + o_f, b_o.to(o_row.dtype.element_ty), mask=m_f)

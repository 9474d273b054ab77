"""Triton helpers shared by the KDA kernels: the gate's formula and the prefill's gate/beta tile load, where a
sequence's slot keeps its state and conv taps, a chunk's rows, and the bf16 product pieces of the 64-token prefill
(hi + lo pairs, products with bf16 operands, the fast ``exp2``, the L2 prefetch)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_log_decay(x, rate, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    """``kda_gate_ref`` on ``x = g_raw + dt_bias`` (float32) with ``rate = exp(A_log)``."""
    if HAS_LOWER_BOUND:
        return lower_bound * tl.sigmoid(rate * x)
    return -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t, stride_b_t,
                   K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                   BETA_LOGITS: tl.constexpr, G_MIN: tl.constexpr):
    """A head's log-decay (clamped below at ``G_MIN``, the chunk kernels' exactness bound) and beta for the
    token ``rows``, zero past the sequence's end; the gate and beta's sigmoid computed here from the raw
    projections (``GATE_IN_KERNEL``, ``BETA_LOGITS``) or read as given."""
    b_g = tl.load(g + rows[:, None] * stride_g_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_b = tl.load(beta + rows * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    if GATE_IN_KERNEL:
        b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        b_g = kda_log_decay(b_g, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, HAS_LOWER_BOUND)
    if BETA_LOGITS:
        b_b = tl.sigmoid(b_b)
    return tl.where(m_tk, tl.maximum(b_g, G_MIN), 0.0), tl.where(m_t, b_b, 0.0)


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
def state_step(b_s, b_q, b_k, b_decay, b_beta, b_v):
    """One delta-rule step on a [K, BV] state block: the new block and its [BV] output."""
    b_s = b_s * b_decay[:, None]
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], 0)


@triton.jit
def state_step_store(b_s, b_q, b_k, b_decay, b_beta, b_v, o_row, o_v, m_v):
    """``state_step`` with its output stored at ``o_row + o_v``, rounded to the output's dtype, unnormalised: the
    decode's and the verify's per-token epilogue. Returns the new block."""
    b_s, b_o = state_step(b_s, b_q, b_k, b_decay, b_beta, b_v)
    tl.store(o_row + o_v, b_o.to(o_row.dtype.element_ty), mask=m_v)
    return b_s


@triton.jit
def chunk_rows(cu_seqlens, chunk_indices, i_c, t_sub):
    """First row (absolute) of sub-block t_sub of chunk i_c, and the number of its sequence's rows left
    from there."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64 + t_sub * 16
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    return bos + t0, (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos - t0).to(tl.int32)


@triton.jit
def bf16_pair(x):
    """x as bf16 hi + lo parts, each rounded to nearest: hi + lo within 2^-17 of x."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def mma_bf16(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a b`` with bf16 operands; DOT_F32 (Triton's CPU interpreter, whose bf16 dot is wrong) widens
    them to float32 first."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def mm_bf16x3(a, b, DOT_F32: tl.constexpr):
    """``a b`` for float32 operands as three bf16 products (each operand a ``bf16_pair``, the lo x lo term left
    out): about 16 bits of each operand, against tf32x3's 21. A float32 accumulator becomes a bf16 operand without
    the shuffles a tf32 operand needs (the off-diagonal kernel's merge compiles to far fewer instructions than
    with tf32x3), with the final state's error unchanged."""
    ah, al = bf16_pair(a)
    bh, bl = bf16_pair(b)
    acc = mma_bf16(al, bh, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), DOT_F32)
    return mma_bf16(ah, bh, mma_bf16(ah, bl, acc, DOT_F32), DOT_F32)


@triton.jit
def mm_f32(a, b, P: tl.constexpr, DOT_F32: tl.constexpr):
    """``a b`` for float32 operands: Triton's ``input_precision`` P, or "bf16x3" (``mm_bf16x3``)."""
    if P == "bf16x3":
        return mm_bf16x3(a, b, DOT_F32)
    return tl.dot(a, b, input_precision=P)


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x log2(e))


@triton.jit
def exp2(x, FAST_EXP: tl.constexpr, PURE: tl.constexpr = True):
    """``2^x``; FAST_EXP: one MUFU.EX2 with results below 2^-126 flushed to zero (``tl.exp`` adds a range
    check and two multiplies to keep them). PURE=False keeps the instruction where it is written (the off-diagonal
    kernel's ``_exp2_rows``). The interpreter runs ``tl.math.exp2``: it has
    no PTX."""
    if FAST_EXP:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=PURE,
                                         pack=1)
    return tl.math.exp2(x)


@triton.jit
def prefetch_l2(p, nbytes: tl.constexpr):
    """Ask the L2 for ``nbytes`` bytes (a multiple of 16) at ``p`` (a scalar pointer, 16-byte aligned): one bulk
    prefetch (``cp.async.bulk.prefetch.L2``), from the program's first thread alone. It moves nothing into the
    program and waits for nothing. No PTX under the interpreter: the callers leave it out there."""
    tl.inline_asm_elementwise("{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
                              [p, tl.full([], nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_pair(p, x, LO: tl.constexpr, SLOT: tl.constexpr):
    """x rounded to bf16 at p; with LO also the remainder at p + SLOT (the next slot of a chunk-major scratch),
    so that hi + lo is within 2^-17 of x (``bf16_pair``)."""
    hi, lo = bf16_pair(x)
    tl.store(p, hi)
    if LO:
        tl.store(p + SLOT, lo)


@triton.jit
def load_rows(x, rows, m_tk, stride_t, o_k):
    """A [rows, K slice] tile in float32; x is the scalar base of the first row's head: the offsets stay
    int32 (tensors of 64-bit offsets would hold twice the registers)."""
    return tl.load(x + rows[:, None] * stride_t + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)

"""KDA prefill (v3), the state pass with the per-chunk tiles computed in it (``tiles="state"`` in
kda_prefill_v3.py): one sequential pass per (value block, sequence, head) that reads the inputs and the
in-chunk matrices ``Aqk`` and ``(I + L)^-1`` (from the split form's two kernels) and carries the state.

``kda_intra64_b_kernel`` writes per chunk and head 80 KB of bf16 pairs (w, qw, kd) and 64 KB of float32
(u, ou), which ``kda_state64_kernel`` reads back; here each chunk's tiles are formed in registers from
q, k, g, beta, v and the two [64, 64] matrices (about 100 KB per 64-token step at BV=64 instead of 112 KB
read plus 144 KB written and read by a kernel of its own), with the same products in ``LOCAL_PRECISION``
as kernel B:

    gc = cumsum(g), w = Ai (beta k exp(gc)), kd = k exp(gl - gc), qw = q exp(gc) - Aqk w,
    u = Ai (beta v), ou = Aqk u,

then as ``kda_state64_kernel``: ``v' = u - w S``, ``o = ou + qw S``, ``S = exp(gl) S + kd^T v'``, the
products that carry S in the chain precision (w, kd, S and v' split into bf16 hi + lo in registers for
bf16x3; w and kd one bf16 each for bf16x2), the output product with qw's hi part (and its lo part with
``OUT_X3``). The K-side work (w, kd, qw) is repeated by each of the ``V / BV`` value blocks of a head.

Same semantics as the other v3 forms: varlen via ``cu_seqlens``, state slots read (or ignored, NaN
included, for a fresh sequence) and written, the gate with its lower bound and beta's sigmoid computed
from the raw projections (``load_gate_beta`` with v3's per-token log-decay bound of -10).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashinfra import env
from flashinfra.kernels.kda_gate import kda_log_decay


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a b`` with bf16 operands; DOT_F32 (Triton's CPU interpreter, whose bf16 dot is wrong) widens
    them to float32 first."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _split(x, LO: tl.constexpr):
    """x as bf16 hi and (with LO) lo parts, hi + lo within 2^-17 of x; without LO, lo is hi (unused)."""
    hi = x.to(tl.bfloat16)
    if LO:
        return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, hi


@triton.jit
def _half(b_kx, b_qx, g, dt_bias, rate, lower_bound, r0, col, m_t, r_q, r_k, b_b, ai_s, aqk_s, KH: tl.constexpr,
          LP: tl.constexpr, W_LO: tl.constexpr, Q_LO: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
          HAS_LOWER_BOUND: tl.constexpr):
    """One K half of the chunk's tiles (every column of w, qw and kd depends on its own columns of q, k and g
    only) from the raw q and k halves: w, qw and kd as bf16 parts, and exp(gl). The gate as
    ``load_gate_beta`` forms it, with v3's per-token log-decay bound of -10."""
    b_g = g.load([r0, col])
    if GATE_IN_KERNEL:
        b_d = tl.load(dt_bias + tl.arange(0, KH)).to(tl.float32)
        b_g = kda_log_decay(b_g + b_d[None, :], rate, lower_bound, HAS_LOWER_BOUND)
    b_g = tl.where(m_t[:, None], tl.maximum(b_g, -10.0), 0.0)
    b_gc = tl.cumsum(b_g, 0)
    b_gl = tl.sum(b_g, 0)
    b_k = b_kx * r_k[:, None]
    b_kdh, b_kdl = _split(b_k * tl.exp(b_gl[None, :] - b_gc), W_LO)
    b_eg = tl.exp(b_gc)
    b_w = tl.dot(ai_s, b_k * (b_b[:, None] * b_eg), input_precision=LP)
    b_qw = b_qx * r_q[:, None] * b_eg - tl.dot(aqk_s, b_w, input_precision=LP)
    b_qh, b_ql = _split(b_qw, Q_LO)
    b_wh, b_wl = _split(b_w, W_LO)
    return b_kdh, b_kdl, b_wh, b_wl, b_qh, b_ql, tl.exp(b_gl)


@triton.jit
def _chain_out(b_wh, b_wl, b_qh, b_ql, b_s, b_ws, b_o, CHAIN: tl.constexpr, OUT_X3: tl.constexpr,
               DOT_F32: tl.constexpr):
    """The K half's share of ``w S`` (in the chain precision) and of ``qw S``."""
    b_sh = b_s.to(tl.bfloat16)
    b_sl = (b_s - b_sh.to(tl.float32)).to(tl.bfloat16)
    b_ws = _mma(b_wh, b_sh, b_ws, DOT_F32)
    if CHAIN == 3:
        b_ws = _mma(b_wl, b_sh, b_ws, DOT_F32)
    if CHAIN >= 2:
        b_ws = _mma(b_wh, b_sl, b_ws, DOT_F32)
    b_o = _mma(b_qh, b_sh, b_o, DOT_F32)
    b_o = _mma(b_qh, b_sl, b_o, DOT_F32)
    if OUT_X3:
        b_o = _mma(b_ql, b_sh, b_o, DOT_F32)
    return b_ws, b_o


@triton.jit
def _chain_state(b_s, b_egl, b_kdh, b_kdl, b_vh, b_vl, CHAIN: tl.constexpr, DOT_F32: tl.constexpr):
    """The K half of ``S = exp(gl) S + kd^T v'`` in the chain precision."""
    b_s = _mma(tl.trans(b_kdh), b_vh, b_s * b_egl[:, None], DOT_F32)
    if CHAIN == 3:
        b_s = _mma(tl.trans(b_kdl), b_vh, b_s, DOT_F32)
    if CHAIN >= 2:
        b_s = _mma(tl.trans(b_kdh), b_vl, b_s, DOT_F32)
    return b_s


@triton.jit
def kda_state64_fused_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, o, aqk, ai, state,
    cu_seqlens, chunk_offsets, state_slots, has_initial_state,
    stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, CHAIN: tl.constexpr,
    OUT_X3: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
    BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Grid (V / BV, sequences * H). ``aqk`` and ``ai`` are tensor descriptors over [chunks * H * 64, 64]
    float32 (blocks above the diagonal masked here: Aqk's hold the parked L), ``state`` over
    [slots * H * K, V]; q, k, v, g, beta are read with masks (rows past the sequence end are zeros).
    The state and the K-side tiles are held as two K halves (two tensors each), so that no [64, K] float32
    tile is live: at 4 warps one is 64 registers per thread."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    c0 = tl.load(chunk_offsets + i_n)
    slot = tl.load(state_slots + i_n)
    has_init = tl.load(has_initial_state + i_n) != 0
    LP: tl.constexpr = LOCAL_PRECISION
    KH: tl.constexpr = K // 2
    W_LO: tl.constexpr = CHAIN == 3
    o_t = tl.arange(0, 64)
    o_f = tl.arange(0, BV)
    m_blk = (o_t[None, :] // 16) <= (o_t[:, None] // 16)
    rate = tl.exp(tl.load(A_log + i_h).to(tl.float32)) if GATE_IN_KERNEL else 1.0
    dt_bias += i_h * K
    c_k = i_h * K
    # A fresh sequence ignores whatever its slot holds (NaN included).
    r_s = (slot * H + i_h) * K
    b_s0 = tl.where(has_init, state.load([r_s, i_v * BV]), 0.0)
    b_s1 = tl.where(has_init, state.load([r_s + KH, i_v * BV]), 0.0)
    for i_t in range(0, tl.cdiv(L, 64)):
        # rows past the sequence's end belong to the next one (or are zero-filled past T): masked after the load
        r0 = bos + i_t * 64
        m_t = o_t < L - i_t * 64
        k0 = tl.where(m_t[:, None], k.load([r0, c_k]).to(tl.float32), 0.0)
        k1 = tl.where(m_t[:, None], k.load([r0, c_k + KH]).to(tl.float32), 0.0)
        r_k = 1.0 / tl.sqrt(tl.sum(k0 * k0, 1) + tl.sum(k1 * k1, 1) + 1e-6)
        q0 = tl.where(m_t[:, None], q.load([r0, c_k]).to(tl.float32), 0.0)
        q1 = tl.where(m_t[:, None], q.load([r0, c_k + KH]).to(tl.float32), 0.0)
        r_q = scale / tl.sqrt(tl.sum(q0 * q0, 1) + tl.sum(q1 * q1, 1) + 1e-6)
        b_b = tl.load(beta + (r0 + o_t).to(tl.int64) * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
        if BETA_LOGITS:
            b_b = tl.sigmoid(b_b)
        b_b = tl.where(m_t, b_b, 0.0)
        r_a = ((c0 + i_t) * H + i_h) * 64
        ai_s = tl.where(m_blk, ai.load([r_a, 0]), 0.0)
        aqk_s = tl.where(m_blk, aqk.load([r_a, 0]), 0.0)
        b_vi = tl.where(m_t[:, None], v.load([r0, i_h * V + i_v * BV]).to(tl.float32), 0.0)
        b_u = tl.dot(ai_s, b_vi * b_b[:, None], input_precision=LP)
        # o = qg S + Aqk v' with v' = u - w S, folded: qw = q exp(gc) - Aqk w, o starts at ou = Aqk u
        b_o = tl.dot(aqk_s, b_u, input_precision=LP)
        b_ws = tl.zeros([64, BV], dtype=tl.float32)
        kd0h, kd0l, b_wh, b_wl, b_qh, b_ql, egl0 = _half(
            k0, q0, g, dt_bias, rate, lower_bound, r0, c_k, m_t, r_q, r_k, b_b, ai_s, aqk_s, KH, LP, W_LO, OUT_X3,
            GATE_IN_KERNEL, HAS_LOWER_BOUND)
        b_ws, b_o = _chain_out(b_wh, b_wl, b_qh, b_ql, b_s0, b_ws, b_o, CHAIN, OUT_X3, DOT_F32)
        kd1h, kd1l, b_wh, b_wl, b_qh, b_ql, egl1 = _half(
            k1, q1, g, dt_bias + KH, rate, lower_bound, r0, c_k + KH, m_t, r_q, r_k, b_b, ai_s, aqk_s, KH, LP, W_LO,
            OUT_X3, GATE_IN_KERNEL, HAS_LOWER_BOUND)
        b_ws, b_o = _chain_out(b_wh, b_wl, b_qh, b_ql, b_s1, b_ws, b_o, CHAIN, OUT_X3, DOT_F32)
        p_o = o + r0.to(tl.int64) * (H * V) + i_h * V + i_v * BV
        tl.store(p_o + o_t[:, None] * (H * V) + o_f[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])
        b_vn = b_u - b_ws
        b_vh = b_vn.to(tl.bfloat16)
        b_vl = (b_vn - b_vh.to(tl.float32)).to(tl.bfloat16)
        b_s0 = _chain_state(b_s0, egl0, kd0h, kd0l, b_vh, b_vl, CHAIN, DOT_F32)
        b_s1 = _chain_state(b_s1, egl1, kd1h, kd1l, b_vh, b_vl, CHAIN, DOT_F32)
    state.store([r_s, i_v * BV], b_s0)
    state.store([r_s + KH, i_v * BV], b_s1)


def fused_state_launch(q, k, v, g, beta, gate_args: dict, A_log, dt_bias, lower_bound: float, o, state, aqk, ai,
                       cu_t, offsets_t, slots_t, init_t, num_seqs: int, *, BV: int, chain: int, out_x3: bool,
                       local_precision: str, num_warps: int, num_stages: int):
    """The fused state pass as a closure (the benchmark times it on its own), over ``aqk`` and ``ai``
    [chunks, H, 64, 64] float32 as the split form's kernels leave them; ``gate_args`` are the
    GATE_IN_KERNEL, HAS_LOWER_BOUND and BETA_LOGITS flags; ``chain`` is 3 (bf16x3), 2 (bf16x2) or 1."""
    T, H, K = q.shape
    V = v.shape[-1]
    if K < 32:
        raise ValueError(f"kda_prefill v3: tiles='state' needs K >= 32 (two K halves of 16 or more), got K={K}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            raise ValueError(f"kda_prefill v3: tiles='state' reads {name} by TMA: its start and row stride must be "
                             f"multiples of 16 bytes")

    def desc(x, cols, block):  # rows of a [T, H, D] input, heads side by side
        return TensorDescriptor(x, [T, cols], [x.stride(0), 1], block)

    q_d, k_d = desc(q, H * K, [64, K // 2]), desc(k, H * K, [64, K // 2])
    g_d, v_d = desc(g, H * K, [64, K // 2]), desc(v, H * V, [64, BV])
    aqk_d = TensorDescriptor.from_tensor(aqk.view(-1, 64), [64, 64])
    ai_d = TensorDescriptor.from_tensor(ai.view(-1, 64), [64, 64])
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K // 2, BV])

    def launch():
        kda_state64_fused_kernel[(triton.cdiv(V, BV), num_seqs * H)](
            q_d, k_d, v_d, g_d, beta, A_log, dt_bias, lower_bound, o, aqk_d, ai_d, state_d, cu_t, offsets_t, slots_t,
            init_t, beta.stride(0), K**-0.5,
            H=H, K=K, V=V, BV=BV, CHAIN=chain, OUT_X3=out_x3, LOCAL_PRECISION=local_precision,
            DOT_F32=env.triton_interpret(), num_warps=num_warps, num_stages=num_stages, **gate_args,
        )

    return launch

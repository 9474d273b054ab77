"""KDA prefill (v3), the in-chunk matrices with the whole 64-token chunk as one tile: the same outputs as
``kda_intra64_a_kernel`` (kda_prefill_intra64.py: ``Aqk`` and ``(I + L)^-1`` as [64, 64] float32), built from
[64, 64] products that the warpgroup instructions take whole, instead of 16 x 16 blocks.

The decay references are those of the block kernel, per 16-token sub-block: an off-diagonal column block j
pairs rows ``exp(gc_r - ge_j)`` (rows of later blocks, at most 1) with columns ``k_c exp(ge_j - gc_c)`` (its
own rows, at most 1), ``ge_j`` the decay at the last row of block j; a diagonal block pairs rows and columns
against its middle row (a per-token log-decay is clamped at -10, as there). Each product is masked on its
operands (a row or column outside its block is zero before the product), so every contribution lands in its
own block and one accumulator holds all of ``L`` (one more ``Aqk``); K is walked in slices to keep the
operands small. The inverse is ``(I + L)^-1 = (I + N)^-1 (I + D)^-1`` with D the diagonal blocks
(``(I+D)^-1 = (I-D)(I+D^2)(I+D^4)(I+D^8)``) and ``N = (I + D)^-1 (L - D)``, strictly block-lower, so
``(I + N)^-1 = (I - N)(I + N^2)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_prefill_intra64 import _load_gate, _store_pair


@triton.jit
def _row_of(b_x, o_t, r: tl.constexpr):
    return tl.sum(tl.where((o_t == r)[:, None], b_x, 0.0), 0)


@triton.jit
def _tile_matrices(q, k, g, beta, A_log, dt_bias, lower_bound, rows, m_t, i_h,
                   stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
                   K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                   BETA_LOGITS: tl.constexpr, LP: tl.constexpr, SP: tl.constexpr):
    """(I + L)^-1, Aqk, beta and the q/k norm factors of one chunk (rows past the end of the sequence are
    masked by m_t)."""
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, KS)
    blk = o_t // 16
    # the L2 norms first, over the K slices
    ssq_q = tl.zeros([64], dtype=tl.float32)
    ssq_k = tl.zeros([64], dtype=tl.float32)
    for ks in tl.static_range(K // KS):
        m_ts = m_t[:, None] & (o_s[None, :] >= 0)
        b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * K + ks * KS + o_s[None, :], mask=m_ts, other=0.0)
        b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * K + ks * KS + o_s[None, :], mask=m_ts, other=0.0)
        ssq_q += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), 1)
        ssq_k += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), 1)
    r_q = scale / tl.sqrt(ssq_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    acc_l = tl.zeros([64, 64], dtype=tl.float32)
    acc_q = tl.zeros([64, 64], dtype=tl.float32)
    b_b = tl.zeros([64], dtype=tl.float32)
    for ks in tl.static_range(K // KS):
        o_k = ks * KS + o_s
        m_ts = m_t[:, None] & (o_k[None, :] < K)
        b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * K + o_k[None, :], mask=m_ts, other=0.0)
        b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * K + o_k[None, :], mask=m_ts, other=0.0)
        b_q = b_q.to(tl.float32) * r_q[:, None]
        b_k = b_k.to(tl.float32) * r_k[:, None]
        b_g, b_b = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_ts, i_h, o_k, o_k < K,
                              stride_g_t, stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        b_gc = tl.cumsum(b_g, 0)
        ge0, ge1, ge2 = _row_of(b_gc, o_t, 15), _row_of(b_gc, o_t, 31), _row_of(b_gc, o_t, 47)
        # off-diagonal column blocks j = 0, 1, 2
        b_ge = tl.where((blk == 0)[:, None], ge0[None, :], tl.where((blk == 1)[:, None], ge1[None, :], ge2[None, :]))
        b_cc = b_k * tl.exp(tl.where((blk < 3)[:, None], b_ge - b_gc, -1e30))
        b_r = tl.exp(tl.where((blk > 0)[:, None], b_gc - ge0[None, :], -1e30))
        b_c = tl.trans(tl.where((blk == 0)[:, None], b_cc, 0.0))
        acc_l = tl.dot(b_k * b_r, b_c, acc_l, input_precision=LP)
        acc_q = tl.dot(b_q * b_r, b_c, acc_q, input_precision=LP)
        b_r = tl.exp(tl.where((blk > 1)[:, None], b_gc - ge1[None, :], -1e30))
        b_c = tl.trans(tl.where((blk == 1)[:, None], b_cc, 0.0))
        acc_l = tl.dot(b_k * b_r, b_c, acc_l, input_precision=LP)
        acc_q = tl.dot(b_q * b_r, b_c, acc_q, input_precision=LP)
        b_r = tl.exp(tl.where((blk > 2)[:, None], b_gc - ge2[None, :], -1e30))
        b_c = tl.trans(tl.where((blk == 2)[:, None], b_cc, 0.0))
        acc_l = tl.dot(b_k * b_r, b_c, acc_l, input_precision=LP)
        acc_q = tl.dot(b_q * b_r, b_c, acc_q, input_precision=LP)
        # diagonal blocks against their middle rows
        b_gm = tl.where((blk == 0)[:, None], _row_of(b_gc, o_t, 8)[None, :],
                        tl.where((blk == 1)[:, None], _row_of(b_gc, o_t, 24)[None, :],
                                 tl.where((blk == 2)[:, None], _row_of(b_gc, o_t, 40)[None, :],
                                          _row_of(b_gc, o_t, 56)[None, :])))
        b_e = tl.exp(b_gc - b_gm)
        b_kr, b_qr = b_k * b_e, b_q * b_e
        b_kc = b_k * tl.exp(b_gm - b_gc)
        for bb in tl.static_range(4):
            m_b = (blk == bb)[:, None]
            b_c = tl.trans(tl.where(m_b, b_kc, 0.0))
            acc_l = tl.dot(tl.where(m_b, b_kr, 0.0), b_c, acc_l, input_precision=LP)
            acc_q = tl.dot(tl.where(m_b, b_qr, 0.0), b_c, acc_q, input_precision=LP)
    lower = o_t[:, None] > o_t[None, :]
    b_l = tl.where(lower, acc_l * b_b[:, None], 0.0)
    b_aqk = tl.where(lower | (o_t[:, None] == o_t[None, :]), acc_q, 0.0)
    # (I + L)^-1 = (I - N)(I + N^2) (I + D)^-1
    eye = (o_t[:, None] == o_t[None, :]).to(tl.float32)
    b_d = tl.where(blk[:, None] == blk[None, :], b_l, 0.0)
    b_p = -b_d
    b_di = eye + b_p
    for _ in tl.static_range(3):
        b_p = tl.dot(b_p, b_p, input_precision=SP)
        b_di = b_di + tl.dot(b_di, b_p, input_precision=SP)
    b_n = tl.dot(b_di, b_l - b_d, input_precision=SP)
    b_m = eye - b_n
    b_m = b_m + tl.dot(b_m, tl.dot(b_n, b_n, input_precision=SP), input_precision=SP)
    return tl.dot(b_m, b_di, input_precision=SP), b_aqk, b_b, r_q, r_k


@triton.jit
def _chunk_head(cu_seqlens, chunk_indices):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = tl.arange(0, 64)
    return i_c, i_h, bos + t0 + o_t, t0 + o_t < L


@triton.jit
def kda_intra64_tile_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai,
    stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
):
    """Writes Aqk and (I + L)^-1 for kda_intra64_b_kernel."""
    i_c, i_h, rows, m_t = _chunk_head(cu_seqlens, chunk_indices)
    b_ai, b_aqk, b_b, r_q, r_k = _tile_matrices(
        q, k, g, beta, A_log, dt_bias, lower_bound, rows, m_t, i_h, stride_q_t, stride_k_t, stride_g_t, stride_b_t,
        scale, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, LOCAL_PRECISION, SOLVE_PRECISION)
    o_t = tl.arange(0, 64)
    p_a = (i_c * H + i_h).to(tl.int64) * 4096 + o_t[:, None] * 64 + o_t[None, :]
    tl.store(aqk + p_a, b_aqk)
    tl.store(ai + p_a, b_ai)


@triton.jit
def kda_intra64_fused_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, wqk, uo, egl,
    stride_q_t, stride_k_t, stride_v_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KS: tl.constexpr, VS: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
):
    """The whole in-chunk pass in one kernel: the matrices stay in registers and the per-chunk tiles of
    kda_intra64_b_kernel (same layout) are written slice by slice of K and V."""
    LP: tl.constexpr = LOCAL_PRECISION
    i_c, i_h, rows, m_t = _chunk_head(cu_seqlens, chunk_indices)
    b_ai, b_aqk, b_b, r_q, r_k = _tile_matrices(
        q, k, g, beta, A_log, dt_bias, lower_bound, rows, m_t, i_h, stride_q_t, stride_k_t, stride_g_t, stride_b_t,
        scale, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, LP, SOLVE_PRECISION)
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, KS)
    i_ch = (i_c * H + i_h).to(tl.int64)
    SLOT: tl.constexpr = 64 * K
    for ks in tl.static_range(K // KS):
        o_k = ks * KS + o_s
        m_ts = m_t[:, None] & (o_k[None, :] < K)
        b_g, _ = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_ts, i_h, o_k, o_k < K, stride_g_t,
                            stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        b_gc = tl.cumsum(b_g, 0)
        b_gl = tl.sum(b_g, 0)
        tl.store(egl + i_ch * K + o_k, tl.exp(b_gl))
        p = wqk + i_ch * (6 * SLOT) + o_t[:, None] * K + o_k[None, :]
        b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * K + o_k[None, :], mask=m_ts, other=0.0)
        b_k = b_k.to(tl.float32) * r_k[:, None]
        _store_pair(p + 4 * SLOT, b_k * tl.exp(b_gl[None, :] - b_gc), SLOT)
        b_w = tl.dot(b_ai, b_k * (b_b[:, None] * tl.exp(b_gc)), input_precision=LP)
        _store_pair(p, b_w, SLOT)
        b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * K + o_k[None, :], mask=m_ts, other=0.0)
        b_q = b_q.to(tl.float32) * r_q[:, None]
        _store_pair(p + 2 * SLOT, b_q * tl.exp(b_gc) - tl.dot(b_aqk, b_w, input_precision=LP), SLOT)
    for vs in tl.static_range(V // VS):
        o_v = vs * VS + tl.arange(0, VS)
        b_v = tl.load(v + rows[:, None] * stride_v_t + i_h * V + o_v[None, :], mask=m_t[:, None], other=0.0)
        b_u = tl.dot(b_ai, b_v.to(tl.float32) * b_b[:, None], input_precision=LP)
        p = uo + i_ch * (2 * 64 * V) + o_t[:, None] * V + o_v[None, :]
        tl.store(p, b_u)
        tl.store(p + 64 * V, tl.dot(b_aqk, b_u, input_precision=LP))

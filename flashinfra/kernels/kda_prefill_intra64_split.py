"""KDA prefill (v3), the in-chunk matrices split over many small programs: the same outputs as
``kda_intra64_a_kernel`` (kda_prefill_intra64.py: ``Aqk`` lower with its diagonal, and ``(I + L)^-1``, as
[chunks, H, 64, 64] float32, blocks above the diagonal left unwritten), for ``kda_intra64_b_kernel``.

The block kernel runs about 100 dependent small products per chunk in one program of 255 registers, so an
SM holds 2-4 of them and their latency is not hidden. Here the work goes to two kernels of short chains:

- ``kda_intra64_diag_kernel``, one program per (chunk, 16-token sub-block, head): the diagonal block's
  ``L`` and ``Aqk`` against its middle row (as there: a per-token log-decay is clamped at -10, so the
  factors stay within ``exp(+-80)``; q and k are normalised first, over K in slices, so nothing overflows),
  and ``(I + L_ii)^-1`` by forward substitution, 15 row steps of vector work in float32 (the rows of
  ``L_ii`` go through the inverse's own scratch block and come back one at a time);
- ``kda_intra64_offdiag_kernel``, one program per (chunk, head): the six off-diagonal blocks against the
  first row of the later block (every factor at most 1, exact for any gate), twelve independent
  accumulators over K in slices, on the raw q and k (the norms, beta and the scale are row and column
  factors, applied after); then the block merge ``Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj`` with the
  diagonal inverses of the first kernel.

Each holds only [16, KS] slices and 16 x 16 accumulators, far under 128 registers per thread.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_prefill_intra64 import _load_gate


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_c, t_sub):
    """First row (absolute) of sub-block t_sub of chunk i_c, and the number of its sequence's rows left
    from there."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64 + t_sub * 16
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    return bos + t0, tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos - t0


@triton.jit
def _ld(x, rows, m_tk, stride_t, i_h, o_k, K: tl.constexpr):
    return tl.load(x + rows[:, None] * stride_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)


@triton.jit
def kda_intra64_diag_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai,
    stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
):
    """Grid (chunks * 4, H): the diagonal blocks of Aqk and (I + L)^-1 (zeros above their diagonals)."""
    i_cb, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_b = i_cb // 4, i_cb % 4
    r0, left = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_b)
    o_r = tl.arange(0, 16)
    o_s = tl.arange(0, KS)
    rows = r0 + o_r
    m_t = o_r < left
    ssq_q = tl.zeros([16], dtype=tl.float32)
    ssq_k = tl.zeros([16], dtype=tl.float32)
    for ks in tl.static_range(K // KS):
        m_tk = m_t[:, None] & (o_s[None, :] >= 0)
        b_q = _ld(q, rows, m_tk, stride_q_t, i_h, ks * KS + o_s, K)
        b_k = _ld(k, rows, m_tk, stride_k_t, i_h, ks * KS + o_s, K)
        ssq_q += tl.sum(b_q * b_q, 1)
        ssq_k += tl.sum(b_k * b_k, 1)
    r_q = scale / tl.sqrt(ssq_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    acc_l = tl.zeros([16, 16], dtype=tl.float32)
    acc_a = tl.zeros([16, 16], dtype=tl.float32)
    b_b = tl.zeros([16], dtype=tl.float32)
    for ks in tl.static_range(K // KS):
        o_k = ks * KS + o_s
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_g, b_b = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                              stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        # differences of the decay inside the block only: the cumulative sum may start at the block
        b_gc = tl.cumsum(b_g, 0)
        b_gm = tl.sum(tl.where((o_r == 8)[:, None], b_gc, 0.0), 0)
        b_e = tl.exp(b_gc - b_gm[None, :])
        b_k = _ld(k, rows, m_tk, stride_k_t, i_h, o_k, K) * r_k[:, None]
        b_q = _ld(q, rows, m_tk, stride_q_t, i_h, o_k, K) * r_q[:, None]
        b_kt = tl.trans(b_k * tl.exp(b_gm[None, :] - b_gc))
        acc_l = tl.dot(b_k * b_e, b_kt, acc_l, input_precision=LOCAL_PRECISION)
        acc_a = tl.dot(b_q * b_e, b_kt, acc_a, input_precision=LOCAL_PRECISION)
    b_l = tl.where(o_r[:, None] > o_r[None, :], acc_l * b_b[:, None], 0.0)
    blk = (i_c * H + i_h).to(tl.int64) * 4096 + i_b * (16 * 64 + 16)
    off = blk + o_r[:, None] * 64 + o_r[None, :]
    tl.store(aqk + off, tl.where(o_r[:, None] >= o_r[None, :], acc_a, 0.0))
    # X = (I + L)^-1 row by row: X_i = e_i - sum_{m < i} L_im X_m (L_im = 0 for m >= i)
    tl.store(ai + off, b_l)
    tl.debug_barrier()  # the rows stored above are read back by other threads
    p_row = ai + blk + o_r
    b_x = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        b_li = tl.load(p_row + i * 64)
        b_x = tl.where((o_r == i)[:, None], b_x - tl.sum(b_li[:, None] * b_x, 0)[None, :], b_x)
    tl.debug_barrier()  # every row read before the inverse overwrites them
    tl.store(ai + off, b_x)


@triton.jit
def _block_in(q, k, g, beta, A_log, dt_bias, lower_bound, r0, left, i_h, o_r, o_k, m_k,
              stride_q_t, stride_k_t, stride_g_t, stride_b_t,
              K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
              BETA_LOGITS: tl.constexpr):
    """One sub-block's K slice: raw q and k, the clamped log-decay and beta (zero past the sequence's end)."""
    rows = r0 + o_r
    m_t = o_r < left
    m_tk = m_t[:, None] & m_k[None, :]
    b_g, b_b = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
    return _ld(q, rows, m_tk, stride_q_t, i_h, o_k, K), _ld(k, rows, m_tk, stride_k_t, i_h, o_k, K), b_g, b_b


@triton.jit
def _first_row(b_gc, o_r):
    return tl.sum(tl.where((o_r == 0)[:, None], b_gc, 0.0), 0)


@triton.jit
def _cols(b_kt, b_ge, b_gn):
    """Column operand of an off-diagonal block: ``k_c exp(ge_j - gc_c) exp(gn_i - ge_j)``, both factors <= 1."""
    return tl.trans(b_kt * tl.exp(b_gn - b_ge)[None, :])


@triton.jit
def _mm(a, b, P: tl.constexpr):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def kda_intra64_offdiag_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai,
    stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
):
    """Grid (chunks, H): the off-diagonal blocks of Aqk and of (I + L)^-1, after kda_intra64_diag_kernel has
    written the diagonal inverses."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    r0, left = _chunk_rows(cu_seqlens, chunk_indices, i_c, 0)
    LP: tl.constexpr = LOCAL_PRECISION
    SP: tl.constexpr = SOLVE_PRECISION
    o_r = tl.arange(0, 16)
    o_s = tl.arange(0, KS)
    z = tl.zeros([16, 16], dtype=tl.float32)
    l10, l20, l21, l30, l31, l32 = z, z, z, z, z, z
    a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z
    zv = tl.zeros([16], dtype=tl.float32)
    sk0, sk1, sk2, sk3, sq1, sq2, sq3 = zv, zv, zv, zv, zv, zv, zv
    b1, b2, b3 = zv, zv, zv
    for ks in tl.static_range(K // KS):
        o_k = ks * KS + o_s
        m_k = o_k < K
        # block 0 gives columns only; kt_j = k_j exp(ge_j - gc_j) and ge_j (gc's last row of block j) stay live
        m_tk = (o_r < left)[:, None] & m_k[None, :]
        g0, _b0 = _load_gate(g, beta, A_log, dt_bias, lower_bound, r0 + o_r, o_r < left, m_tk, i_h, o_k, m_k,
                             stride_g_t, stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        k0 = _ld(k, r0 + o_r, m_tk, stride_k_t, i_h, o_k, K)
        sk0 += tl.sum(k0 * k0, 1)
        gc = tl.cumsum(g0, 0)
        ge0 = tl.sum(g0, 0)
        kt0 = k0 * tl.exp(ge0[None, :] - gc)

        q1, k1, g1, b1 = _block_in(q, k, g, beta, A_log, dt_bias, lower_bound, r0 + 16, left - 16, i_h, o_r, o_k,
                                   m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, K, GATE_IN_KERNEL,
                                   HAS_LOWER_BOUND, BETA_LOGITS)
        sk1 += tl.sum(k1 * k1, 1)
        sq1 += tl.sum(q1 * q1, 1)
        gc = tl.cumsum(g1, 0) + ge0[None, :]
        ge1 = ge0 + tl.sum(g1, 0)
        gn = _first_row(gc, o_r)
        e = tl.exp(gc - gn[None, :])
        c = _cols(kt0, ge0, gn)
        l10 = tl.dot(k1 * e, c, l10, input_precision=LP)
        a10 = tl.dot(q1 * e, c, a10, input_precision=LP)
        kt1 = k1 * tl.exp(ge1[None, :] - gc)

        q2, k2, g2, b2 = _block_in(q, k, g, beta, A_log, dt_bias, lower_bound, r0 + 32, left - 32, i_h, o_r, o_k,
                                   m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, K, GATE_IN_KERNEL,
                                   HAS_LOWER_BOUND, BETA_LOGITS)
        sk2 += tl.sum(k2 * k2, 1)
        sq2 += tl.sum(q2 * q2, 1)
        gc = tl.cumsum(g2, 0) + ge1[None, :]
        ge2 = ge1 + tl.sum(g2, 0)
        gn = _first_row(gc, o_r)
        e = tl.exp(gc - gn[None, :])
        rk, rq = k2 * e, q2 * e
        c = _cols(kt0, ge0, gn)
        l20 = tl.dot(rk, c, l20, input_precision=LP)
        a20 = tl.dot(rq, c, a20, input_precision=LP)
        c = _cols(kt1, ge1, gn)
        l21 = tl.dot(rk, c, l21, input_precision=LP)
        a21 = tl.dot(rq, c, a21, input_precision=LP)
        kt2 = k2 * tl.exp(ge2[None, :] - gc)

        q3, k3, g3, b3 = _block_in(q, k, g, beta, A_log, dt_bias, lower_bound, r0 + 48, left - 48, i_h, o_r, o_k,
                                   m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, K, GATE_IN_KERNEL,
                                   HAS_LOWER_BOUND, BETA_LOGITS)
        sk3 += tl.sum(k3 * k3, 1)
        sq3 += tl.sum(q3 * q3, 1)
        gc = tl.cumsum(g3, 0) + ge2[None, :]
        gn = _first_row(gc, o_r)
        e = tl.exp(gc - gn[None, :])
        rk, rq = k3 * e, q3 * e
        c = _cols(kt0, ge0, gn)
        l30 = tl.dot(rk, c, l30, input_precision=LP)
        a30 = tl.dot(rq, c, a30, input_precision=LP)
        c = _cols(kt1, ge1, gn)
        l31 = tl.dot(rk, c, l31, input_precision=LP)
        a31 = tl.dot(rq, c, a31, input_precision=LP)
        c = _cols(kt2, ge2, gn)
        l32 = tl.dot(rk, c, l32, input_precision=LP)
        a32 = tl.dot(rq, c, a32, input_precision=LP)

    # the L2 norms (and the scale, and beta) as row and column factors of the raw products
    n0 = (1.0 / tl.sqrt(sk0 + 1e-6))[None, :]
    n1 = (1.0 / tl.sqrt(sk1 + 1e-6))[None, :]
    n2 = (1.0 / tl.sqrt(sk2 + 1e-6))[None, :]
    rk1 = (b1 / tl.sqrt(sk1 + 1e-6))[:, None]
    rk2 = (b2 / tl.sqrt(sk2 + 1e-6))[:, None]
    rk3 = (b3 / tl.sqrt(sk3 + 1e-6))[:, None]
    rq1 = (scale / tl.sqrt(sq1 + 1e-6))[:, None]
    rq2 = (scale / tl.sqrt(sq2 + 1e-6))[:, None]
    rq3 = (scale / tl.sqrt(sq3 + 1e-6))[:, None]
    base = (i_c * H + i_h).to(tl.int64) * 4096 + o_r[:, None] * 64 + o_r[None, :]
    tl.store(aqk + base + 16 * 64, a10 * rq1 * n0)
    tl.store(aqk + base + 32 * 64, a20 * rq2 * n0)
    tl.store(aqk + base + 32 * 64 + 16, a21 * rq2 * n1)
    tl.store(aqk + base + 48 * 64, a30 * rq3 * n0)
    tl.store(aqk + base + 48 * 64 + 16, a31 * rq3 * n1)
    tl.store(aqk + base + 48 * 64 + 32, a32 * rq3 * n2)
    l10 = l10 * rk1 * n0
    l20, l21 = l20 * rk2 * n0, l21 * rk2 * n1
    l30, l31, l32 = l30 * rk3 * n0, l31 * rk3 * n1, l32 * rk3 * n2

    # (I + L)^-1, block lower triangular: Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj
    ai00 = tl.load(ai + base)
    ai11 = tl.load(ai + base + 16 * 64 + 16)
    ai22 = tl.load(ai + base + 32 * 64 + 32)
    ai33 = tl.load(ai + base + 48 * 64 + 48)
    ai10 = -_mm(ai11, _mm(l10, ai00, SP), SP)
    ai21 = -_mm(ai22, _mm(l21, ai11, SP), SP)
    ai32 = -_mm(ai33, _mm(l32, ai22, SP), SP)
    ai20 = -_mm(ai22, _mm(l20, ai00, SP) + _mm(l21, ai10, SP), SP)
    ai31 = -_mm(ai33, _mm(l31, ai11, SP) + _mm(l32, ai21, SP), SP)
    ai30 = -_mm(ai33, _mm(l30, ai00, SP) + _mm(l31, ai10, SP) + _mm(l32, ai20, SP), SP)
    tl.store(ai + base + 16 * 64, ai10)
    tl.store(ai + base + 32 * 64, ai20)
    tl.store(ai + base + 32 * 64 + 16, ai21)
    tl.store(ai + base + 48 * 64, ai30)
    tl.store(ai + base + 48 * 64 + 16, ai31)
    tl.store(ai + base + 48 * 64 + 32, ai32)

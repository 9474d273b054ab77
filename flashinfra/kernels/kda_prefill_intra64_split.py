"""KDA prefill (v3), the in-chunk matrices: per 64-token chunk and head, from the gate (with its lower
bound), beta and the L2-normalised q and k, the decay-weighted products ``L = beta k k^T`` (strictly lower)
and ``Aqk = q k^T`` (lower, diagonal included) and the WY inverse ``Ai = (I + L)^-1``, written as [chunks, H,
64, 64] float32 (the blocks above the diagonal are scratch: kernel B, kda_prefill_intra64_b.py, masks them).
The chunk is split into four 16-token sub-blocks, each product formed against a reference row that keeps
every exponential factor at most 1 or within ``exp(+-80)``.

One kernel for all of it runs about 100 dependent small products per chunk in one program of 255
registers (an SM holds 2-4 and their latency is not hidden: 2.85 ms at T=8192, H=64 on an H200, against
0.48 + 0.85 ms here). Here the work goes to two kernels of short chains and 70-80 / 110-160 registers
(sm_90, Triton 3.9-3.6):

- ``kda_intra64_diag_kernel``, one program per (chunk, 16-token sub-block, head): the diagonal block's
  ``L`` and ``Aqk`` against its middle row (a per-token log-decay is clamped at -10 by ``load_gate_v3``,
  so the factors stay within ``exp(+-80)``; q and k are normalised first, over K in slices, so nothing
  overflows), and ``(I + L_ii)^-1`` by forward substitution, 15 row steps of float32 vector work (the rows of
  ``L_ii`` go through the inverse's own scratch block and come back one at a time);
- ``kda_intra64_offdiag_kernel``, one program per (chunk, head): per column block j, one pass over K with
  the chunk's 64 rows as one [64, 16] product (rows not below block j masked), against block j's last row:
  rows ``exp(gc_r - ge_j)`` and columns ``exp(ge_j - gc_c)``, every factor at most 1, exact for any gate (a
  factor underflows only where the product does). The norms, beta and the scale are row and column factors
  applied after. ``L``'s blocks are parked in Aqk's unused upper blocks, then the merge
  ``Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj`` runs column block by column block with the first kernel's
  diagonal inverses. ``ONE_PASS`` does the three column blocks in one pass over K instead (the rows' loads,
  gate and cumulative sum shared: about 30% fewer instructions, about 160 registers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_gate import load_gate_beta


@triton.jit
def load_gate_v3(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t, stride_b_t,
                 K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                 BETA_LOGITS: tl.constexpr):
    """``load_gate_beta`` with v3's bound: per-token log-decay at least -10 (exact 16-token sub-blocks)."""
    return load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, -10.0)


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_c, t_sub):
    """First row (absolute) of sub-block t_sub of chunk i_c, and the number of its sequence's rows left
    from there."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64 + t_sub * 16
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    return bos + t0, (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos - t0).to(tl.int32)


@triton.jit
def _ld(x, rows, m_tk, stride_t, o_k):
    """A [rows, K slice] tile in float32; x is the scalar base of the first row's head: the offsets stay
    int32 (tensors of 64-bit offsets would hold twice the registers)."""
    return tl.load(x + rows[:, None] * stride_t + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)


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
    q += r0 * stride_q_t + i_h * K
    k += r0 * stride_k_t + i_h * K
    g += r0 * stride_g_t
    beta += r0 * stride_b_t
    o_r = tl.arange(0, 16)
    o_s = tl.arange(0, KS)
    rows = o_r
    m_t = o_r < left
    ssq_q = tl.zeros([16], dtype=tl.float32)
    ssq_k = tl.zeros([16], dtype=tl.float32)
    for ks in range(K // KS):
        m_tk = m_t[:, None] & (o_s[None, :] >= 0)
        b_q = _ld(q + ks * KS, rows, m_tk, stride_q_t, o_s)
        b_k = _ld(k + ks * KS, rows, m_tk, stride_k_t, o_s)
        ssq_q += tl.sum(b_q * b_q, 1)
        ssq_k += tl.sum(b_k * b_k, 1)
    r_q = scale / tl.sqrt(ssq_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    acc_l = tl.zeros([16, 16], dtype=tl.float32)
    acc_a = tl.zeros([16, 16], dtype=tl.float32)
    b_b = tl.zeros([16], dtype=tl.float32)
    for ks in range(K // KS):
        # per-slice scalar bases: a tensor of pointers that does not change over the loop would be hoisted
        # and held (64 bits per element) through it
        m_k = o_s < KS
        m_tk = m_t[:, None] & m_k[None, :]
        b_g, b_b = load_gate_v3(g + ks * KS, beta, A_log, dt_bias + ks * KS, lower_bound, rows, m_t, m_tk, i_h, o_s,
                              m_k, stride_g_t, stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        # differences of the decay inside the block only: the cumulative sum may start at the block
        b_gc = tl.cumsum(b_g, 0)
        b_gm = tl.sum(tl.where((o_r == 8)[:, None], b_gc, 0.0), 0)
        b_e = tl.exp(b_gc - b_gm[None, :])
        b_k = _ld(k + ks * KS, rows, m_tk, stride_k_t, o_s) * r_k[:, None]
        b_q = _ld(q + ks * KS, rows, m_tk, stride_q_t, o_s) * r_q[:, None]
        b_kt = tl.trans(b_k * tl.exp(b_gm[None, :] - b_gc))
        acc_l = tl.dot(b_k * b_e, b_kt, acc_l, input_precision=LOCAL_PRECISION)
        acc_a = tl.dot(b_q * b_e, b_kt, acc_a, input_precision=LOCAL_PRECISION)
    b_l = tl.where(o_r[:, None] > o_r[None, :], acc_l * b_b[:, None], 0.0)
    blk = (i_c * H + i_h).to(tl.int64) * 4096 + i_b * (16 * 64 + 16)
    aqk += blk
    ai += blk
    off = o_r[:, None] * 64 + o_r[None, :]
    tl.store(aqk + off, tl.where(o_r[:, None] >= o_r[None, :], acc_a, 0.0))
    # X = (I + L)^-1 row by row: X_i = e_i - sum_{m < i} L_im X_m (L_im = 0 for m >= i)
    tl.store(ai + off, b_l)
    tl.debug_barrier()  # the rows stored above are read back by other threads
    p_row = ai + o_r
    b_x = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    for i in range(1, 16):
        b_li = tl.load(p_row + i * 64)
        b_x = tl.where((o_r == i)[:, None], b_x - tl.sum(b_li[:, None] * b_x, 0)[None, :], b_x)
    tl.debug_barrier()  # every row read before the inverse overwrites them
    tl.store(ai + off, b_x)


@triton.jit
def _mm(a, b, P: tl.constexpr):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def _blk(p, i: tl.constexpr, j: tl.constexpr, o_r):
    """Pointers to block (i, j) of a [64, 64] matrix at p."""
    return p + (16 * i + o_r)[:, None] * 64 + 16 * j + o_r[None, :]


@triton.jit
def _blk_t(p, i: tl.constexpr, j: tl.constexpr, o_r):
    """Pointers to block (i, j), i > j, of L as the unused block (j, i) of Aqk holds it: transposed."""
    return p + (16 * j + o_r)[None, :] * 64 + 16 * i + o_r[:, None]


@triton.jit
def _col_operand(k, g, beta, A_log, dt_bias, lower_bound, left, i_h, o_k, m_k, stride_k_t, stride_g_t, stride_b_t,
                 j: tl.constexpr, K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                 BETA_LOGITS: tl.constexpr):
    """Column block j's K slice: raw k, the operand ``(k_c exp(ge_j - gc_c))^T`` and the block's decay sum."""
    o_r = tl.arange(0, 16)
    m_c = 16 * j + o_r < left
    m_ck = m_c[:, None] & m_k[None, :]
    c_g, _ = load_gate_v3(g, beta, A_log, dt_bias, lower_bound, 16 * j + o_r, m_c, m_ck, i_h, o_k, m_k, stride_g_t,
                        stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
    c_k = _ld(k, 16 * j + o_r, m_ck, stride_k_t, o_k)
    c_sum = tl.sum(c_g, 0)
    return c_k, tl.trans(c_k * tl.exp(c_sum[None, :] - tl.cumsum(c_g, 0))), c_sum


@triton.jit
def _col_pass(q, k, g, beta, A_log, dt_bias, lower_bound, left, i_h, stride_q_t, stride_k_t, stride_g_t, stride_b_t,
              j: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
              HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LP: tl.constexpr):
    """Column block j against its last row ``ge_j``, over K in slices: the raw products of L and Aqk for
    the chunk's rows below block j (rows ``k_r exp(gc_r - ge_j)``, columns ``k_c exp(ge_j - gc_c)``, both
    factors at most 1), with the sums of squares of the column block's k and (for j = 0, which covers every
    row that needs them) of the rows' q and k."""
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, KS)
    m_t = (o_t < left) & (o_t // 16 > j)
    acc_l = tl.zeros([64, 16], dtype=tl.float32)
    acc_a = tl.zeros([64, 16], dtype=tl.float32)
    ssq_k = tl.zeros([64], dtype=tl.float32)
    ssq_q = tl.zeros([64], dtype=tl.float32)
    ssq_c = tl.zeros([16], dtype=tl.float32)
    b_b = tl.zeros([64], dtype=tl.float32)
    for ks in range(K // KS):
        # per-slice scalar bases: the loads' pointers are formed in the loop, not held through it
        m_k = o_s < KS
        m_tk = m_t[:, None] & m_k[None, :]
        b_g, b_b = load_gate_v3(g + ks * KS, beta, A_log, dt_bias + ks * KS, lower_bound, o_t, m_t, m_tk, i_h, o_s,
                              m_k, stride_g_t, stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        # rows not below block j hold g = 0, so the cumulative sum starts after block j: gc_r - ge_j
        b_f = tl.exp(tl.where(m_t[:, None], tl.cumsum(b_g, 0), -1e30))
        b_k = _ld(k + ks * KS, o_t, m_tk, stride_k_t, o_s)
        b_q = _ld(q + ks * KS, o_t, m_tk, stride_q_t, o_s)
        if j == 0:
            ssq_k += tl.sum(b_k * b_k, 1)
            ssq_q += tl.sum(b_q * b_q, 1)
        c_k, c_t, _c_sum = _col_operand(k + ks * KS, g + ks * KS, beta, A_log, dt_bias + ks * KS, lower_bound, left,
                                        i_h, o_s, m_k, stride_k_t, stride_g_t, stride_b_t, j, K, GATE_IN_KERNEL,
                                        HAS_LOWER_BOUND, BETA_LOGITS)
        ssq_c += tl.sum(c_k * c_k, 1)
        acc_l = tl.dot(b_k * b_f, c_t, acc_l, input_precision=LP)
        acc_a = tl.dot(b_q * b_f, c_t, acc_a, input_precision=LP)
    return acc_l, acc_a, ssq_k, ssq_q, ssq_c, b_b


@triton.jit
def _one_pass(q, k, g, beta, A_log, dt_bias, lower_bound, left, i_h, stride_q_t, stride_k_t, stride_g_t, stride_b_t,
              K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
              BETA_LOGITS: tl.constexpr, LP: tl.constexpr):
    """The three column passes of _col_pass in one pass over K (six accumulators live): the rows' gate,
    cumulative sum and loads are shared, ``ge_j`` is the sum of the column blocks' decay up to block j."""
    o_t = tl.arange(0, 64)
    o_s = tl.arange(0, KS)
    blk = o_t // 16
    m_g = o_t < left
    m_t = m_g & (blk > 0)
    z = tl.zeros([64, 16], dtype=tl.float32)
    acc_l0, acc_a0, acc_l1, acc_a1, acc_l2, acc_a2 = z, z, z, z, z, z
    ssq_k = tl.zeros([64], dtype=tl.float32)
    ssq_q = tl.zeros([64], dtype=tl.float32)
    zc = tl.zeros([16], dtype=tl.float32)
    sc0, sc1, sc2 = zc, zc, zc
    b_b = tl.zeros([64], dtype=tl.float32)
    for ks in range(K // KS):
        qs, kk, gs, ds = q + ks * KS, k + ks * KS, g + ks * KS, dt_bias + ks * KS
        m_k = o_s < KS
        m_tk = m_t[:, None] & m_k[None, :]
        b_g, b_b = load_gate_v3(gs, beta, A_log, ds, lower_bound, o_t, m_g, m_g[:, None] & m_k[None, :], i_h, o_s, m_k,
                              stride_g_t, stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        b_gc = tl.cumsum(b_g, 0)
        b_k = _ld(kk, o_t, m_tk, stride_k_t, o_s)
        b_q = _ld(qs, o_t, m_tk, stride_q_t, o_s)
        ssq_k += tl.sum(b_k * b_k, 1)
        ssq_q += tl.sum(b_q * b_q, 1)
        c_k, c_t, ge = _col_operand(kk, gs, beta, A_log, ds, lower_bound, left, i_h, o_s, m_k, stride_k_t, stride_g_t,
                                    stride_b_t, 0, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        sc0 += tl.sum(c_k * c_k, 1)
        b_f = tl.exp(tl.where((blk > 0)[:, None], b_gc - ge[None, :], -1e30))
        acc_l0 = tl.dot(b_k * b_f, c_t, acc_l0, input_precision=LP)
        acc_a0 = tl.dot(b_q * b_f, c_t, acc_a0, input_precision=LP)
        c_k, c_t, c_sum = _col_operand(kk, gs, beta, A_log, ds, lower_bound, left, i_h, o_s, m_k, stride_k_t,
                                       stride_g_t, stride_b_t, 1, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        ge += c_sum
        sc1 += tl.sum(c_k * c_k, 1)
        b_f = tl.exp(tl.where((blk > 1)[:, None], b_gc - ge[None, :], -1e30))
        acc_l1 = tl.dot(b_k * b_f, c_t, acc_l1, input_precision=LP)
        acc_a1 = tl.dot(b_q * b_f, c_t, acc_a1, input_precision=LP)
        c_k, c_t, c_sum = _col_operand(kk, gs, beta, A_log, ds, lower_bound, left, i_h, o_s, m_k, stride_k_t,
                                       stride_g_t, stride_b_t, 2, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
        ge += c_sum
        sc2 += tl.sum(c_k * c_k, 1)
        b_f = tl.exp(tl.where((blk > 2)[:, None], b_gc - ge[None, :], -1e30))
        acc_l2 = tl.dot(b_k * b_f, c_t, acc_l2, input_precision=LP)
        acc_a2 = tl.dot(b_q * b_f, c_t, acc_a2, input_precision=LP)
    return acc_l0, acc_a0, acc_l1, acc_a1, acc_l2, acc_a2, ssq_k, ssq_q, sc0, sc1, sc2, b_b


@triton.jit
def _store_col(p_a, p_l, acc_a, acc_l, r_q, r_k, ssq_c, j: tl.constexpr):
    """Column block j of Aqk, and of L into Aqk's unused upper blocks (transposed), for the rows below it."""
    blk = tl.arange(0, 64) // 16
    n_c = (1.0 / tl.sqrt(ssq_c + 1e-6))[None, :]
    tl.store(p_a + 16 * j, acc_a * r_q * n_c, mask=blk[:, None] > j)
    tl.store(p_l + 16 * 64 * j, acc_l * r_k * n_c, mask=blk[:, None] > j)


@triton.jit
def _merge(aqk, ai, o_r, SP: tl.constexpr):
    """The off-diagonal blocks of ``(I + L)^-1`` (block lower triangular) from kernel D's diagonal inverses in
    ``ai`` and L's blocks parked transposed in Aqk's upper blocks (stored before a barrier):
    ``Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj``, column block by column block, the sums P_i accumulated as
    each ``Ai_mj`` is known, so that few blocks are live at once."""
    ai_m = tl.load(_blk(ai, 0, 0, o_r))
    p1 = _mm(tl.load(_blk_t(aqk, 1, 0, o_r)), ai_m, SP)
    p2 = _mm(tl.load(_blk_t(aqk, 2, 0, o_r)), ai_m, SP)
    p3 = _mm(tl.load(_blk_t(aqk, 3, 0, o_r)), ai_m, SP)
    ai_m = -_mm(tl.load(_blk(ai, 1, 1, o_r)), p1, SP)
    tl.store(_blk(ai, 1, 0, o_r), ai_m)
    p2 += _mm(tl.load(_blk_t(aqk, 2, 1, o_r)), ai_m, SP)
    p3 += _mm(tl.load(_blk_t(aqk, 3, 1, o_r)), ai_m, SP)
    ai_m = -_mm(tl.load(_blk(ai, 2, 2, o_r)), p2, SP)
    tl.store(_blk(ai, 2, 0, o_r), ai_m)
    p3 += _mm(tl.load(_blk_t(aqk, 3, 2, o_r)), ai_m, SP)
    tl.store(_blk(ai, 3, 0, o_r), -_mm(tl.load(_blk(ai, 3, 3, o_r)), p3, SP))
    ai_m = tl.load(_blk(ai, 1, 1, o_r))
    p2 = _mm(tl.load(_blk_t(aqk, 2, 1, o_r)), ai_m, SP)
    p3 = _mm(tl.load(_blk_t(aqk, 3, 1, o_r)), ai_m, SP)
    ai_m = -_mm(tl.load(_blk(ai, 2, 2, o_r)), p2, SP)
    tl.store(_blk(ai, 2, 1, o_r), ai_m)
    p3 += _mm(tl.load(_blk_t(aqk, 3, 2, o_r)), ai_m, SP)
    tl.store(_blk(ai, 3, 1, o_r), -_mm(tl.load(_blk(ai, 3, 3, o_r)), p3, SP))
    p3 = _mm(tl.load(_blk_t(aqk, 3, 2, o_r)), tl.load(_blk(ai, 2, 2, o_r)), SP)
    tl.store(_blk(ai, 3, 2, o_r), -_mm(tl.load(_blk(ai, 3, 3, o_r)), p3, SP))


@triton.jit
def kda_intra64_offdiag_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai,
    stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Grid (chunks, H): the off-diagonal blocks of Aqk and of (I + L)^-1, after kda_intra64_diag_kernel has
    written the diagonal inverses. One pass over K per column block, so that only its two accumulators are
    live (ONE_PASS: all three in one pass, fewer instructions, more registers); Aqk's blocks go out, L's to
    Aqk's unused blocks above the diagonal (transposed) for the merge to read back block by block."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    r0, left = _chunk_rows(cu_seqlens, chunk_indices, i_c, 0)
    q += r0 * stride_q_t + i_h * K
    k += r0 * stride_k_t + i_h * K
    g += r0 * stride_g_t
    beta += r0 * stride_b_t
    aqk += (i_c * H + i_h).to(tl.int64) * 4096
    ai += (i_c * H + i_h).to(tl.int64) * 4096
    LP: tl.constexpr = LOCAL_PRECISION
    SP: tl.constexpr = SOLVE_PRECISION
    o_t = tl.arange(0, 64)
    o_r = tl.arange(0, 16)
    p_a = aqk + o_t[:, None] * 64 + o_r[None, :]
    p_l = aqk + o_r[None, :] * 64 + o_t[:, None]
    args = (q, k, g, beta, A_log, dt_bias, lower_bound, left, i_h, stride_q_t, stride_k_t, stride_g_t, stride_b_t)
    # the L2 norms, the scale and beta as row and column factors of the raw products
    if ONE_PASS:
        acc_l0, acc_a0, acc_l1, acc_a1, acc_l2, acc_a2, ssq_k, ssq_q, sc0, sc1, sc2, b_b = _one_pass(
            *args, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, LP)
        r_q = (scale / tl.sqrt(ssq_q + 1e-6))[:, None]
        r_k = (b_b / tl.sqrt(ssq_k + 1e-6))[:, None]
        _store_col(p_a, p_l, acc_a0, acc_l0, r_q, r_k, sc0, 0)
        _store_col(p_a, p_l, acc_a1, acc_l1, r_q, r_k, sc1, 1)
        _store_col(p_a, p_l, acc_a2, acc_l2, r_q, r_k, sc2, 2)
    else:
        acc_l, acc_a, ssq_k, ssq_q, ssq_c, b_b = _col_pass(*args, 0, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND,
                                                           BETA_LOGITS, LP)
        r_q = (scale / tl.sqrt(ssq_q + 1e-6))[:, None]
        r_k = (b_b / tl.sqrt(ssq_k + 1e-6))[:, None]
        _store_col(p_a, p_l, acc_a, acc_l, r_q, r_k, ssq_c, 0)
        acc_l, acc_a, _sk, _sq, ssq_c, _bb = _col_pass(*args, 1, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND,
                                                       BETA_LOGITS, LP)
        _store_col(p_a, p_l, acc_a, acc_l, r_q, r_k, ssq_c, 1)
        acc_l, acc_a, _sk, _sq, ssq_c, _bb = _col_pass(*args, 2, K, KS, GATE_IN_KERNEL, HAS_LOWER_BOUND,
                                                       BETA_LOGITS, LP)
        _store_col(p_a, p_l, acc_a, acc_l, r_q, r_k, ssq_c, 2)
    tl.debug_barrier()  # L's blocks are read back below by other threads
    _merge(aqk, ai, o_r, SP)

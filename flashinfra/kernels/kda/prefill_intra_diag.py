"""KDA prefill in 64-token chunks, the diagonal blocks of the in-chunk matrices: one program per (chunk, 16-token
sub-block, head) forms, from the gate pass's cumulative log-decay ``gc`` and beta ``bc`` and the L2-normalised q
and k, the diagonal block of ``L = beta k k^T`` (strictly lower) and of ``Aqk = q k^T`` (lower, diagonal
included) against the sub-block's middle row, and ``(I + L_ii)^-1`` by forward substitution (15 row steps of
float32 vector work). The per-token log-decay is clamped at -10 by the gate pass, so every factor stays within
``exp(+-80)``; q and k are normalised first, over K in slices, so nothing overflows.

It also writes the rows' norm factors ``rn`` ([chunks, H, 2, 64] float32: ``scale / |q_r|`` then ``1 / |k_r|``,
eps inside the root), which the off-diagonal and w/u kernels read instead of summing squares again, and, from
the tiles its K loop holds, its rows of the state pass's ``qg = q exp(gc)`` and ``kd = k exp(gl - gc)`` (``gl``
the chunk's last row of ``gc``), and with ``KG`` (bf16 v) ``-kg = -k exp(gc)`` and ``exp(gl)``, with which the
state pass applies w's product itself and the w/u kernel is not launched.

``Ai`` is written as [chunks, H, 64, 64] float32 (the blocks above the diagonal are scratch, masked by its
readers); ``Aqk``, which only the state pass reads, as [chunks, H, slots, 64, 64] bf16, its lo half in a second
slot where asked, zeros above the diagonal included (the state pass reads whole tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.common import LOG2E, chunk_rows, exp2, load_rows, store_pair


@triton.jit
def _diag_slice(q, k, gc, gl, rows, m_t, stride_q_t, stride_k_t, k0, K: tl.constexpr, KS: tl.constexpr):
    """The sub-block's tiles of K slice ``k0``, as loaded (q and k in their dtype): its 16 rows of ``gc``, the
    middle row (row 8; padding rows past a sequence's end exist: no mask), the chunk's last row ``gl``, k and
    q."""
    o_r = tl.arange(0, 16)
    o_s = tl.arange(0, KS)
    m_tk = m_t[:, None] & (o_s < KS)[None, :]
    b_gc = tl.load(gc + k0 + o_r[:, None] * K + o_s[None, :])
    b_gm = tl.load(gc + k0 + 8 * K + o_s)
    b_gl = tl.load(gl + k0 + o_s)
    b_k = tl.load(k + k0 + rows[:, None] * stride_k_t + o_s[None, :], mask=m_tk, other=0.0)
    b_q = tl.load(q + k0 + rows[:, None] * stride_q_t + o_s[None, :], mask=m_tk, other=0.0)
    return b_gc, b_gm, b_gl, b_k, b_q


@triton.jit
def kda_intra_diag_kernel(
    q, k, gc, bc, cu_seqlens, chunk_indices, aqk, ai, rn, stride_q_t, stride_k_t, scale, wqk, egl,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, LOCAL_PRECISION: tl.constexpr, A_LO: tl.constexpr,
    FAST_EXP: tl.constexpr, NS: tl.constexpr, SQ: tl.constexpr, SKD: tl.constexpr,
    KD_LO: tl.constexpr, KG: tl.constexpr = False, W_LO: tl.constexpr = False,
):
    """Grid (chunks * 4, H): the diagonal blocks of Aqk and (I + L)^-1 (zeros above their diagonals), Aqk's
    zeros right of its diagonal block (A_LO: Aqk's lo halves too) and the sub-block's rows' norm factors ``rn``;
    ``gc`` and ``bc`` are the gate pass's scratch (prefill_gate.py); FAST_EXP: ``exp2`` (the exponents are
    within +-80 / ln 2, so none is flushed); and the sub-block's rows of the state pass's ``qg = q exp(gc)`` and
    ``kd = k exp(gl - gc)`` (``gl`` the chunk's last row of ``gc``) from the tiles its K loop holds, into the
    scratch ``wqk`` ([chunks, H, NS, 64, K] bf16: qg at slot SQ and kd at SKD, kd followed by its lo half with
    KD_LO), whose w slots the w/u kernel fills. With KG the w slots take ``-kg = -k exp(gc)`` instead (with W_LO
    its lo half too), and ``egl`` [chunks, H, K] float32 ``exp(gl)`` (the last sub-block's programs): the state
    pass then applies w's product itself (``v' = Aib (v - kg S)``) and the w/u kernel is not launched."""
    i_cb, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_b = i_cb // 4, i_cb % 4
    r0, left = chunk_rows(cu_seqlens, chunk_indices, i_c, i_b)
    q += r0 * stride_q_t + i_h * K
    k += r0 * stride_k_t + i_h * K
    # sub-block i_b of the chunk-head's [64, K] rows (padding rows past the end exist: no mask)
    gc += (i_c * H + i_h).to(tl.int64) * (64 * K) + i_b * (16 * K)
    gl = gc + (63 - 16 * i_b) * K  # the chunk's row 63 (its total: prefill_gate.py)
    wqk += (i_c * H + i_h).to(tl.int64) * (NS * 64 * K) + i_b * (16 * K)
    bc += (i_c * H + i_h).to(tl.int64) * 64 + i_b * 16
    o_r = tl.arange(0, 16)
    o_s = tl.arange(0, KS)
    rows = o_r
    m_t = o_r < left
    ssq_q = tl.zeros([16], dtype=tl.float32)
    ssq_k = tl.zeros([16], dtype=tl.float32)
    for ks in range(K // KS):
        m_tk = m_t[:, None] & (o_s[None, :] >= 0)
        b_q = load_rows(q + ks * KS, rows, m_tk, stride_q_t, o_s)
        b_k = load_rows(k + ks * KS, rows, m_tk, stride_k_t, o_s)
        ssq_q += tl.sum(b_q * b_q, 1)
        ssq_k += tl.sum(b_k * b_k, 1)
    r_q = scale / tl.sqrt(ssq_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    acc_l = tl.zeros([16, 16], dtype=tl.float32)
    acc_a = tl.zeros([16, 16], dtype=tl.float32)
    b_b = tl.load(bc + o_r)
    # each K slice's tiles are loaded while the slice before it is multiplied: loaded where they are used, they
    # waited for the previous slice's products (their barriers), one round trip per slice
    b_gc, b_gm, b_gl, b_k, b_q = _diag_slice(q, k, gc, gl, rows, m_t, stride_q_t, stride_k_t, 0, K, KS)
    for ks in tl.static_range(K // KS):
        n_gc, n_gm, n_gl, n_k, n_q = b_gc, b_gm, b_gl, b_k, b_q
        if ks + 1 < K // KS:
            n_gc, n_gm, n_gl, n_k, n_q = _diag_slice(q, k, gc, gl, rows, m_t, stride_q_t, stride_k_t, (ks + 1) * KS,
                                                     K, KS)
        # the pass's sums start at the chunk: their differences are the block's
        b_e = exp2((b_gc - b_gm[None, :]) * LOG2E, FAST_EXP)
        b_k = b_k.to(tl.float32) * r_k[:, None]
        b_q = b_q.to(tl.float32) * r_q[:, None]
        # the state pass's qg and kd rows (the exponents at most 0: ``exp2`` flushes only factors below 2^-126)
        off = o_r[:, None] * K + ks * KS + o_s[None, :]
        b_eg = exp2(b_gc * LOG2E, FAST_EXP)
        store_pair(wqk + SQ * (64 * K) + off, b_q * b_eg, False, 64 * K)
        if KG:
            store_pair(wqk + off, -(b_k * b_eg), W_LO, 64 * K)
            if i_b == 3:
                tl.store(egl + (i_c * H + i_h).to(tl.int64) * K + ks * KS + o_s, tl.exp(b_gl))
        store_pair(wqk + SKD * (64 * K) + off, b_k * exp2((b_gl[None, :] - b_gc) * LOG2E, FAST_EXP), KD_LO, 64 * K)
        b_kt = tl.trans(b_k * exp2((b_gm[None, :] - b_gc) * LOG2E, FAST_EXP))
        acc_l = tl.dot(b_k * b_e, b_kt, acc_l, input_precision=LOCAL_PRECISION)
        acc_a = tl.dot(b_q * b_e, b_kt, acc_a, input_precision=LOCAL_PRECISION)
        b_gc, b_gm, b_gl, b_k, b_q = n_gc, n_gm, n_gl, n_k, n_q
    b_l = tl.where(o_r[:, None] > o_r[None, :], acc_l * b_b[:, None], 0.0)
    i_ch = (i_c * H + i_h).to(tl.int64)
    # the rows' norm factors, once for kernels A and B (stored after the loads above: a store before them would
    # hold them back, as a possible alias)
    tl.store(rn + i_ch * 128 + i_b * 16 + o_r, r_q)
    tl.store(rn + i_ch * 128 + 64 + i_b * 16 + o_r, r_k)
    aqk += i_ch * ((1 + A_LO) * 4096) + i_b * (16 * 64 + 16)
    ai += i_ch * 4096 + i_b * (16 * 64 + 16)
    off = o_r[:, None] * 64 + o_r[None, :]
    store_pair(aqk + off, tl.where(o_r[:, None] >= o_r[None, :], acc_a, 0.0), A_LO, 4096)
    # the row block's upper blocks, zeros (the state pass multiplies by whole [64, 64] tiles)
    o_u = tl.arange(0, 64)
    p_u = aqk + 16 + o_r[:, None] * 64 + o_u[None, :]
    m_u = (o_r[:, None] >= 0) & (o_u < 48 - 16 * i_b)[None, :]
    zero = tl.zeros([16, 64], dtype=tl.bfloat16)
    tl.store(p_u, zero, mask=m_u)
    if A_LO:
        tl.store(p_u + 4096, zero, mask=m_u)
    # X = (I + L)^-1 row by row: X_i = e_i - sum_{m < i} L_im X_m (L_im = 0 for m >= i)
    b_x = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    tl.store(ai + off, b_l)
    tl.debug_barrier()  # the rows stored above are read back by other threads
    p_row = ai + o_r
    for i in range(1, 16):
        b_li = tl.load(p_row + i * 64)
        b_x = tl.where((o_r == i)[:, None], b_x - tl.sum(b_li[:, None] * b_x, 0)[None, :], b_x)
    tl.debug_barrier()  # every row read before the inverse overwrites them
    tl.store(ai + off, b_x)

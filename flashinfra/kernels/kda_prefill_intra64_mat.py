"""KDA prefill (v3), the in-chunk matrices in whole-chunk programs: per 64-token chunk and head, kernel M forms
every block of ``Aqk = q k^T`` and ``L = beta k k^T`` (decay-weighted) over K in slices, as 64-row products, and
kernel I inverts ``I + L`` from them. They do the work of kernels D and A (kda_prefill_intra64_split.py,
kda_prefill_intra64_rows.py) and write the same outputs: Aqk (bf16, its lo half with A_LO, zeros above the
diagonal), ``Ai = (I + L)^-1`` (float32, its blocks above the diagonal left as scratch) and the rows' norm factors.

Kernel M, one program per chunk-head on four warps, reads each K slice's q, k and ``gc`` tiles once ([64, KS],
by the copy engine) and forms from them:

- the diagonal blocks, as one [64, 64] product against each 16-row block's middle row (every factor within
  ``exp(+-80)``, as kernel D's), whose blocks off the diagonal are discarded (their factors do not cancel and may
  overflow, so they go to accumulators of their own);
- the blocks below the diagonal, per column block j, as a [64, 16] product: rows of the blocks below j against
  the end of the block above them, ``x_r exp(gc_r - e_{b-1})``, times the blocks' totals ``exp(e_{b-1} - e_j)``
  (vectors), columns ``k_c exp(e_j - gc_c)`` from block j's own [16, KS] tiles; every factor is at most 1, so a
  factor underflows only where the product does, as in kernel A.

The rows' norms are summed in the same pass and scale the sums at the end (exact as scalings). L goes to a
scratch matrix, which kernel I (one program per chunk-head, one warp) reads: each diagonal block's inverse by
forward substitution, then kernel A's merge of the blocks below the diagonal (``_merge``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_prefill_intra64_rows import _blk, _merge
from flashinfra.kernels.kda_prefill_intra64_split import LOG2E, chunk_rows, exp2, store_pair


@triton.jit
def _col_block(k16_d, gc16_d, r0, g_row, h_col, kc, left, j: tl.constexpr, e_j, FAST_EXP: tl.constexpr):
    """Column block j of the products below the diagonal, transposed ([KS, 16]): block j's k rows (zero past the
    sequence's end) times ``exp(e_j - gc_c)`` against the block's last row ``e_j`` (log2 units, [1, KS])."""
    m = (16 * j + tl.arange(0, 16) < left)[:, None]
    b_k = tl.where(m, k16_d.load([r0 + 16 * j, h_col + kc]).to(tl.float32), 0.0)
    b_g = gc16_d.load([g_row + 16 * j, kc]) * LOG2E
    return tl.trans(b_k * exp2(e_j - b_g, FAST_EXP))


@triton.jit
def _row_at(b_g, row: tl.constexpr):
    """Row ``row`` of a [64, KS] tile as a [1, KS] tile."""
    return tl.gather(b_g, tl.full([1, b_g.shape[1]], row, tl.int32), 0)


@triton.jit
def _store_below(aqk, lbuf, a_j, l_j, r_q, r_l, r_k, blk, j: tl.constexpr, A_LO: tl.constexpr):
    """Column block j of Aqk and L below the diagonal (rows of the blocks below j), scaled by the rows' and the
    columns' factors."""
    o_b = tl.arange(0, 16)
    n_j = tl.gather(r_k, 16 * j + o_b, 0)[None, :]
    p = tl.arange(0, 64)[:, None] * 64 + 16 * j + o_b[None, :]
    store_pair(aqk + p, a_j * r_q[:, None] * n_j, A_LO, 4096, blk > j)
    tl.store(lbuf + p, l_j * r_l * n_j, mask=blk > j)


@triton.jit
def kda_intra64_mat_kernel(
    bc, cu_seqlens, chunk_indices, aqk, lbuf, rn, q_d, k_d, gc_d, k16_d, gc16_d, scale,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, LOCAL_PRECISION: tl.constexpr, A_LO: tl.constexpr,
    FAST_EXP: tl.constexpr, STAGES: tl.constexpr,
):
    """Grid (chunks, H): Aqk (every block), L (into ``lbuf``, [chunks, H, 64, 64] float32: its diagonal blocks
    with zeros above their diagonals, and the blocks below them) and the norm factors ``rn``. ``q_d``, ``k_d``:
    descriptors over q's and k's [T, H * K] rows in [64, KS] tiles, ``k16_d`` in [16, KS] tiles; ``gc_d`` and
    ``gc16_d`` over the gate pass's ``gc`` as [chunks * H * 64, K] in [64, KS] and [16, KS] tiles."""
    LP: tl.constexpr = LOCAL_PRECISION
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    r0, left = chunk_rows(cu_seqlens, chunk_indices, i_c, 0)
    r0 = r0.to(tl.int32)
    i_ch = i_c * H + i_h
    g_row = i_ch * 64
    h_col = i_h * K
    o_r = tl.arange(0, 64)
    blk = (o_r // 16)[:, None]
    m_t = (o_r < left)[:, None]
    i_mid = tl.broadcast_to(16 * blk + 8, (64, KS))
    i_prev = tl.broadcast_to(tl.maximum(16 * blk - 1, 0), (64, KS))
    i_end = tl.broadcast_to(16 * blk + 15, (64, KS))
    ssq_q = tl.zeros([64], dtype=tl.float32)
    ssq_k = tl.zeros([64], dtype=tl.float32)
    acc_a = tl.zeros([64, 64], dtype=tl.float32)
    acc_l = tl.zeros([64, 64], dtype=tl.float32)
    a0 = tl.zeros([64, 64], dtype=tl.float32)
    l0 = tl.zeros([64, 64], dtype=tl.float32)
    for kc in tl.range(0, K, KS, num_stages=STAGES):
        b_q = tl.where(m_t, q_d.load([r0, h_col + kc]).to(tl.float32), 0.0)
        b_k = tl.where(m_t, k_d.load([r0, h_col + kc]).to(tl.float32), 0.0)
        b_g = gc_d.load([g_row, kc]) * LOG2E
        ssq_q += tl.sum(b_q * b_q, 1)
        ssq_k += tl.sum(b_k * b_k, 1)
        # the diagonal blocks, against each block's middle row
        g_mid = tl.gather(b_g, i_mid, 0)
        b_f = exp2(b_g - g_mid, FAST_EXP)
        k_m = tl.trans(b_k * exp2(g_mid - b_g, FAST_EXP))
        acc_a = tl.dot(b_q * b_f, k_m, acc_a, input_precision=LP)
        acc_l = tl.dot(b_k * b_f, k_m, acc_l, input_precision=LP)
        # the blocks below: rows against the end of the block above them, then the blocks' totals
        b_t = exp2(b_g - tl.gather(b_g, i_prev, 0), FAST_EXP)
        x_q = b_q * b_t
        x_k = b_k * b_t
        e0, e1, e2 = _row_at(b_g, 15), _row_at(b_g, 31), _row_at(b_g, 47)
        v10 = exp2(e1 - e0, FAST_EXP)
        v20 = exp2(e2 - e0, FAST_EXP)
        v21 = exp2(e2 - e1, FAST_EXP)
        # every column against its own block's last row; column block j of it is the operand of block j
        c_own = b_k * exp2(tl.gather(b_g, i_end, 0) - b_g, FAST_EXP)
        f = tl.where(blk == 1, 1.0, tl.where(blk == 2, v10, tl.where(blk == 3, v20, 0.0)))
        c = tl.trans(tl.where(blk == 0, c_own, 0.0))
        a0 = tl.dot(x_q * f, c, a0, input_precision=LP)
        l0 = tl.dot(x_k * f, c, l0, input_precision=LP)
        f = tl.where(blk == 2, 1.0, tl.where(blk == 3, v21, 0.0))
        c = tl.trans(tl.where(blk == 1, c_own, 0.0))
        a0 = tl.dot(x_q * f, c, a0, input_precision=LP)
        l0 = tl.dot(x_k * f, c, l0, input_precision=LP)
        f = tl.where(blk == 3, 1.0, 0.0)
        c = tl.trans(tl.where(blk == 2, c_own, 0.0))
        a0 = tl.dot(x_q * f, c, a0, input_precision=LP)
        l0 = tl.dot(x_k * f, c, l0, input_precision=LP)
    r_q = scale / tl.sqrt(ssq_q + 1e-6)
    r_k = 1.0 / tl.sqrt(ssq_k + 1e-6)
    i_ch64 = i_ch.to(tl.int64)
    b_b = tl.load(bc + i_ch64 * 64 + o_r)
    tl.store(rn + i_ch64 * 128 + o_r, r_q)
    tl.store(rn + i_ch64 * 128 + 64 + o_r, r_k)
    r_l = (b_b * r_k)[:, None]
    o_c = tl.arange(0, 64)
    same = blk == (o_c // 16)[None, :]
    below = o_r[:, None] - o_c[None, :]
    aqk += i_ch64 * ((1 + A_LO) * 4096)
    lbuf += i_ch64 * 4096
    off = o_r[:, None] * 64 + o_c[None, :]
    # the diagonal blocks (with the zeros above them: the state pass multiplies whole tiles) and the blocks below
    store_pair(aqk + off, tl.where(same, tl.where(below >= 0, acc_a, 0.0), a0) * r_q[:, None] * r_k[None, :], A_LO,
               4096)
    tl.store(lbuf + off, tl.where(same, tl.where(below > 0, acc_l, 0.0), l0) * r_l * r_k[None, :])


@triton.jit
def _inverse(p, o_r):
    """``(I + L_bb)^-1`` for the [16, 16] diagonal block at p (L strictly lower) by forward substitution,
    ``X_i = e_i - sum_{m < i} L_im X_m``, its rows of L read from memory."""
    b_x = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        b_li = tl.load(p + i * 64 + o_r)
        b_x = tl.where((o_r == i)[:, None], b_x - tl.sum(b_li[:, None] * b_x, 0)[None, :], b_x)
    return b_x


@triton.jit
def kda_intra64_inv_kernel(lbuf, ai, H: tl.constexpr, SOLVE_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Grid (chunks, H), after kda_intra64_mat_kernel: ``Ai = (I + L)^-1``'s diagonal blocks and the blocks below
    them (the merge in SOLVE_PRECISION, ``_merge``), from L in ``lbuf``."""
    i_ch64 = (tl.program_id(0) * H + tl.program_id(1)).to(tl.int64)
    lbuf += i_ch64 * 4096
    ai += i_ch64 * 4096
    o_r = tl.arange(0, 16)
    d0 = _inverse(lbuf, o_r)
    d1 = _inverse(lbuf + 16 * 64 + 16, o_r)
    d2 = _inverse(lbuf + 32 * 64 + 32, o_r)
    d3 = _inverse(lbuf + 48 * 64 + 48, o_r)
    l10, l20, l21 = tl.load(_blk(lbuf, 1, 0, o_r)), tl.load(_blk(lbuf, 2, 0, o_r)), tl.load(_blk(lbuf, 2, 1, o_r))
    l30, l31, l32 = tl.load(_blk(lbuf, 3, 0, o_r)), tl.load(_blk(lbuf, 3, 1, o_r)), tl.load(_blk(lbuf, 3, 2, o_r))
    tl.store(_blk(ai, 0, 0, o_r), d0)
    tl.store(_blk(ai, 1, 1, o_r), d1)
    tl.store(_blk(ai, 2, 2, o_r), d2)
    tl.store(_blk(ai, 3, 3, o_r), d3)
    _merge(ai, l10, l20, l21, l30, l31, l32, d0, d1, d2, d3, o_r, SOLVE_PRECISION, DOT_F32)

"""KDA prefill in 64-token chunks, the off-diagonal blocks of the in-chunk matrices: per chunk and head, the
off-diagonal blocks of ``Aqk = q k^T`` and ``L = beta k k^T`` and the merge into the off-diagonal blocks of
``(I + L)^-1``, after the diagonal kernel (prefill_intra_diag.py) has written the diagonal blocks and their
inverses. Aqk's lower blocks go out (bf16, for the state pass's output product); L's blocks stay in registers
with the four diagonal inverses, and the merge ``Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj`` runs on them column
block by column block, so only its results go to memory. With ``AIB`` (bf16 v) the inverse goes out as ``Aib =
Ai diag(beta)`` in bf16 hi + lo pairs, for the state pass.

Only the six pairs (i, j), i > j, of 16-row blocks are formed, as [16, 16] products over K in slices, against the
boundary ``b_i`` between blocks i - 1 and i (the decay summed up to the end of block i - 1):

- rows of block i: ``x_r exp(gc_r - b_i)``, the cumulative decay inside block i alone (shared by its q and k);
- columns of block j: ``k_c exp(ge_j - gc_c)`` against block j's last row ``ge_j``, times ``exp(s_m)`` for
  each block m strictly between j and i (``s_m`` its decay summed over its rows), applied to the column operand
  as the loop reaches block m.

Every factor is at most 1 (the per-token log-decay is at most 0), exact for any gate: the product
``exp(gc_r - gc_c)`` is their product, so a factor underflows only where the product does. The q/k L2 norms (the
diagonal kernel's factors ``rn``), the scale and beta are row and column factors applied at the store. A [16, 16]
product on mma.sync runs in every warp of a program, so one program is one warp; its q, k and ``gc`` tiles come
by the copy engine into shared memory, ``STAGES`` K slices in flight (rows past the sequence's end zeroed after
the load). Every exponent is a difference of two entries of ``gc`` (whose padding rows past a sequence's end
repeat its last token's sum).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.common import LOG2E, chunk_rows, exp2, mm_f32, store_pair


@triton.jit
def _exp2_rows(x, FAST_EXP: tl.constexpr):
    """``exp2`` for the row factors, marked not pure: as a pure chain load -> exponential -> product Triton
    moves it into the products' operand layout, each of the gate tile, its boundary row, q and k through shared
    memory (26 barriers per K slice instead of 8, compiled for sm_90); not pure, the exponential stays in the
    load layout and only the row products go through shared memory."""
    return exp2(x, FAST_EXP, False)


@triton.jit
def _blk_in(q_d, k_d, gc_d, r0, g_row, h_col, kc, left, m: tl.constexpr, WITH_Q: tl.constexpr):
    """Block m's K slice (columns ``kc`` on): q (with WITH_Q, else k again) and k, rows past the sequence's end
    zeroed, from their rows' descriptors (``r0`` the chunk's first row, ``h_col`` the head's first column); the
    gate pass's chunk-relative cumulative decay (``g_row`` the chunk-head's first row of its scratch) on the
    block's rows and on its last row, as a [1, KS] row, both in log2 units (``_row_blocks`` takes them relative
    to the previous block's last row). The last row is gathered (one shuffle per element) rather than loaded
    again, so that ``last - cumsum`` is exactly 0 on the last row and the column factors stay at most 1."""
    m_t = (16 * m + tl.arange(0, 16) < left)[:, None]
    b_gc = gc_d.load([g_row + 16 * m, kc]) * LOG2E  # the exponentials below are powers of two
    b_k = tl.where(m_t, k_d.load([r0 + 16 * m, h_col + kc]).to(tl.float32), 0.0)
    if WITH_Q:
        b_q = tl.where(m_t, q_d.load([r0 + 16 * m, h_col + kc]).to(tl.float32), 0.0)
    else:
        b_q = b_k
    return b_q, b_k, b_gc, tl.gather(b_gc, tl.full([1, b_gc.shape[1]], 15, tl.int32), 0)


@triton.jit
def _row_blocks(q_d, k_d, gc_d, r0, g_row, h_col, left, K: tl.constexpr, KS: tl.constexpr, LP: tl.constexpr,
                FAST_EXP: tl.constexpr, STAGES: tl.constexpr):
    """The raw products of the six block pairs over K in slices (accumulators ``a_ij`` for Aqk, ``l_ij`` for
    L). Per slice the blocks come in order, each leaving its column operand ``c_j`` for the blocks below; ``c_j``
    takes block m's ``exp(s_m)`` once block m has used it (``s_m`` its last row minus the previous block's, at
    most 0). The slices' tiles come by the copy engine, ``STAGES`` slices in flight."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    a10, l10, a20, l20, a21, l21, a30, l30, a31, l31, a32, l32 = z, z, z, z, z, z, z, z, z, z, z, z
    for kc in tl.range(0, K, KS, num_stages=STAGES):
        _q0, b_k, b_gc, b_s = _blk_in(q_d, k_d, gc_d, r0, g_row, h_col, kc, left, 0, False)
        c0 = b_k * exp2(b_s - b_gc, FAST_EXP)
        b_p = b_s
        # block 1: rows against c0
        b_q, b_k, b_gc, b_s = _blk_in(q_d, k_d, gc_d, r0, g_row, h_col, kc, left, 1, True)
        b_f = _exp2_rows(b_gc - b_p, FAST_EXP)
        t0 = tl.trans(c0)
        a10 = tl.dot(b_q * b_f, t0, a10, input_precision=LP)
        l10 = tl.dot(b_k * b_f, t0, l10, input_precision=LP)
        c1 = b_k * exp2(b_s - b_gc, FAST_EXP)
        c0 = c0 * exp2(b_s - b_p, FAST_EXP)
        b_p = b_s
        # block 2: rows against c0, c1
        b_q, b_k, b_gc, b_s = _blk_in(q_d, k_d, gc_d, r0, g_row, h_col, kc, left, 2, True)
        b_f = _exp2_rows(b_gc - b_p, FAST_EXP)
        x_q, x_k = b_q * b_f, b_k * b_f
        t0, t1 = tl.trans(c0), tl.trans(c1)
        a20 = tl.dot(x_q, t0, a20, input_precision=LP)
        l20 = tl.dot(x_k, t0, l20, input_precision=LP)
        a21 = tl.dot(x_q, t1, a21, input_precision=LP)
        l21 = tl.dot(x_k, t1, l21, input_precision=LP)
        c2 = b_k * exp2(b_s - b_gc, FAST_EXP)
        e2 = exp2(b_s - b_p, FAST_EXP)
        b_p = b_s
        c0 = c0 * e2
        c1 = c1 * e2
        # block 3: rows against c0, c1, c2
        b_q, b_k, b_gc, _s3 = _blk_in(q_d, k_d, gc_d, r0, g_row, h_col, kc, left, 3, True)
        b_f = _exp2_rows(b_gc - b_p, FAST_EXP)
        x_q, x_k = b_q * b_f, b_k * b_f
        t0, t1, t2 = tl.trans(c0), tl.trans(c1), tl.trans(c2)
        a30 = tl.dot(x_q, t0, a30, input_precision=LP)
        l30 = tl.dot(x_k, t0, l30, input_precision=LP)
        a31 = tl.dot(x_q, t1, a31, input_precision=LP)
        l31 = tl.dot(x_k, t1, l31, input_precision=LP)
        a32 = tl.dot(x_q, t2, a32, input_precision=LP)
        l32 = tl.dot(x_k, t2, l32, input_precision=LP)
    return a10, l10, a20, l20, a21, l21, a30, l30, a31, l31, a32, l32


@triton.jit
def _row_factors(bc, rn, m: tl.constexpr):
    """Row block m's factors: ``scale / |q_r|`` for Aqk, ``beta_r / |k_r|`` for L (the diagonal kernel's norm factors
    ``rn`` and the gate pass's beta at the chunk-head)."""
    o_r = 16 * m + tl.arange(0, 16)
    return tl.load(rn + o_r)[:, None], (tl.load(bc + o_r) * tl.load(rn + 64 + o_r))[:, None]


@triton.jit
def _blk(p, i: tl.constexpr, j: tl.constexpr, o_r):
    """Pointers to block (i, j) of a [64, 64] matrix at p."""
    return p + (16 * i + o_r)[:, None] * 64 + 16 * j + o_r[None, :]


@triton.jit
def _store_a(aqk, acc_a, r_q, n_c, i: tl.constexpr, j: tl.constexpr, A_LO: tl.constexpr):
    """Block (i, j) of Aqk, in bf16 (A_LO: its lo half in the next slot)."""
    store_pair(_blk(aqk, i, j, tl.arange(0, 16)), acc_a * r_q * n_c, A_LO, 4096)


@triton.jit
def _store_ai(ai, x, bc, i: tl.constexpr, j: tl.constexpr, o_r, AIB: tl.constexpr):
    """Block (i, j) of ``Ai`` in float32, or with AIB of ``Aib = Ai diag(beta)`` as a bf16 hi + lo pair (its
    columns scaled by their tokens' beta, ``bc`` at the chunk-head)."""
    if AIB:
        store_pair(_blk(ai, i, j, o_r), x * tl.load(bc + 16 * j + o_r)[None, :], True, 4096)
    else:
        tl.store(_blk(ai, i, j, o_r), x)


@triton.jit
def _merge(ai, bc, l10, l20, l21, l30, l31, l32, d0, d1, d2, d3, o_r, SP: tl.constexpr, DOT_F32: tl.constexpr,
           AIB: tl.constexpr):
    """The off-diagonal blocks of ``(I + L)^-1`` (block lower triangular) from the diagonal kernel's diagonal inverses
    ``d0..d3`` and L's blocks ``l_ij``, all in registers: ``Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj``, column
    block by column block; only the results go to memory (``_store_ai``). SP: the products' precision
    (``mm_f32``)."""
    F: tl.constexpr = DOT_F32
    ai10 = -mm_f32(d1, mm_f32(l10, d0, SP, F), SP, F)
    ai20 = -mm_f32(d2, mm_f32(l20, d0, SP, F) + mm_f32(l21, ai10, SP, F), SP, F)
    ai30 = -mm_f32(d3, mm_f32(l30, d0, SP, F) + mm_f32(l31, ai10, SP, F) + mm_f32(l32, ai20, SP, F), SP, F)
    ai21 = -mm_f32(d2, mm_f32(l21, d1, SP, F), SP, F)
    ai31 = -mm_f32(d3, mm_f32(l31, d1, SP, F) + mm_f32(l32, ai21, SP, F), SP, F)
    ai32 = -mm_f32(d3, mm_f32(l32, d2, SP, F), SP, F)
    _store_ai(ai, ai10, bc, 1, 0, o_r, AIB)
    _store_ai(ai, ai20, bc, 2, 0, o_r, AIB)
    _store_ai(ai, ai30, bc, 3, 0, o_r, AIB)
    _store_ai(ai, ai21, bc, 2, 1, o_r, AIB)
    _store_ai(ai, ai31, bc, 3, 1, o_r, AIB)
    _store_ai(ai, ai32, bc, 3, 2, o_r, AIB)


@triton.jit
def kda_intra_offdiag_kernel(
    bc, cu_seqlens, chunk_indices, aqk, ai, rn, q_d, k_d, gc_d, aib,
    H: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, LOCAL_PRECISION: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr, FAST_EXP: tl.constexpr, A_LO: tl.constexpr, DOT_F32: tl.constexpr = False,
    STAGES: tl.constexpr = 3, AIB: tl.constexpr = False,
):
    """Grid (chunks, H), after kda_intra_diag_kernel has written the diagonal inverses: Aqk's off-diagonal
    blocks (bf16; A_LO: with their lo halves), then Ai's off-diagonal blocks (L kept in registers). ``q_d`` and
    ``k_d``: descriptors over q's and k's [T, H * K] rows, ``gc_d`` over the gate pass's ``gc`` as [chunks * H *
    64, K] (prefill_gate.py), all in [16, KS] tiles (KS: the K slice); ``bc``: the pass's beta; FAST_EXP:
    ``exp2``; STAGES: the slices in flight. With AIB the whole inverse goes to ``aib`` instead, as ``Aib = Ai
    diag(beta)`` in bf16 hi + lo pairs ([chunks, H, 2, 64, 64], zeros above the diagonal blocks): the state pass
    reads it to form ``u = Aib v`` itself."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    r0, left = chunk_rows(cu_seqlens, chunk_indices, i_c, 0)
    bc += (i_c * H + i_h).to(tl.int64) * 64
    aqk += (i_c * H + i_h).to(tl.int64) * ((1 + A_LO) * 4096)
    ai += (i_c * H + i_h).to(tl.int64) * 4096
    a10, l10, a20, l20, a21, l21, a30, l30, a31, l31, a32, l32 = _row_blocks(
        q_d, k_d, gc_d, r0.to(tl.int32), (i_c * H + i_h) * 64, i_h * K, left, K, KS, LOCAL_PRECISION, FAST_EXP,
        STAGES)
    # the diagonal kernel's inverses, loaded before the stores so that their round trip overlaps them
    o_r = tl.arange(0, 16)
    d0, d1 = tl.load(_blk(ai, 0, 0, o_r)), tl.load(_blk(ai, 1, 1, o_r))
    d2, d3 = tl.load(_blk(ai, 2, 2, o_r)), tl.load(_blk(ai, 3, 3, o_r))
    # the column blocks' 1 / |k_c| (the diagonal kernel's)
    rn += (i_c * H + i_h).to(tl.int64) * 128
    n0 = tl.load(rn + 64 + o_r)[None, :]
    n1 = tl.load(rn + 80 + o_r)[None, :]
    n2 = tl.load(rn + 96 + o_r)[None, :]
    r_q, r_k = _row_factors(bc, rn, 1)
    _store_a(aqk, a10, r_q, n0, 1, 0, A_LO)
    l10 = l10 * r_k * n0
    r_q, r_k = _row_factors(bc, rn, 2)
    _store_a(aqk, a20, r_q, n0, 2, 0, A_LO)
    _store_a(aqk, a21, r_q, n1, 2, 1, A_LO)
    l20, l21 = l20 * r_k * n0, l21 * r_k * n1
    r_q, r_k = _row_factors(bc, rn, 3)
    _store_a(aqk, a30, r_q, n0, 3, 0, A_LO)
    _store_a(aqk, a31, r_q, n1, 3, 1, A_LO)
    _store_a(aqk, a32, r_q, n2, 3, 2, A_LO)
    l30, l31, l32 = l30 * r_k * n0, l31 * r_k * n1, l32 * r_k * n2
    if AIB:
        # the whole inverse goes to Aib's pair (two [64, 64] slots): its diagonal blocks and the zeros above them
        # (the state pass multiplies whole tiles) here, the merge's blocks below
        ai = aib + (i_c * H + i_h).to(tl.int64) * (2 * 4096)
        for b in tl.static_range(4):
            for c in tl.static_range(b + 1, 4):
                store_pair(_blk(ai, b, c, o_r), tl.zeros([16, 16], dtype=tl.float32), True, 4096)
        _store_ai(ai, d0, bc, 0, 0, o_r, True)
        _store_ai(ai, d1, bc, 1, 1, o_r, True)
        _store_ai(ai, d2, bc, 2, 2, o_r, True)
        _store_ai(ai, d3, bc, 3, 3, o_r, True)
    _merge(ai, bc, l10, l20, l21, l30, l31, l32, d0, d1, d2, d3, o_r, SOLVE_PRECISION, DOT_F32, AIB)

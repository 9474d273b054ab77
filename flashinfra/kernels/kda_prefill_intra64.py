"""KDA prefill (v3), the in-chunk pass: everything that does not depend on the state, for 64-token chunks,
every chunk of every sequence in parallel (grid: chunks x heads).

Per chunk it computes the gate (``kda_prefill_gated``: from the raw projection, with its lower bound), beta,
the q/k L2 norm and the cumulative decay ``gc`` from the chunk start, splits the chunk into four 16-token
sub-blocks and builds the decay-weighted products ``L = beta k k^T`` (strictly lower) and ``Aqk = q k^T``
(lower, diagonal included) block by block, each against a reference row that keeps every exponential
factor at most 1 or within ``exp(+-80)``:

- an off-diagonal block (rows in sub-block i, columns in sub-block j < i) uses the first row of sub-block i:
  ``exp(gc_r - gc_n) <= 1`` for its rows and ``exp(gc_n - gc_c) <= 1`` for its columns (formed as two
  factors, each at most 1), exact for any gate (a factor underflows only where the product does);
- a diagonal block uses its middle row; a per-token log-decay below -10 is clamped there (such a token keeps
  less than ``exp(-10)`` of the state), so the factors stay within ``exp(+-80)``.

Two kernels, so that neither holds the whole chunk's sub-blocks and products at once:
``kda_intra64_a_kernel`` builds the blocks and the WY inverse ``(I + L)^-1`` (per diagonal block as
``(I+N)(I+N^2)(I+N^4)(I+N^8)``, N = -L nilpotent, then merged block by block) and writes it and ``Aqk`` as
[64, 64] float32 matrices; ``kda_intra64_b_kernel`` takes the chunk as one tile and writes, in a chunk-major
layout that the state pass reads as whole tiles (rows past the end of a sequence are zeros):

- ``wqk`` bf16 [chunks, H, slots, 64, K]: ``w = Ai (beta k exp(gc))``, ``qw = q exp(gc) - Aqk w`` and
  ``kd = k exp(gl - gc)`` (``gl`` the chunk's total decay), each rounded to bf16 and, where the state pass's
  chain needs it, followed by its lo half (hi + lo within 2^-17 of the float32 value): 3 slots for the
  bf16x2 and bf16 chains, 5 for bf16x3 (w and kd pairs), one more for qw's lo half with ``out_x3``;
- ``uo`` float32 [chunks, H, 2, 64, V]: ``u = Ai (beta v)`` and ``ou = Aqk u`` (with ``ou_bf16``: bf16
  [chunks, H, 3, 64, V], u as a pair and ou rounded once, as the bf16 output is);
- ``egl`` float32 [chunks, H, K]: ``exp(gl)``.

With them the state pass needs, per chunk, ``v' = u - w S``, ``o = ou + qw S``, ``S = exp(gl) S + kd^T v'``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_gate import load_gate_beta


@triton.jit
def _load_norm(x, rows, m_tk, stride_t, i_h, o_k, K: tl.constexpr):
    """Rows of x for head i_h, L2-normalised, float32, zero past the end of the sequence."""
    b_x = tl.load(x + rows[:, None] * stride_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]


@triton.jit
def _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t, stride_b_t,
               K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
               BETA_LOGITS: tl.constexpr):
    """``load_gate_beta`` with v3's bound: per-token log-decay at least -10 (exact 16-token sub-blocks)."""
    return load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, -10.0)


@triton.jit
def _load_block(q, k, g, beta, A_log, dt_bias, lower_bound, rows, m_t, i_h, o_k, m_k,
                stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
                K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                BETA_LOGITS: tl.constexpr):
    """One 16-row sub-block: normalised q (times scale) and k, the clamped log-decay and beta."""
    m_tk = m_t[:, None] & m_k[None, :]
    b_g, b_b = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
    b_q = _load_norm(q, rows, m_tk, stride_q_t, i_h, o_k, K) * scale
    return b_q, _load_norm(k, rows, m_tk, stride_k_t, i_h, o_k, K), b_g, b_b


@triton.jit
def _diag(b_q, b_k, b_gc, b_b, o_c, PREC: tl.constexpr):
    """Diagonal sub-block against its middle row: L (strictly lower, times beta) and Aqk (lower)."""
    b_gm = tl.sum(tl.where((o_c == 8)[:, None], b_gc, 0.0), 0)
    b_e = tl.exp(b_gc - b_gm[None, :])
    b_kt = tl.trans(b_k * tl.exp(b_gm[None, :] - b_gc))
    b_L = tl.dot(b_k * b_e, b_kt, input_precision=PREC)
    b_A = tl.dot(b_q * b_e, b_kt, input_precision=PREC)
    b_L = tl.where(o_c[:, None] > o_c[None, :], b_L * b_b[:, None], 0.0)
    b_A = tl.where(o_c[:, None] >= o_c[None, :], b_A, 0.0)
    return b_L, b_A


@triton.jit
def _off(b_rk, b_rq, b_b, b_kt, b_ge, b_gn, PREC: tl.constexpr):
    """Off-diagonal sub-block (i, j): rows already scaled by exp(gc - gn_i) <= 1, columns
    ``k_j exp(ge_j - gc_j) exp(gn_i - ge_j)`` with ``ge_j`` the last row of block j (both factors <= 1)."""
    b_c = tl.trans(b_kt * tl.exp(b_gn - b_ge)[None, :])
    b_L = tl.dot(b_rk, b_c, input_precision=PREC) * b_b[:, None]
    b_A = tl.dot(b_rq, b_c, input_precision=PREC)
    return b_L, b_A


@triton.jit
def _inv_diag(b_L, o_c, PREC: tl.constexpr):
    """(I + L)^-1 for a strictly lower 16 x 16 block: (I+N)(I+N^2)(I+N^4)(I+N^8), N = -L."""
    b_P = -b_L
    b_Ai = (o_c[:, None] == o_c[None, :]).to(tl.float32) + b_P
    for _ in tl.static_range(3):
        b_P = tl.dot(b_P, b_P, input_precision=PREC)
        b_Ai = b_Ai + tl.dot(b_Ai, b_P, input_precision=PREC)
    return b_Ai


@triton.jit
def _first_row(b_gc, o_c):
    return tl.sum(tl.where((o_c == 0)[:, None], b_gc, 0.0), 0)


@triton.jit
def kda_intra64_a_kernel(
    q, k, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai,
    stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
    BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
):
    """Per chunk: Aqk (lower, with the diagonal) and (I + L)^-1, both [64, 64] float32; their blocks above
    the diagonal are left unwritten (the second kernel masks them)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, K)
    m_k = o_k < K
    LP: tl.constexpr = LOCAL_PRECISION
    SP: tl.constexpr = SOLVE_PRECISION
    r_0 = bos + t0 + o_c
    p_a = aqk + (i_c * H + i_h).to(tl.int64) * 4096 + o_c[:, None] * 64 + o_c[None, :]
    p_i = ai + (i_c * H + i_h).to(tl.int64) * 4096 + o_c[:, None] * 64 + o_c[None, :]
    q0, k0, g0, b0 = _load_block(q, k, g, beta, A_log, dt_bias, lower_bound, r_0, t0 + o_c < L, i_h, o_k, m_k,
                                 stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale, K, GATE_IN_KERNEL,
                                 HAS_LOWER_BOUND, BETA_LOGITS)
    # Only kt_j = k_j exp(ge_j - gc_j) and ge_j (gc's last row of block j) stay live for the later blocks.
    gc = tl.cumsum(g0, 0)
    ge0 = tl.sum(g0, 0)
    L00, A00 = _diag(q0, k0, gc, b0, o_c, LP)
    tl.store(p_a, A00)
    kt0 = k0 * tl.exp(ge0[None, :] - gc)

    q1, k1, g1, b1 = _load_block(q, k, g, beta, A_log, dt_bias, lower_bound, r_0 + 16, t0 + 16 + o_c < L, i_h, o_k,
                                 m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale, K, GATE_IN_KERNEL,
                                 HAS_LOWER_BOUND, BETA_LOGITS)
    gc = tl.cumsum(g1, 0) + ge0[None, :]
    ge1 = ge0 + tl.sum(g1, 0)
    L11, A11 = _diag(q1, k1, gc, b1, o_c, LP)
    gn = _first_row(gc, o_c)
    e = tl.exp(gc - gn[None, :])
    L10, A10 = _off(k1 * e, q1 * e, b1, kt0, ge0, gn, LP)
    tl.store(p_a + 16 * 64, A10)
    tl.store(p_a + 16 * 64 + 16, A11)
    kt1 = k1 * tl.exp(ge1[None, :] - gc)

    q2, k2, g2, b2 = _load_block(q, k, g, beta, A_log, dt_bias, lower_bound, r_0 + 32, t0 + 32 + o_c < L, i_h, o_k,
                                 m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale, K, GATE_IN_KERNEL,
                                 HAS_LOWER_BOUND, BETA_LOGITS)
    gc = tl.cumsum(g2, 0) + ge1[None, :]
    ge2 = ge1 + tl.sum(g2, 0)
    L22, A22 = _diag(q2, k2, gc, b2, o_c, LP)
    gn = _first_row(gc, o_c)
    e = tl.exp(gc - gn[None, :])
    L20, A20 = _off(k2 * e, q2 * e, b2, kt0, ge0, gn, LP)
    L21, A21 = _off(k2 * e, q2 * e, b2, kt1, ge1, gn, LP)
    tl.store(p_a + 32 * 64, A20)
    tl.store(p_a + 32 * 64 + 16, A21)
    tl.store(p_a + 32 * 64 + 32, A22)
    kt2 = k2 * tl.exp(ge2[None, :] - gc)

    q3, k3, g3, b3 = _load_block(q, k, g, beta, A_log, dt_bias, lower_bound, r_0 + 48, t0 + 48 + o_c < L, i_h, o_k,
                                 m_k, stride_q_t, stride_k_t, stride_g_t, stride_b_t, scale, K, GATE_IN_KERNEL,
                                 HAS_LOWER_BOUND, BETA_LOGITS)
    gc = tl.cumsum(g3, 0) + ge2[None, :]
    L33, A33 = _diag(q3, k3, gc, b3, o_c, LP)
    gn = _first_row(gc, o_c)
    e = tl.exp(gc - gn[None, :])
    L30, A30 = _off(k3 * e, q3 * e, b3, kt0, ge0, gn, LP)
    L31, A31 = _off(k3 * e, q3 * e, b3, kt1, ge1, gn, LP)
    L32, A32 = _off(k3 * e, q3 * e, b3, kt2, ge2, gn, LP)
    tl.store(p_a + 48 * 64, A30)
    tl.store(p_a + 48 * 64 + 16, A31)
    tl.store(p_a + 48 * 64 + 32, A32)
    tl.store(p_a + 48 * 64 + 48, A33)

    # (I + L)^-1, block lower triangular: Ai_ij = -Ai_ii sum_{j <= m < i} L_im Ai_mj
    Ai00 = _inv_diag(L00, o_c, SP)
    Ai11 = _inv_diag(L11, o_c, SP)
    Ai22 = _inv_diag(L22, o_c, SP)
    Ai33 = _inv_diag(L33, o_c, SP)
    Ai10 = -tl.dot(Ai11, tl.dot(L10, Ai00, input_precision=SP), input_precision=SP)
    Ai21 = -tl.dot(Ai22, tl.dot(L21, Ai11, input_precision=SP), input_precision=SP)
    Ai20 = -tl.dot(Ai22, tl.dot(L20, Ai00, input_precision=SP) + tl.dot(L21, Ai10, input_precision=SP),
                   input_precision=SP)
    Ai32 = -tl.dot(Ai33, tl.dot(L32, Ai22, input_precision=SP), input_precision=SP)
    Ai31 = -tl.dot(Ai33, tl.dot(L31, Ai11, input_precision=SP) + tl.dot(L32, Ai21, input_precision=SP),
                   input_precision=SP)
    Ai30 = -tl.dot(Ai33, tl.dot(L30, Ai00, input_precision=SP) + tl.dot(L31, Ai10, input_precision=SP)
                   + tl.dot(L32, Ai20, input_precision=SP), input_precision=SP)
    tl.store(p_i, Ai00)
    tl.store(p_i + 16 * 64, Ai10)
    tl.store(p_i + 16 * 64 + 16, Ai11)
    tl.store(p_i + 32 * 64, Ai20)
    tl.store(p_i + 32 * 64 + 16, Ai21)
    tl.store(p_i + 32 * 64 + 32, Ai22)
    tl.store(p_i + 48 * 64, Ai30)
    tl.store(p_i + 48 * 64 + 16, Ai31)
    tl.store(p_i + 48 * 64 + 32, Ai32)
    tl.store(p_i + 48 * 64 + 48, Ai33)


@triton.jit
def _store_bf16(p, x, LO: tl.constexpr, SLOT: tl.constexpr):
    """x rounded to bf16 at p; with LO also the remainder at p + SLOT (the next slot of the per-chunk tiles),
    so that hi + lo is within 2^-17 of x."""
    hi = x.to(tl.bfloat16)
    tl.store(p, hi)
    if LO:
        tl.store(p + SLOT, (x - hi.to(tl.float32)).to(tl.bfloat16))


@triton.jit
def _store_pair(p, x, SLOT: tl.constexpr):
    """x as a bf16 pair: hi at p, the remainder lo at p + SLOT."""
    _store_bf16(p, x, True, SLOT)


@triton.jit
def kda_intra64_b_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, aqk, ai, wqk, uo, egl,
    stride_q_t, stride_k_t, stride_v_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr,
    LOCAL_PRECISION: tl.constexpr, W_LO: tl.constexpr, Q_LO: tl.constexpr, KD_LO: tl.constexpr,
    OU_BF16: tl.constexpr,
):
    """Per chunk, with the whole chunk as one tile: w, u, qw, ou, kd and exp(gl) from the first kernel's
    matrices (see the module docstring). W_LO, Q_LO, KD_LO: which of w, qw, kd also get their lo half (the
    slots follow in the order w, [w lo], qw, [qw lo], kd, [kd lo]); OU_BF16: ``uo`` is bf16 (``ou`` rounded
    once, ``u`` as a bf16 pair in two slots: [chunks, H, 3, 64, V])."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_f = tl.arange(0, V)
    m_k = o_k < K
    m_t = t0 + o_t < L
    LP: tl.constexpr = LOCAL_PRECISION
    rows = bos + t0 + o_t
    m_tk = m_t[:, None] & m_k[None, :]
    b_g, b_b = _load_gate(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS)
    b_gc = tl.cumsum(b_g, 0)
    b_gl = tl.sum(b_g, 0)
    i_ch = (i_c * H + i_h).to(tl.int64)
    # scalar bases and int32 offsets: tensors of 64-bit pointers would hold twice the registers
    NS: tl.constexpr = 3 + W_LO + Q_LO + KD_LO
    SQ: tl.constexpr = (1 + W_LO) * 64 * K
    SKD: tl.constexpr = (2 + W_LO + Q_LO) * 64 * K
    wqk += i_ch * (NS * 64 * K)
    uo += i_ch * ((3 if OU_BF16 else 2) * 64 * V)
    off_k = o_t[:, None] * K + o_k[None, :]
    off_v = o_t[:, None] * V + o_f[None, :]
    off_a = o_t[:, None] * 64 + o_t[None, :]
    m_blk = (o_t[None, :] // 16) <= (o_t[:, None] // 16)
    tl.store(egl + i_ch * K + o_k, tl.exp(b_gl))
    # in this order, so that each input is dead before the next is loaded
    b_k = _load_norm(k, rows, m_tk, stride_k_t, i_h, o_k, K)
    _store_bf16(wqk + SKD + off_k, b_k * tl.exp(b_gl[None, :] - b_gc), KD_LO, 64 * K)
    b_ai = tl.load(ai + i_ch * 4096 + off_a, mask=m_blk, other=0.0)
    b_w = tl.dot(b_ai, b_k * (b_b[:, None] * tl.exp(b_gc)), input_precision=LP)
    _store_bf16(wqk + off_k, b_w, W_LO, 64 * K)
    b_v = tl.load(v + rows[:, None] * stride_v_t + i_h * V + o_f[None, :], mask=m_t[:, None], other=0.0)
    b_u = tl.dot(b_ai, b_v.to(tl.float32) * b_b[:, None], input_precision=LP)
    b_aqk = tl.load(aqk + i_ch * 4096 + off_a, mask=m_blk, other=0.0)
    b_ou = tl.dot(b_aqk, b_u, input_precision=LP)
    if OU_BF16:
        # u feeds the state chain: a pair (slots 0, 1); ou only the bf16 output: one rounding (slot 2)
        _store_bf16(uo + off_v, b_u, True, 64 * V)
        tl.store(uo + 2 * 64 * V + off_v, b_ou.to(tl.bfloat16))
    else:
        tl.store(uo + off_v, b_u)
        tl.store(uo + 64 * V + off_v, b_ou)
    # o = qg S + Aqk v' with v' = u - w S, folded: qw = q exp(gc) - Aqk w, ou = Aqk u
    b_q = _load_norm(q, rows, m_tk, stride_q_t, i_h, o_k, K) * scale
    _store_bf16(wqk + SQ + off_k, b_q * tl.exp(b_gc) - tl.dot(b_aqk, b_w, input_precision=LP), Q_LO, 64 * K)

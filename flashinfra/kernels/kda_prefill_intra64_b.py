"""KDA prefill (v3), kernel B: the per-chunk tiles the state pass reads, from the WY inverse ``Ai = (I + L)^-1``
(kda_prefill_intra64_split.py), written in a chunk-major layout that the state pass reads as whole tiles (rows
past the end of a sequence are zeros):

- ``wqk`` bf16 [chunks, H, slots, 64, K]: ``w = Ai (beta k exp(gc))``, ``qg = q exp(gc)`` and
  ``kd = k exp(gl - gc)`` (``gc`` the cumulative log-decay from the chunk start, ``gl`` the chunk's total),
  each rounded to bf16 and, where the state pass needs it, followed by its lo half (hi + lo within 2^-17 of the
  float32 value): 3 slots for the bf16x2 and bf16 chains, 5 for bf16x3 (w and kd pairs), one more for qg's lo
  half with ``out_x3``;
- ``u`` float32 [chunks, H, V, 64]: ``u = Ai (beta v)``, stored transposed (the state pass carries the state
  transposed and reads it as [BV, 64] tiles);
- ``egl`` float32 [chunks, H, K]: ``exp(gl)``.

With them and ``Aqk`` (kernels D and A) the state pass needs, per chunk, ``v' = u - w S``,
``o = qg S + Aqk v'``, ``S = exp(gl) S + kd^T v'``. (An earlier form folded the output's ``Aqk v'`` into B:
``qw = qg - Aqk w`` and ``ou = Aqk u``, two more products per column block here and 32 KB more per chunk-head
written here and read back, for one product fewer per chunk in the state pass; bench/notes/kda_prefill.md, "The
output's Aqk v' in the state pass".)

Every output column depends only on the same column of the inputs (``gc`` and ``gl`` are per column, the
product with ``Ai`` mixes rows, not columns), except for the q/k L2 norms, whose row factors kernel D writes
(``rn``). One program per (chunk, head): [64, BK] and [64, BVB] tiles one block at a time beside the chunk's
[64, 64] inverse (on an H200 at T=8192, H=64 that took B from 1.25 ms for whole [64, K]
tiles to 1.01 ms; a grid of one program per column block, with the norms from kernel D, was no faster:
bench/notes/kda_prefill.md, "B at its bytes floor"; nor were the column loops software-pipelined over 2 or 3
stages by Triton, 1.02-1.03 ms: both are in the history before their removal). Each block's tiles are loaded
into registers while the block before it is computed, by hand: 0.88 -> 0.74 ms at 168 registers (three
programs per SM; bench/notes/kda_prefill.md, "Loads ahead of the barriers").

What B reads: q, k and v ([T, H, D] rows, masked past the sequence's end), Ai (kernels D and A), the rows' norm
factors (kernel D: ``scale / |q_r|`` and ``1 / |k_r|``, [chunks, H, 2, 64] float32), and the gate
pass's scratch (kda_prefill_gate.py, launched first), for the plain and the gated op alike: ``gc``, the
log-decay's cumulative sum from the chunk's first row ([chunks, H, 64, K] float32), one [64, BK] tile per key
block with ``gl`` its row 63 (the padding rows past a sequence's end exist and repeat its last token's sum, so
row 63 is always the chunk's total and no load is masked), and ``bc``, beta ([chunks, H, 64], zero past the
end), once per key block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_prefill_intra64_split import mm_f32, store_pair


@triton.jit
def _key_tiles(q, k, gc, rows, m_t, i_h, o_k, stride_q_t, stride_k_t, K: tl.constexpr):
    """The tiles of the key columns o_k, as loaded (q and k in their dtype): the chunk-relative sums ``gc`` (their
    last row the chunk's total: rows past the end repeat the last token's), that last row, k and q."""
    o_t = tl.arange(0, 64)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_gc = tl.load(gc + o_t[:, None] * K + o_k[None, :])
    b_gl = tl.load(gc + 63 * K + o_k)
    b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    return b_gc, b_gl, b_k, b_q


@triton.jit
def _key_cols(b_gc, b_gl, b_k, b_q, b_b, o_k, b_ai, r_q, r_k, wqk, egl, K: tl.constexpr, SQ: tl.constexpr,
              SKD: tl.constexpr, LP: tl.constexpr, W_LO: tl.constexpr, Q_LO: tl.constexpr, KD_LO: tl.constexpr,
              DOT_F32: tl.constexpr):
    """exp(gl), kd, w and qg for the key columns o_k from their tiles (``_key_tiles``; ``wqk`` and ``egl`` at
    the chunk-head, ``b_b`` beta)."""
    o_t = tl.arange(0, 64)
    tl.store(egl + o_k, tl.exp(b_gl))
    off_k = o_t[:, None] * K + o_k[None, :]
    b_k = b_k.to(tl.float32) * r_k[:, None]
    b_e = tl.exp(b_gc)
    store_pair(wqk + SKD + off_k, b_k * tl.exp(b_gl[None, :] - b_gc), KD_LO, 64 * K)
    store_pair(wqk + SQ + off_k, b_q.to(tl.float32) * r_q[:, None] * b_e, Q_LO, 64 * K)
    store_pair(wqk + off_k, mm_f32(b_ai, b_k * (b_b[:, None] * b_e), LP, DOT_F32), W_LO, 64 * K)


@triton.jit
def _load_v(v, rows, m_t, i_h, o_f, stride_v_t, V: tl.constexpr):
    """The value columns o_f of the chunk's rows (zeros past the sequence's end)."""
    return tl.load(v + rows[:, None] * stride_v_t + i_h * V + o_f[None, :], mask=m_t[:, None], other=0.0)


@triton.jit
def _value_cols(b_v, o_f, b_ai, b_b, u, LP: tl.constexpr, DOT_F32: tl.constexpr):
    """u for the value columns o_f (``b_v`` their tile, ``u`` at the chunk-head), stored transposed."""
    off_v = tl.arange(0, 64)[:, None] + o_f[None, :] * 64
    tl.store(u + off_v, mm_f32(b_ai, b_v.to(tl.float32) * b_b[:, None], LP, DOT_F32))


@triton.jit
def _chunk_head(cu_seqlens, chunk_indices, i_c, i_h, ai, H: tl.constexpr):
    """Rows (absolute), their mask, the chunk-head's index and its Ai (lower blocks, zeros above)."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64) * 64
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = tl.arange(0, 64)
    i_ch = (i_c * H + i_h).to(tl.int64)
    off_a = o_t[:, None] * 64 + o_t[None, :]
    m_blk = (o_t[None, :] // 16) <= (o_t[:, None] // 16)
    b_ai = tl.load(ai + i_ch * 4096 + off_a, mask=m_blk, other=0.0)
    return bos + t0 + o_t, t0 + o_t < L, i_ch, b_ai


@triton.jit
def kda_intra64_b_kernel(
    q, k, v, gc, bc, cu_seqlens, chunk_indices, ai, rn, wqk, u, egl, stride_q_t, stride_k_t, stride_v_t,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVB: tl.constexpr,
    PRECISION: tl.constexpr, W_LO: tl.constexpr, Q_LO: tl.constexpr, KD_LO: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Grid (chunks, H): the tiles above for one chunk and head, BK key and BVB value columns at a time;
    ``gc`` and ``bc`` are the gate pass's scratch (kda_prefill_gate.py). PRECISION: the two products with Ai
    (``mm_f32``); DOT_F32: the interpreter's widened bf16 products."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    rows, m_t, i_ch, b_ai = _chunk_head(cu_seqlens, chunk_indices, i_c, i_h, ai, H)
    gc += i_ch * (64 * K)
    bc += i_ch * 64
    o_b = tl.arange(0, BK)
    SQ: tl.constexpr = (1 + W_LO) * 64 * K
    SKD: tl.constexpr = (2 + W_LO + Q_LO) * 64 * K
    wqk += i_ch * ((3 + W_LO + Q_LO + KD_LO) * 64 * K)
    u += i_ch * (64 * V)
    # the rows' norm factors (kernel D's: scale / |q_r|, 1 / |k_r|)
    r_q = tl.load(rn + i_ch * 128 + tl.arange(0, 64))
    r_k = tl.load(rn + i_ch * 128 + 64 + tl.arange(0, 64))
    b_b = tl.load(bc + tl.arange(0, 64))
    # Each block's tiles are loaded while the block before it is computed: loaded where they are used, they
    # waited for the previous block's products (their barriers), one round trip per block.
    b_gc, b_gl, b_k, b_q = _key_tiles(q, k, gc, rows, m_t, i_h, o_b, stride_q_t, stride_k_t, K)
    for kk in tl.static_range(0, K, BK):
        n_gc, n_gl, n_k, n_q = b_gc, b_gl, b_k, b_q
        if kk + BK < K:
            n_gc, n_gl, n_k, n_q = _key_tiles(q, k, gc, rows, m_t, i_h, kk + BK + o_b, stride_q_t, stride_k_t, K)
        _key_cols(b_gc, b_gl, b_k, b_q, b_b, kk + o_b, b_ai, r_q, r_k, wqk, egl + i_ch * K, K, SQ, SKD,
                  PRECISION, W_LO, Q_LO, KD_LO, DOT_F32)
        b_gc, b_gl, b_k, b_q = n_gc, n_gl, n_k, n_q
    o_f = tl.arange(0, BVB)
    b_v = _load_v(v, rows, m_t, i_h, o_f, stride_v_t, V)
    for vv in tl.static_range(0, V, BVB):
        b_v_next = b_v
        if vv + BVB < V:
            b_v_next = _load_v(v, rows, m_t, i_h, vv + BVB + o_f, stride_v_t, V)
        _value_cols(b_v, vv + o_f, b_ai, b_b, u, PRECISION, DOT_F32)
        b_v = b_v_next

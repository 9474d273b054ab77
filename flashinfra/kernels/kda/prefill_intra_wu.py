"""KDA prefill in 64-token chunks, the tiles w and u for fp16 activations: from the WY inverse ``Ai = (I + L)^-1``,
written in a chunk-major layout that the state pass reads as whole tiles (rows past the end of a sequence are
zeros). For bf16 v the state pass forms u and applies w's product itself and this kernel is not launched (fp16 v
is not exact in bf16, the state pass's operand type).

- ``wqk`` bf16 [chunks, H, slots, 64, K]: ``w = Ai (beta k exp(gc))`` (``gc`` the cumulative log-decay from
  the chunk start), rounded to bf16 and, at the bf16x3 chain, followed by its lo half (hi + lo within 2^-17 of
  the float32 value). The slots after w's hold ``qg`` and ``kd``, which the diagonal kernel writes;
- ``u`` float32 [chunks, H, V, 64]: ``u = Ai (beta v)``, stored transposed (the state pass carries the state
  transposed and reads it as [BV, 64] tiles);
- ``egl`` float32 [chunks, H, K]: ``exp(gl)`` (``gl`` the chunk's total).

With them and ``Aqk`` the state pass needs, per chunk, ``v' = u - w S``, ``o = qg S + Aqk v'``,
``S = exp(gl) S + kd^T v'``. Every output column depends only on the same column of the inputs, except for k's
L2 norm, whose row factors the diagonal kernel writes (``rn``). One program per (chunk, head): [64, BK] and
[64, BVB] tiles by the copy engine one block at a time beside the chunk's [64, 64] inverse, the key and value
column loops software-pipelined ``STAGES`` deep.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.common import mm_f32, store_pair


@triton.jit
def _key_cols(b_gc, b_gl, b_k, b_b, o_k, b_ai, r_k, wqk, egl, K: tl.constexpr, LP: tl.constexpr,
              W_LO: tl.constexpr, DOT_F32: tl.constexpr):
    """exp(gl) and w for the key columns o_k from their tiles (``gc``, its last row ``gl`` and k as loaded;
    ``wqk`` and ``egl`` at the chunk-head, ``b_b`` beta)."""
    o_t = tl.arange(0, 64)
    tl.store(egl + o_k, tl.exp(b_gl))
    off_k = o_t[:, None] * K + o_k[None, :]
    b_k = b_k.to(tl.float32) * r_k[:, None]
    b_e = tl.exp(b_gc)
    store_pair(wqk + off_k, mm_f32(b_ai, b_k * (b_b[:, None] * b_e), LP, DOT_F32), W_LO, 64 * K)


@triton.jit
def kda_intra_wu_kernel(
    bc, cu_seqlens, chunk_indices, rn, gc, wqk, u, egl, k_d, v_d, gc_d, ai_d,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVB: tl.constexpr,
    PRECISION: tl.constexpr, W_LO: tl.constexpr, NS: tl.constexpr, DOT_F32: tl.constexpr, STAGES: tl.constexpr,
):
    """Grid (chunks, H): the tiles above for one chunk and head, BK key and BVB value columns at a time.
    ``k_d`` and ``v_d`` are descriptors over k and v as [T, H * D] rows with [64, BK] (k) and [64, BVB] (v)
    blocks; ``gc_d`` over ``gc`` as [chunks * H * 64, K] with [64, BK] blocks, ``ai_d`` over Ai as
    [chunks * H * 64, 64]. PRECISION: the two products with Ai (``mm_f32``); DOT_F32: the interpreter's widened
    bf16 products. NS: ``wqk``'s slots per chunk-head (w's first, W_LO: with its lo half; qg's and kd's after
    them, the diagonal kernel's)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    t0 = tl.load(chunk_indices + 2 * i_c + 1) * 64
    bos = tl.load(cu_seqlens + i_n)
    o_t = tl.arange(0, 64)
    m_t = t0 + o_t < tl.load(cu_seqlens + i_n + 1) - bos
    r0 = bos + t0
    i_ch = i_c * H + i_h
    # Ai's lower blocks (the blocks above them are scratch)
    b_ai = tl.where((o_t[None, :] // 16) <= (o_t[:, None] // 16), ai_d.load([i_ch * 64, 0]), 0.0)
    i_ch64 = i_ch.to(tl.int64)
    wqk += i_ch64 * (NS * 64 * K)
    u += i_ch64 * (64 * V)
    egl += i_ch64 * K
    gc += i_ch64 * (64 * K) + 63 * K
    # the rows' norm factors (the diagonal kernel's: 1 / |k_r|) and beta
    r_k = tl.load(rn + i_ch64 * 128 + 64 + o_t)
    b_b = tl.load(bc + i_ch64 * 64 + o_t)
    o_b = tl.arange(0, BK)
    for kk in tl.range(0, K, BK, num_stages=STAGES):
        b_gc = gc_d.load([i_ch * 64, kk])
        b_gl = tl.load(gc + kk + o_b)
        b_k = tl.where(m_t[:, None], k_d.load([r0, i_h * K + kk]), 0.0)
        _key_cols(b_gc, b_gl, b_k, b_b, kk + o_b, b_ai, r_k, wqk, egl, K, PRECISION, W_LO, DOT_F32)
    # u for BVB value columns at a time, stored transposed
    o_f = tl.arange(0, BVB)
    for vv in tl.range(0, V, BVB, num_stages=STAGES):
        b_v = tl.where(m_t[:, None], v_d.load([r0, i_h * V + vv]), 0.0)
        tl.store(u + o_t[:, None] + (vv + o_f)[None, :] * 64,
                 mm_f32(b_ai, b_v.to(tl.float32) * b_b[:, None], PRECISION, DOT_F32))

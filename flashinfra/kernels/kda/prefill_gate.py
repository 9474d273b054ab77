"""KDA prefill in 64-token chunks, the gate pass, launched first: per chunk and head, the per-token log-decay (the
given gate, or the gate from its raw projection with the lower bound; clamped below at -10 per token; zero past
the sequence's end) and its cumulative sum from the chunk's first row, written once. The in-chunk kernels read
it and never see the gate itself, so the plain and the gated op share their compiled readers. The pass reads
``g`` (the log-decay, or the raw gate with ``A_log``, ``dt_bias`` and the bound) and ``beta`` (or its logits),
[T, H, K] and [T, H] rows at any row stride, masked past the sequence's end.

Scratch, in the chunk-major layout of the in-chunk matrices (a chunk's rows past its sequence's end exist and
are padding):

- ``gc`` float32 [chunks, H, 64, K]: the cumulative log-decay, chunk-relative (within a chunk at least 64 x -10
  = -640); past the end it stays at the last token's value (the decay there is zero), so the chunk's total is
  always row 63 and a reader needs no mask;
- ``bc`` float32 [chunks, H, 64]: beta (after its sigmoid for the gated op), zero past the end.

A reader forms every exponent as a difference of two entries of ``gc`` (a row's entry minus a reference row's):
a prefix sum of non-positive terms does not increase from row to row, so the factors keep their bounds (at most
1, or within ``exp(+-80)`` against a sub-block's middle row).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.common import load_gate_beta
from flashinfra.kernels.kda.common import chunk_rows


@triton.jit
def load_gate_chunk64(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t, stride_b_t,
                 K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                 BETA_LOGITS: tl.constexpr):
    """``load_gate_beta`` with the 64-token kernels' bound: per-token log-decay at least -10 (exact 16-token
    sub-blocks)."""
    return load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                          stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, -10.0)


@triton.jit
def kda_gate_pass_kernel(
    g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices, gc, bc, stride_g_t, stride_b_t,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr,
):
    """Grid (chunks * K // BK, H): ``gc`` for one chunk, head and BK columns; beta with the first column block."""
    i_ck, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_k = i_ck // (K // BK), i_ck % (K // BK)
    r0, left = chunk_rows(cu_seqlens, chunk_indices, i_c, 0)
    o_t = tl.arange(0, 64)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = o_t < left
    m_k = o_k < K
    b_g, b_b = load_gate_chunk64(g + r0 * stride_g_t, beta + r0 * stride_b_t, A_log, dt_bias, lower_bound, o_t, m_t,
                            m_t[:, None] & m_k[None, :], i_h, o_k, m_k, stride_g_t, stride_b_t, K, GATE_IN_KERNEL,
                            HAS_LOWER_BOUND, BETA_LOGITS)
    i_ch = (i_c * H + i_h).to(tl.int64)
    tl.store(gc + i_ch * (64 * K) + o_t[:, None] * K + o_k[None, :], tl.cumsum(b_g, 0))
    if i_k == 0:
        tl.store(bc + i_ch * 64 + o_t, b_b)

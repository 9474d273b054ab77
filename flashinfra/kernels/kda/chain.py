"""The KDA transition map of a token range: ``M`` with ``S_out = M S_in + H`` for each head, so that ranks that
each hold one part of a sequence can chain their parts (``flashinfra.parallel.context``).

Per token ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, so ``M`` is the product of
the token factors, last token leftmost, and ``H`` the final state from a zero initial state (the prefill op's).
In the chunked (WY) form of the 16-token prefill (prefill_fp32.py) one chunk's factor is
``diag(exp(gl)) - kd^T w``: its in-chunk kernel writes ``w``, ``kd`` and ``exp(gl)`` for every chunk in
parallel; ``kda_chain_kernel`` (grid: column blocks of M x sequences x heads) then walks the chunks with a
``[K, BM]`` block of M in registers: ``M = exp(gl) M - kd^T (w M)``, from the identity.

The two products with M compound their rounding over every chunk of the part (a 1M-token sequence split over
8 ranks is 8192 chunks per part), so they run in tf32x3 (three tf32 products of the hi/lo halves of each
operand, as flash-linear-attention PR #1180); plain tf32 is kept as ``precision="tf32"`` only to show the
difference (tests/kernels/test_kda_chain_gpu.py, bench/kda_chain.py). The in-chunk kernel runs at the same
precision: its ``w`` enters every factor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.kda.prefill_fp32 import BT, kda_fp32_intra_kernel
from flashinfra.kernels.kda.ref import kda_gate_ref, kda_transition_ref
from flashinfra.kernels.varlen import chunk_tables, device_ints

PRECISIONS = ("tf32x3", "tf32")
# a [K, 64] block of M per program on 4 warps
CHAIN_BM, CHAIN_WARPS = 64, 4


@triton.jit
def kda_chain_kernel(
    w, kd, egl, m, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_m, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_m = i_m * BM + tl.arange(0, BM)
    m_k, m_m = o_k < K, o_m < K
    b_m = tl.where(o_k[:, None] == o_m[None, :], 1.0, 0.0)  # [BK, BM] columns o_m of the identity
    for i_t in range(0, tl.cdiv(L, BT)):
        rows = bos + i_t * BT + o_t
        m_tk = (i_t * BT + o_t < L)[:, None] & m_k[None, :]
        p_tk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)  # [BT, BK]
        b_kd = tl.load(kd + p_tk, mask=m_tk, other=0.0)
        b_e = tl.load(egl + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_x = tl.dot(b_w, b_m, input_precision=PRECISION)  # [BT, BM]
        b_m = b_m * b_e[:, None] - tl.dot(tl.trans(b_kd), b_x, input_precision=PRECISION)
    p_m = m + (i_n * H + i_h) * K * K + o_k[:, None] * K + o_m[None, :]
    tl.store(p_m, b_m, mask=m_k[:, None] & m_m[None, :])


def kda_transition_launch(k, g, beta, cu_seqlens: list[int], gate=None, precision: str = "tf32x3",
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """M [B, H, K, K] float32 of each sequence of the packed ``k`` [T, H, K] (into ``out`` where given); ``g``
    [T, H, K] the log-decay and ``beta`` [T, H] in (0, 1), or with ``gate = (A_log, dt_bias, lower_bound)`` the
    raw gate input and beta's logits."""
    if precision not in PRECISIONS:
        raise ValueError(f"kda_transition: precision must be one of {PRECISIONS}, got {precision!r}")
    T, H, K = k.shape
    if g.shape != (T, H, K) or beta.shape != (T, H):
        raise ValueError(f"kda_transition: k {tuple(k.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)} disagree")
    cu = [int(c) for c in cu_seqlens]
    if cu[0] != 0 or cu[-1] != T or any(b > e for b, e in zip(cu, cu[1:])):
        raise ValueError(f"kda_transition: cu_seqlens must rise from 0 to {T}, got {cu}")
    B, dev = len(cu) - 1, k.device
    m = torch.empty(B, H, K, K, dtype=torch.float32, device=dev) if out is None else out
    if m.shape != (B, H, K, K) or m.dtype != torch.float32 or not m.is_contiguous():
        raise ValueError(f"kda_transition: out must be contiguous [{B}, {H}, {K}, {K}] float32")
    idx, offsets_t, nch = chunk_tables(cu, BT, dev)
    cu_t = device_ints(cu, dev)
    BK = max(triton.next_power_of_2(K), 16)
    # the in-chunk kernel's q and v are k here: its outputs that depend on them (qg, u, the q.k matrix) are unused
    w, qg, kd, u = (torch.empty(T, H, K, dtype=torch.float32, device=dev) for _ in range(4))
    aqk = torch.empty(T, H, BT, dtype=torch.float32, device=dev)
    egl = torch.empty(max(nch, 1), H, K, dtype=torch.float32, device=dev)
    A_log, dt_bias, lower_bound = gate if gate is not None else (g, g, 0.0)
    if nch:
        kda_fp32_intra_kernel[(nch, H)](
            k, k, k, g, beta, A_log, dt_bias, float(lower_bound) if lower_bound is not None else 0.0, cu_t, idx,
            w, u, qg, kd, aqk, egl,
            k.stride(0), k.stride(0), k.stride(0), g.stride(0), beta.stride(0), K**-0.5,
            H=H, K=K, V=K, BK=BK, BVF=BK, BT=BT, LOG2_BT=BT.bit_length() - 1,
            GATE_IN_KERNEL=gate is not None, HAS_LOWER_BOUND=gate is not None and lower_bound is not None,
            BETA_LOGITS=gate is not None, LOCAL_PRECISION=precision, SOLVE_PRECISION=precision, num_warps=4,
        )
    BM = min(CHAIN_BM, BK)
    kda_chain_kernel[(triton.cdiv(K, BM), B * H)](
        w, kd, egl, m, cu_t, offsets_t, H=H, K=K, BK=BK, BM=BM, BT=BT, PRECISION=precision, num_warps=CHAIN_WARPS,
    )
    return m


def kda_transition(k, g, beta, cu_seqlens: list[int]) -> torch.Tensor:
    """M [B, H, K, K] float32 of each sequence: ``S_out = M S_in + H`` (``H`` from ``kda_prefill`` with no
    initial state)."""
    if use_triton(k, g, beta):
        return kda_transition_launch(k, g, beta, cu_seqlens)
    return kda_transition_ref(k, g, beta, cu_seqlens)


def kda_transition_gated(k, g_raw, beta_logits, A_log, dt_bias, lower_bound, cu_seqlens: list[int]) -> torch.Tensor:
    """``kda_transition`` with the gate and ``beta = sigmoid(beta_logits)`` computed from the raw projections."""
    if use_triton(k, g_raw, beta_logits):
        return kda_transition_launch(k, g_raw, beta_logits, cu_seqlens, (A_log, dt_bias, lower_bound))
    g = kda_gate_ref(g_raw, A_log, dt_bias, lower_bound)
    return kda_transition_ref(k, g, torch.sigmoid(beta_logits.float()), cu_seqlens)

"""The KDA affine map of a token range: ``S_out = M S_in + H`` for each head, so that ranks that each hold one part
of a sequence can chain their parts (``flashinfra.parallel.context``).

Per token ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, so ``M`` is the product of
the token factors, last token leftmost, and ``H`` the final state from a zero initial state. In the chunked (WY)
form of the 16-token prefill (prefill_fp32.py) one chunk maps ``S -> exp(gl) S + kd^T (u - w S)``: its in-chunk
kernel writes ``w``, ``u``, ``kd`` and ``exp(gl)`` for every chunk in parallel; ``kda_chain_kernel`` (grid: column
blocks of ``[M | H]`` x sequences x heads) then walks the chunks with a ``[K, BM]`` block of columns in
registers, ``X = exp(gl) X - kd^T (w X - u_X)``: M's columns from the identity with ``u_X = 0``, H's from zero
with ``u_X = u``. ``H`` is thus the state pass of the prefill without its output products, in the same walk as
``M``: the summary of a part costs the in-chunk kernel and ``K + V`` chained columns, no prefill.

The two products with the state compound their rounding over every chunk of the part (a 1M-token sequence split
over 8 ranks is 8192 chunks per part), so they run in tf32x3 (three tf32 products of the hi/lo halves of each
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
from flashinfra.kernels.kda.ref import kda_gate_ref, kda_summary_ref, kda_transition_ref
from flashinfra.kernels.varlen import chunk_tables, device_ints
from flashinfra.kernels.launch import cdiv, next_power_of_2

PRECISIONS = ("tf32x3", "tf32")
# a [K, 64] block of columns per program on 4 warps
CHAIN_BM, CHAIN_WARPS = 64, 4


@triton.jit
def kda_chain_kernel(
    w, kd, egl, u, m, h, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr,
    NMK: tl.constexpr, HAS_H: tl.constexpr, PRECISION: tl.constexpr,
):
    """Programs ``i_m < NMK`` walk columns of M, the others (with ``HAS_H``) columns of H."""
    i_m, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_g = i_m * BM + tl.arange(0, BM)  # columns of [M | H], H's from NMK * BM on
    is_m = o_g < NMK * BM
    o_c = tl.where(is_m, o_g, o_g - NMK * BM)
    m_k, m_c = o_k < K, tl.where(is_m, o_c < K, o_c < V)
    b_m = tl.where((o_k[:, None] == o_c[None, :]) & is_m[None, :], 1.0, 0.0)  # [BK, BM] identity or zero columns
    for i_t in range(0, tl.cdiv(L, BT)):
        rows = bos + i_t * BT + o_t
        m_t = i_t * BT + o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)  # [BT, BK]
        b_kd = tl.load(kd + p_tk, mask=m_tk, other=0.0)
        b_e = tl.load(egl + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_x = tl.dot(b_w, b_m, input_precision=PRECISION)  # [BT, BM]
        if HAS_H:
            p_u = u + rows[:, None] * (H * V) + i_h * V + o_c[None, :]
            b_x = b_x - tl.load(p_u, mask=m_t[:, None] & (m_c & ~is_m)[None, :], other=0.0)
        b_m = b_m * b_e[:, None] - tl.dot(tl.trans(b_kd), b_x, input_precision=PRECISION)
    p_m = m + (i_n * H + i_h) * K * K + o_k[:, None] * K + o_c[None, :]
    tl.store(p_m, b_m, mask=m_k[:, None] & (m_c & is_m)[None, :])
    if HAS_H:
        p_h = h + (i_n * H + i_h) * K * V + o_k[:, None] * V + o_c[None, :]
        tl.store(p_h, b_m, mask=m_k[:, None] & (m_c & ~is_m)[None, :])


def kda_summary_launch(k, v, g, beta, cu_seqlens: list[int], gate=None, precision: str = "tf32x3",
                       out: torch.Tensor | None = None, out_h: torch.Tensor | None = None):
    """M [B, H, K, K] float32 of each sequence of the packed ``k`` [T, H, K] (into ``out`` where given) and, with
    ``v`` [T, H, V], H [B, H, K, V] float32 (into ``out_h``): ``(M, H)``, or ``M`` alone when ``v`` is None.
    ``g`` [T, H, K] the log-decay and ``beta`` [T, H] in (0, 1), or with ``gate = (A_log, dt_bias,
    lower_bound)`` the raw gate input and beta's logits."""
    if precision not in PRECISIONS:
        raise ValueError(f"kda_transition: precision must be one of {PRECISIONS}, got {precision!r}")
    T, H, K = k.shape
    if g.shape != (T, H, K) or beta.shape != (T, H) or (v is not None and v.shape[:2] != (T, H)):
        raise ValueError(f"kda_transition: k {tuple(k.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}"
                         f"{'' if v is None else f' v {tuple(v.shape)}'} disagree")
    if v is not None and (v.stride(2) != 1 or v.stride(1) != v.shape[2]):
        raise ValueError("kda_transition: v must have contiguous heads ([T, H, V] rows, any row stride)")
    cu = [int(c) for c in cu_seqlens]
    if cu[0] != 0 or cu[-1] != T or any(b > e for b, e in zip(cu, cu[1:])):
        raise ValueError(f"kda_transition: cu_seqlens must rise from 0 to {T}, got {cu}")
    B, dev = len(cu) - 1, k.device
    V = K if v is None else v.shape[-1]

    def result(x, shape, name):
        x = torch.empty(shape, dtype=torch.float32, device=dev) if x is None else x
        if x.shape != shape or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"kda_transition: {name} must be contiguous {list(shape)} float32")
        return x

    m = result(out, (B, H, K, K), "out")
    h = result(out_h, (B, H, K, V), "out_h") if v is not None else m
    idx, offsets_t, nch = chunk_tables(cu, BT, dev)
    cu_t = device_ints(cu, dev)
    BK = max(next_power_of_2(K), 16)
    BVF = max(next_power_of_2(V), 16)
    # the in-chunk kernel's q is k here (and v too without values): its outputs from q (qg, the q.k matrix) are
    # unused
    vv = k if v is None else v
    w, qg, kd = (torch.empty(T, H, K, dtype=torch.float32, device=dev) for _ in range(3))
    u = torch.empty(T, H, V, dtype=torch.float32, device=dev)
    aqk = torch.empty(T, H, BT, dtype=torch.float32, device=dev)
    egl = torch.empty(max(nch, 1), H, K, dtype=torch.float32, device=dev)
    A_log, dt_bias, lower_bound = gate if gate is not None else (g, g, 0.0)
    if nch:
        kda_fp32_intra_kernel[(nch, H)](
            k, k, vv, g, beta, A_log, dt_bias, float(lower_bound) if lower_bound is not None else 0.0, cu_t, idx,
            w, u, qg, kd, aqk, egl,
            k.stride(0), k.stride(0), vv.stride(0), g.stride(0), beta.stride(0), K**-0.5,
            H=H, K=K, V=V, BK=BK, BVF=BVF, BT=BT, LOG2_BT=BT.bit_length() - 1,
            GATE_IN_KERNEL=gate is not None, HAS_LOWER_BOUND=gate is not None and lower_bound is not None,
            BETA_LOGITS=gate is not None, LOCAL_PRECISION=precision, SOLVE_PRECISION=precision, num_warps=4,
        )
    BM = min(CHAIN_BM, BK)
    nmk = cdiv(K, BM)
    kda_chain_kernel[(nmk + (cdiv(V, BM) if v is not None else 0), B * H)](
        w, kd, egl, u, m, h, cu_t, offsets_t, H=H, K=K, V=V, BK=BK, BM=BM, BT=BT, NMK=nmk, HAS_H=v is not None,
        PRECISION=precision, num_warps=CHAIN_WARPS,
    )
    return m if v is None else (m, h)


def kda_transition_launch(k, g, beta, cu_seqlens: list[int], gate=None, precision: str = "tf32x3",
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """M alone (``kda_summary_launch`` without values)."""
    return kda_summary_launch(k, None, g, beta, cu_seqlens, gate, precision, out)


def kda_transition(k, g, beta, cu_seqlens: list[int]) -> torch.Tensor:
    """M [B, H, K, K] float32 of each sequence: ``S_out = M S_in + H`` (``H`` from ``kda_prefill`` with no
    initial state)."""
    if use_triton(k, g, beta):
        return kda_transition_launch(k, g, beta, cu_seqlens)
    return kda_transition_ref(k, g, beta, cu_seqlens)


def kda_summary_gated(k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound,
                      cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(M [B, H, K, K], H [B, H, K, V]) float32 of each sequence of the packed ``k``, ``v``, with the gate and
    ``beta = sigmoid(beta_logits)`` computed from the raw projections."""
    if use_triton(k, v, g_raw, beta_logits):
        return kda_summary_launch(k, v, g_raw, beta_logits, cu_seqlens, (A_log, dt_bias, lower_bound))
    g = kda_gate_ref(g_raw, A_log, dt_bias, lower_bound)
    m, h = kda_summary_ref(k, v, g, torch.sigmoid(beta_logits.float()), cu_seqlens)
    return m.float(), h.float()

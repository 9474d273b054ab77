"""KDA chunked prefill for float32 activations (and head sizes the 64-token kernels do not tile), 16-token chunks in
two launches: the in-chunk work in parallel, then only the state recurrence in sequence.

``kda_fp32_intra_kernel`` (grid: chunks x heads, every chunk of every sequence at once) does all that does not
depend on the state: gate, beta, q/k L2 norm, the chunk-local cumulative decay, the in-chunk products against the
chunk's middle row, the WY inverse (the product ``(I + A)(I + A^2)(I + A^4)...``, A nilpotent), and writes per
token ``w = (I - A)^-1 (beta k exp(gc))``, ``u = (I - A)^-1 (beta v)``, ``qg = q exp(gc)``, ``kd = k exp(gl -
gc)``, the masked ``q.k`` decay matrix and per chunk ``exp(gl)`` (float32, ``gc`` the decay from the chunk start,
``gl`` the chunk's total).

``kda_fp32_state_kernel`` (grid: value blocks x sequences x heads) walks each sequence's chunks with the state in
registers: ``v' = u - w S``, ``o = qg S + A v'``, ``S = exp(gl) S + kd^T v'``. The three products with S carry it
across chunks and run in tf32x3 (``CHAIN_PRECISION``), which keeps the state at float32 accuracy; a plain tf32
chain's rounding compounds (a GPU test shows it). Arguments are validated by prefill.py; the intermediates cost
``T * H * (3K + V + BT) * 4`` bytes of scratch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda.common import load_gate_beta
from flashinfra.kernels.kda.common import state_tile
from flashinfra.kernels.varlen import chunk_tables
from flashinfra.kernels.launch import cdiv, next_power_of_2


@triton.jit
def kda_fp32_intra_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, cu_seqlens, chunk_indices,
    w, u, qg, kd, aqk, egl,
    stride_q_t, stride_k_t, stride_v_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    BT: tl.constexpr, LOG2_BT: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, BETA_LOGITS: tl.constexpr,
    LOCAL_PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_f = tl.arange(0, BVF)
    m_k, m_f = o_k < K, o_f < V
    rows = bos + i_t * BT + o_t
    m_t = i_t * BT + o_t < L
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_f[None, :]
    b_q = tl.load(q + rows[:, None] * stride_q_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + rows[:, None] * stride_k_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_v = tl.load(v + rows[:, None] * stride_v_t + i_h * V + o_f[None, :], mask=m_tv, other=0.0).to(tl.float32)
    MID: tl.constexpr = BT // 2
    G_MIN: tl.constexpr = -80.0 / MID
    b_g, b_b = load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t,
                              stride_b_t, K, GATE_IN_KERNEL, HAS_LOWER_BOUND, BETA_LOGITS, G_MIN)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None] * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_gc = tl.cumsum(b_g, 0)
    b_gm = tl.sum(tl.where((o_t == MID)[:, None], b_gc, 0.0), 0)
    b_gl = tl.sum(tl.where((o_t == BT - 1)[:, None], b_gc, 0.0), 0)
    b_kr = b_k * tl.exp(b_gm[None, :] - b_gc)
    b_A = tl.dot(b_k * tl.exp(b_gc - b_gm[None, :]), tl.trans(b_kr), input_precision=LOCAL_PRECISION)
    strict_lower = o_t[:, None] > o_t[None, :]
    b_A = tl.where(strict_lower, -b_b[:, None] * b_A, 0.0)
    b_Aqk = tl.dot(b_q * tl.exp(b_gc - b_gm[None, :]), tl.trans(b_kr), input_precision=LOCAL_PRECISION)
    b_Aqk = tl.where(strict_lower | (o_t[:, None] == o_t[None, :]), b_Aqk, 0.0)
    b_Ai = (o_t[:, None] == o_t[None, :]).to(tl.float32) + b_A
    b_P = b_A
    for _ in tl.static_range(LOG2_BT - 1):
        b_P = tl.dot(b_P, b_P, input_precision=SOLVE_PRECISION)
        b_Ai = b_Ai + tl.dot(b_Ai, b_P, input_precision=SOLVE_PRECISION)
    b_u = tl.dot(b_Ai, b_v * b_b[:, None], input_precision=LOCAL_PRECISION)
    b_w = tl.dot(b_Ai, b_k * (b_b[:, None] * tl.exp(b_gc)), input_precision=LOCAL_PRECISION)
    p_tk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    tl.store(w + p_tk, b_w, mask=m_tk)
    tl.store(qg + p_tk, b_q * tl.exp(b_gc), mask=m_tk)
    tl.store(kd + p_tk, b_k * tl.exp(b_gl[None, :] - b_gc), mask=m_tk)
    tl.store(u + rows[:, None] * (H * V) + i_h * V + o_f[None, :], b_u, mask=m_tv)
    tl.store(aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], b_Aqk, mask=m_t[:, None])
    tl.store(egl + (i_c * H + i_h) * K + o_k, tl.exp(b_gl), mask=m_k)


@triton.jit
def kda_fp32_state_kernel(
    w, u, qg, kd, aqk, egl, o, state, cu_seqlens, chunk_offsets, state_slots, has_initial_state, chunk_saves,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    CHAIN_PRECISION: tl.constexpr, LOCAL_PRECISION: tl.constexpr, SAVE: tl.constexpr,
):
    """With SAVE, ``chunk_saves`` [chunks] int32 names per chunk a state slot (or -1) that also receives the
    state after that chunk."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(state_slots + i_n).to(tl.int64)
    has_init = tl.load(has_initial_state + i_n) != 0
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
    # A fresh sequence ignores whatever its slot holds (NaN included).
    b_s = tl.where(has_init, tl.load(p_s, mask=m_s, other=0.0).to(tl.float32), 0.0)
    for i_t in range(0, tl.cdiv(L, BT)):
        rows = bos + i_t * BT + o_t
        m_t = i_t * BT + o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + p_tk, mask=m_tk, other=0.0)
        b_kd = tl.load(kd + p_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + rows[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        b_A = tl.load(aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
        b_e = tl.load(egl + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_vn = b_u - tl.dot(b_w, b_s, input_precision=CHAIN_PRECISION)
        b_o = tl.dot(b_qg, b_s, input_precision=CHAIN_PRECISION)
        b_o += tl.dot(b_A, b_vn, input_precision=LOCAL_PRECISION)
        tl.store(o + rows[:, None] * (H * V) + i_h * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_e[:, None] + tl.dot(tl.trans(b_kd), b_vn, input_precision=CHAIN_PRECISION)
        if SAVE:
            dst = tl.load(chunk_saves + c0 + i_t).to(tl.int64)
            if dst >= 0:
                p_d, _ = state_tile(state, dst, i_h, o_k, o_v, H, K, V)
                tl.store(p_d, b_s.to(state.dtype.element_ty), mask=m_s)
    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)


# 16-token chunks; the state's products (its chain from chunk to chunk) in tf32x3, the in-chunk ones in tf32
BT = 16
CHAIN_PRECISION, LOCAL_PRECISION = "tf32x3", "tf32"
STATE_WARPS, STATE_STAGES = 8, 2


def kda_prefill_fp32(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate, saves_t=None):
    """Launch both kernels on arguments that prefill.py has validated (``cu`` on the host, the rest on
    the device); ``gate`` is ``(A_log, dt_bias, lower_bound)`` or None; ``saves_t`` the per-chunk checkpoint
    slots (prefill.py) or None."""
    T, H, K = q.shape
    V = v.shape[-1]
    BV = min(max(next_power_of_2(V), 16), 64)
    chain_precision, local_precision = CHAIN_PRECISION, LOCAL_PRECISION
    idx, offsets_t, nch = chunk_tables(cu, BT, q.device)
    if not nch:
        return o
    dev = q.device
    w, qg, kd = (torch.empty(T, H, K, dtype=torch.float32, device=dev) for _ in range(3))
    u = torch.empty(T, H, V, dtype=torch.float32, device=dev)
    aqk = torch.empty(T, H, BT, dtype=torch.float32, device=dev)
    egl = torch.empty(nch, H, K, dtype=torch.float32, device=dev)
    A_log, dt_bias, lower_bound = gate if gate is not None else (g, g, 0.0)
    BK = max(next_power_of_2(K), 16)
    kda_fp32_intra_kernel[(nch, H)](
        q, k, v, g, beta, A_log, dt_bias, float(lower_bound) if lower_bound is not None else 0.0, cu_t, idx,
        w, u, qg, kd, aqk, egl,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), K**-0.5,
        H=H, K=K, V=V, BK=BK, BVF=max(next_power_of_2(V), 16), BT=BT, LOG2_BT=BT.bit_length() - 1,
        GATE_IN_KERNEL=gate is not None, HAS_LOWER_BOUND=gate is not None and lower_bound is not None,
        BETA_LOGITS=gate is not None, LOCAL_PRECISION=local_precision, SOLVE_PRECISION=chain_precision,
        num_warps=4,
    )
    kda_fp32_state_kernel[(cdiv(V, BV), (len(cu) - 1) * H)](
        w, u, qg, kd, aqk, egl, o, state, cu_t, offsets_t, slots_t, init_t, cu_t if saves_t is None else saves_t,
        H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, CHAIN_PRECISION=chain_precision, LOCAL_PRECISION=local_precision,
        SAVE=saves_t is not None,
        num_warps=STATE_WARPS, num_stages=STATE_STAGES,
    )
    return o

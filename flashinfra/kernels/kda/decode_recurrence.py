"""KDA decode: one token per sequence, the recurrent state read from and written back to its slot.

Same recurrence as ``kda_prefill`` (see there), one step: decay, delta-rule update, read-out.

Triton path: one program per (sequence, head, block of ``BV`` value columns) holds its ``[K, BV]`` slice
of the state in registers, so the state is read once and written once, in place. The state may be
float32 or bfloat16 (the arithmetic is float32 either way; a bf16 state is rounded once per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import interpreting, register_cap, use_triton
from flashinfra.kernels.kda.gate import l2norm_ref
from flashinfra.kernels.kda.common import (load_state, state_step, state_step_dot, state_tile,
                                                      store_state)


def kda_decode_ref(
    q: torch.Tensor,  # [B, H, K] not yet normalised
    k: torch.Tensor,  # [B, H, K]
    v: torch.Tensor,  # [B, H, V]
    g: torch.Tensor,  # [B, H, K] float32 log-decay
    beta: torch.Tensor,  # [B, H] float32
    state: torch.Tensor,  # [num_slots, H, K, V], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, H, V] in q's dtype
    K, dtype = q.shape[-1], q.dtype
    # float32 arithmetic, or float64 where q or the state is float64 (the tests' and checks' references)
    ct = torch.promote_types(torch.promote_types(q.dtype, state.dtype), torch.float32)
    q = l2norm_ref(q.to(ct)) * K**-0.5
    k = l2norm_ref(k.to(ct))
    S = state[state_slots].to(ct) * g.to(ct).exp()[..., None]  # [B, H, K, V]
    delta = (v.to(ct) - (S * k[..., None]).sum(-2)) * beta.to(ct)[..., None]  # [B, H, V]
    S = S + k[..., None] * delta[..., None, :]
    o = (S * q[..., None]).sum(-2)
    state[state_slots] = S.to(state.dtype)
    return o.to(dtype)


@triton.jit
def kda_decode_kernel(
    q, k, v, g, beta, o, state, state_slots,
    stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_SUMS: tl.constexpr = False, DOT_F32: tl.constexpr = False, EVEN: tl.constexpr = False,
):
    """Grid (cdiv(V, BV), B * H). DOT_SUMS (a bf16 state): the step's two sums over K as one tensor-core product
    on the block as loaded (``state_step_dot``); DOT_F32: the interpreter's widened bf16 products; EVEN (BK == K
    and BV divides V): every block inside the state, read and written without a mask."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, (o_v < V) | EVEN  # a constant mask, folded away, where EVEN
    p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
    b_s = load_state(p_s, m_s, not EVEN)  # [BK, BV]
    if not DOT_SUMS:
        b_s = b_s.to(tl.float32)
    # Every load is issued before any arithmetic: widened at its load, q's and k's vectors went to the state's
    # row layout through shared memory right there, and the loads after each such barrier (k, v, g) waited for
    # it, one more round trip each (compiled for sm_90, the loads of v and g came after four barriers).
    b_q = tl.load(q + i_b * stride_q_b + i_h * stride_q_h + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k + i_b * stride_k_b + i_h * stride_k_h + o_k, mask=m_k, other=0.0)
    b_v = tl.load(v + i_b * stride_v_b + i_h * stride_v_h + o_v, mask=m_v, other=0.0)
    b_g = tl.load(g + i_bh * K + o_k, mask=m_k, other=0.0)
    b_beta = tl.load(beta + i_bh)
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    r_q = scale / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
    r_k = 1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    if DOT_SUMS:
        b_s, b_o = state_step_dot(b_s, b_q * r_q, b_k * r_k, tl.exp(b_g.to(tl.float32)), b_beta.to(tl.float32),
                                  b_v.to(tl.float32), BV, DOT_F32)
    else:
        b_s, b_o = state_step(b_s, b_q * r_q, b_k * r_k, tl.exp(b_g.to(tl.float32)), b_beta.to(tl.float32),
                              b_v.to(tl.float32))
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    store_state(p_s, b_s, m_s, not EVEN)


def _check_decode_args(q, k, v, g, beta, state, state_slots) -> tuple[int, int, int, int]:
    B, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, H, K) or v.shape != (B, H, V) or g.shape != (B, H, K) or beta.shape != (B, H):
        raise ValueError(
            f"kda_decode: shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"g {tuple(g.shape)} beta {tuple(beta.shape)}"
        )
    if state.dim() != 4 or state.shape[1:] != (H, K, V) or not state.is_contiguous():
        raise ValueError(f"kda_decode: state must be contiguous [slots, {H}, {K}, {V}], got {tuple(state.shape)}")
    if state_slots.shape != (B,):
        raise ValueError(f"kda_decode: state_slots must be [{B}], got {tuple(state_slots.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("kda_decode: q, k, v need a contiguous last dim")
    return B, H, K, V


def check_block_options(op: str, BV: int | None, maxnreg: int | None, *warps: int | None) -> None:
    """A decode launch's block width, register cap and warps (of each of its launches), as a clear error instead
    of one deep in Triton; None: the configuration's own."""
    for name, n in (("BV", BV), *(("num_warps", w) for w in warps)):
        if n is not None and (n < 1 or n & (n - 1)):
            raise ValueError(f"{op}: {name} must be a power of two, got {n}")
    if any(w is not None and w > 32 for w in warps):
        raise ValueError(f"{op}: num_warps must be at most 32, got {max(w for w in warps if w is not None)}")
    if maxnreg is not None and not 24 <= maxnreg <= 255:
        raise ValueError(f"{op}: maxnreg must be None or in [24, 255], got {maxnreg}")


def check_dot_sums(op: str, dot_sums: bool, state_dtype: torch.dtype, K: int, BV: int | None) -> None:
    """``dot_sums`` needs a bf16 state (a float32 block is not exact in bf16) and products of at least 16 by 16."""
    if dot_sums and state_dtype != torch.bfloat16:
        raise ValueError(f"{op}: dot_sums needs a bfloat16 state, got {state_dtype}")
    if dot_sums and (K < 16 or (BV is not None and BV < 16)):
        raise ValueError(f"{op}: dot_sums needs K and BV of at least 16, got K={K} BV={BV}")


def blocks_inside(K: int, V: int, BK: int, BV: int) -> bool:
    """Whether every [BK, BV] block of a [K, V] state lies inside it (the kernels' ``EVEN``: no masks)."""
    return BK == K and V % BV == 0


def dot_sums_fit(state_dtype: torch.dtype, K: int, BV: int) -> bool:
    """Whether a configuration's ``dot_sums`` applies to this state (``check_dot_sums`` would pass)."""
    return state_dtype == torch.bfloat16 and K >= 16 and BV >= 16


def recurrence_config(B: int, state_dtype: torch.dtype) -> dict:
    """Value columns per program, warps and the step's form, the fastest in a CUDA graph on an H200 (H=64, K=V=128;
    B=1, 16, 64, 256): float32 state [K, 64] blocks on 4 warps above B=1 (2.4% / 3.8% faster than [K, 32] at B=64 /
    256, level at 16; bench/results/kda_decode_recurrence.json), [K, 32] on 4 warps at B=1; bfloat16 state [K, 64]
    on 4 warps with the sums over K on the tensor cores (``dot_sums``: 75.0 / 279.5 us at B=64 / 256 against 81.0 /
    307.6 for the step on the CUDA cores at its best shape, [K, 32] on 2 warps; level at 16;
    bench/results/kda_decode_dot_sums.json)."""
    if state_dtype == torch.float32:
        return dict(BV=64 if B > 1 else 32, num_warps=4, dot_sums=False)
    return dict(BV=64, num_warps=4, dot_sums=True)


def kda_decode_launch(q, k, v, g, beta, state, state_slots, BV: int | None = None, num_warps: int | None = None,
                      out: torch.Tensor | None = None, maxnreg: int | None = None, dot_sums: bool | None = None):
    """``BV`` value columns per program on ``num_warps`` warps; ``maxnreg`` caps the registers per thread (more
    programs per SM); ``dot_sums`` (a bf16 state, K and BV at least 16): the step's sums over K on the tensor cores
    (``state_step_dot``). Each left out: ``recurrence_config``'s (its ``dot_sums`` where the state fits it)."""
    B, H, K, V = _check_decode_args(q, k, v, g, beta, state, state_slots)
    check_block_options("kda_decode", BV, maxnreg, num_warps)
    check_dot_sums("kda_decode", dot_sums, state.dtype, K, BV)
    o = torch.empty((B, H, V), dtype=q.dtype, device=q.device) if out is None else out
    if o.shape != (B, H, V) or o.dtype != q.dtype or not o.is_contiguous():
        raise ValueError(f"kda_decode: out must be contiguous [{B}, {H}, {V}] {q.dtype}")
    if B == 0:
        return o
    cfg = recurrence_config(B, state.dtype)
    BK = triton.next_power_of_2(K)
    BV = BV or min(cfg["BV"], max(triton.next_power_of_2(V), 16))
    num_warps = num_warps or cfg["num_warps"]
    if dot_sums is None:
        dot_sums = cfg["dot_sums"] and dot_sums_fit(state.dtype, K, BV)
    g, beta = g.contiguous(), beta.contiguous()
    kda_decode_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, o, state, state_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), K**-0.5,
        H=H, K=K, V=V, BK=BK, BV=BV, DOT_SUMS=dot_sums, DOT_F32=interpreting(),
        EVEN=blocks_inside(K, V, BK, BV), num_warps=num_warps, **register_cap(maxnreg),
    )
    return o


def kda_decode(q, k, v, g, beta, state, state_slots):
    if use_triton(q, k, v, g, beta, state, state_slots):
        return kda_decode_launch(q, k, v, g, beta, state, state_slots)
    return kda_decode_ref(q, k, v, g, beta, state, state_slots)

"""The ReplaySSM fold of one KDA layer, fused: each sequence's accepted ring entries replayed onto its committed
checkpoint (the recurrent state and the conv window), in place.

``kda_fold_state_kernel``: one program per (sequence, head, block of ``BV`` value columns) loads the checkpoint's
state block and applies, for each accepted entry, the decode kernel's delta-rule step (decode.py's helpers: the
k L2 norm, ``state_step``) to the entry's k, v, log-decay and beta as the verify kernel wrote them, rounding the
state to its dtype after each step as the decode kernel's store and reload do. So the folded state is, bit for
bit, what the decode kernel stepped token by token would have left (and what the verify kernel computed on the
way). The step's output is not needed: q is not read.

``kda_fold_conv_kernel``: one program per (sequence, block of channels) shifts the conv window by the accepted
count: the new last ``W - 1`` inputs are the old window followed by the accepted entries' raw q|k|v.

Both take the accepted counts as a device tensor (no host read), so a speculative step can be captured whole. A
count of zero leaves the slot untouched; counts must not exceed the ring's entries (the caller checks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda.common import conv_slot, state_step, state_tile
from flashinfra.kernels.kda.decode import head_qk_norm
from flashinfra.kernels.kda.verify import BV_VERIFY, VERIFY_WARPS
from flashinfra.kernels.launch import cdiv, next_power_of_2

BC_FOLD = 128  # channels per conv-shift program


@triton.jit
def kda_fold_state_kernel(state, state_slots, num_accepted, ring_k, ring_v, ring_g, ring_beta, R,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Grid (cdiv(V, BV), B * H): one [K, BV] state block stepped over the slot's accepted entries."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    n = tl.load(num_accepted + i_b)
    if n > 0:
        slot = tl.load(state_slots + i_b).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
        b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        for i in range(0, n):
            e = (slot * R + i) * H + i_h  # the entry's row of head i_h
            b_k = tl.load(ring_k + e * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(ring_v + e * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(ring_g + e * K + o_k, mask=m_k, other=0.0)
            b_beta = tl.load(ring_beta + e)
            b_q, b_k = head_qk_norm(b_k, b_k, 1.0)
            b_s, _ = state_step(b_s, b_q, b_k, tl.exp(b_g), b_beta, b_v)
            b_s = b_s.to(state.dtype.element_ty).to(tl.float32)  # the decode kernel's store and reload
        tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)


@triton.jit
def kda_fold_conv_kernel(conv_state, state_slots, num_accepted, ring_x, R, C, W: tl.constexpr, BC: tl.constexpr):
    """Grid (B, cdiv(C, BC)): the slot's window of the last W - 1 inputs, shifted by its accepted count."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    n = tl.load(num_accepted + i_b)
    if n > 0:
        slot = tl.load(state_slots + i_b).to(tl.int64)
        ch = i_c * BC + tl.arange(0, BC)
        m = ch < C
        cs = conv_state + slot * C * (W - 1)
        # column j takes column n + j of [old window, accepted entries]: with n >= 1 it reads a later column
        # than any it has written, so the shift runs in place column by column
        for j in tl.static_range(W - 1):
            p = n + j
            old = (tl.zeros_like(ch) + p) < W - 1
            b_old = tl.load(cs + ch * (W - 1) + tl.minimum(p, W - 2), mask=m & old, other=0.0)
            b_new = tl.load(ring_x + (slot * R + tl.maximum(p - (W - 1), 0)) * C + ch, mask=m & ~old, other=0.0)
            tl.store(cs + ch * (W - 1) + j, tl.where(old, b_old, b_new.to(b_old.dtype)), mask=m)


def kda_fold_launch(ring, conv_state: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor,
                    num_accepted: torch.Tensor) -> None:
    """Triton ``kda_fold``: ``state_slots`` and ``num_accepted`` [B] int tensors on the state's device."""
    S, H, K, V = state.shape
    C, Wm1 = conv_state.shape[1:]
    R = ring.x.shape[1]
    if (not state.is_contiguous() or not conv_state.is_contiguous() or conv_state.shape[0] != S
            or ring.k.shape != (S, R, H, K) or ring.v.shape != (S, R, H, V) or ring.x.shape != (S, R, C)
            or state_slots.shape != num_accepted.shape or state_slots.dim() != 1):
        raise ValueError(f"kda_fold: state {tuple(state.shape)}, conv {tuple(conv_state.shape)}, ring x "
                         f"{tuple(ring.x.shape)} k {tuple(ring.k.shape)} v {tuple(ring.v.shape)}, slots "
                         f"{tuple(state_slots.shape)}, counts {tuple(num_accepted.shape)} do not fit")
    B = state_slots.shape[0]
    if B == 0:
        return
    BV = min(BV_VERIFY, next_power_of_2(V))
    kda_fold_state_kernel[(cdiv(V, BV), B * H)](
        state, state_slots, num_accepted, ring.k, ring.v, ring.g, ring.beta, R, H=H, K=K, V=V,
        BK=next_power_of_2(K), BV=BV, num_warps=VERIFY_WARPS)
    if Wm1 > 0:
        kda_fold_conv_kernel[(B, cdiv(C, BC_FOLD))](conv_state, state_slots, num_accepted, ring.x, R, C,
                                                    W=Wm1 + 1, BC=BC_FOLD)

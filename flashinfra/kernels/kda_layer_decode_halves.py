"""The state kernel of the KDA layer decode's ``"halves"`` layout (``kda_layer_decode_launch``): one program per
(sequence, head) holding the head's whole state as two [K, V/2] column halves, so that the gated RMSNorm of
the head's output row is applied in the same program and the layer is two launches (the prep launch, then
this one) instead of the prep layout's three.

The prep launch (q/k conv, L2 norms, decay and beta into the float32 scratch ``heads`` [B * H, 4, BK], the
q/k conv slot shifted) comes first, as for ``"prep"``; this kernel reads the scratch, computes and shifts
the v conv, and steps each half. Why two halves and not one [K, V] block: compiled for sm_90 (Triton 3.6,
K = V = 128) a whole [K, V] block on 8 warps takes 186 registers for a float32 state, one program per SM,
where the two halves (with the v conv, the second half's computed after the first half is stored) take 160,
or 128 without spills when capped there, and fit two: the same 128 KB of state in flight per SM as the prep
layout's four [K, 64] programs (bench/notes/kda_decode.md, "Whole rows as two halves").
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda_layer_decode_parts import (conv_shift, conv_silu, conv_slot, gate_apply, load_state,
                                                       state_step, state_tile)


@triton.jit
def kda_layer_decode_halves_kernel(
    qkv, conv_w, conv_state, state, state_slots, out, heads, gate, norm_w, eps, stride_x, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr,
):
    """Grid (B * H,): columns [0, BH) and [BH, 2 BH) of the head's state (BH = next power of two of V / 2;
    columns past V are masked: a zero state and a zero v give a zero output there), both read before
    either is stepped; each half written back as soon as it is stepped; then the output row, rounded to
    out's dtype as the norm launch would read it, normalised over its V columns, gated and stored."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_a = tl.arange(0, BH)
    o_b = BH + o_a
    m_a, m_b = o_a < V, o_b < V
    p_a, mm_a = state_tile(state, slot, i_h, o_k, o_a, H, K, V)
    p_b, mm_b = state_tile(state, slot, i_h, o_k, o_b, H, K, V)
    s_a = load_state(p_a, mm_a).to(tl.float32)  # the big loads first, both halves in flight
    s_b = load_state(p_b, mm_b).to(tl.float32)
    x_row = qkv + i_b * stride_x
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    p_h = heads + i_bh * 4 * BK + o_k
    b_q, b_k, b_decay = tl.load(p_h), tl.load(p_h + BK), tl.load(p_h + 2 * BK)
    b_beta = tl.load(heads + i_bh * 4 * BK + 3 * BK)
    ch_v = 2 * H * K + i_h * V
    s_a, y_a = state_step(s_a, b_q, b_k, b_decay, b_beta, conv_silu(x_row, conv_w, cs_slot, ch_v + o_a, m_a, W))
    tl.store(p_a, s_a.to(state.dtype.element_ty), mask=mm_a)
    s_b, y_b = state_step(s_b, b_q, b_k, b_decay, b_beta, conv_silu(x_row, conv_w, cs_slot, ch_v + o_b, m_b, W))
    tl.store(p_b, s_b.to(state.dtype.element_ty), mask=mm_b)
    o_f = tl.arange(0, 2 * BH)
    conv_shift(x_row, cs_slot, ch_v + o_f, o_f < V, W, BW)
    ODT: tl.constexpr = out.dtype.element_ty
    y_a = y_a.to(ODT).to(tl.float32)
    y_b = y_b.to(ODT).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(y_a * y_a) + tl.sum(y_b * y_b)) / V + eps)
    gate_row = gate + i_b * stride_gate + i_h * V
    tl.store(out + i_bh * V + o_a, gate_apply(y_a * r, gate_row, norm_w, o_a, m_a).to(ODT), mask=m_a)
    tl.store(out + i_bh * V + o_b, gate_apply(y_b * r, gate_row, norm_w, o_b, m_b).to(ODT), mask=m_b)


def halves_state_launch(qkv, conv_weight, conv_state, state, state_slots, out, heads, gate, norm_weight, eps: float,
                        sizes: dict, num_warps: int, maxnreg: int | None) -> None:
    """The state launch of the ``"halves"`` layout, after the prep launch has filled ``heads``; ``maxnreg`` caps
    its registers per thread."""
    B, H, V = out.shape
    kda_layer_decode_halves_kernel[(B * H,)](
        qkv, conv_weight, conv_state, state, state_slots, out, heads, gate, norm_weight, float(eps), qkv.stride(0),
        gate.stride(0), H=H, K=sizes["K"], V=V, BK=sizes["BK"], BH=triton.next_power_of_2(triton.cdiv(V, 2)),
        W=sizes["W"], BW=sizes["BW"], num_warps=num_warps, **({} if maxnreg is None else dict(maxnreg=maxnreg)))


# (grid, BV, num_warps, launch options) of the halves layout worth comparing: bench/kda_decode.py times each at every
# batch size and state dtype, tests/kernels/test_kda_gpu.py runs each (BV is the whole row whatever is given)
HALVES_VARIANTS = [("halves", 128, 8, dict(maxnreg=128)), ("halves", 128, 8, {}), ("halves", 128, 4, {})]

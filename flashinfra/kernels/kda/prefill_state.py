"""KDA prefill in 64-token chunks, the state pass: one sequential program per (value block, sequence, head) that
carries the state through the sequence's chunks, from the per-chunk tiles the in-chunk kernels wrote (launched
last, prefill.py).

``kda_state_pass_kernel`` keeps the state ``S`` [K, BV] in float32 registers (transposed) and per chunk computes
``v' = u - w S``, ``o = qg S + Aqk v'`` and ``S = exp(gl) S + kd^T v'``: products shaped for the tensor cores'
warpgroup instructions, each with its state-side operand in registers and its tile in shared memory. The products
that carry S from chunk to chunk (``CHAIN``) split S and v' into bf16 hi + lo parts each step and accumulate in
float32; at the shipped ``CHAIN=3`` (bf16x3) w and kd arrive as bf16 pairs too, ``a b ~ a_hi b_hi + a_lo b_hi +
a_hi b_lo``: about 16 bits of every operand, so no single-bf16 rounding compounds in the state. ``CHAIN=2`` (w and
kd one bf16 each: an input rounding, which does not compound through S) and ``CHAIN=1`` (S rounded to bf16 every
step: its rounding compounds) exist for the test that shows them worse.

The output's products use S's hi and lo parts with qg's hi part, and form ``Aqk v'`` in the chain's precision
(Aqk's lo half where written). With ``AIB`` (bf16 v) the pass forms u itself from v's tiles and ``Aib = Ai
diag(beta)``, which the off-diagonal kernel writes as a bf16 pair, and w's product too, ``w S = Aib (kg S)`` with
``kg = k exp(gc)`` from the diagonal kernel; otherwise (fp16) the w/u kernel writes w, and u in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashinfra.kernels.kda.common import bf16_pair, mma_bf16, prefetch_l2


@triton.jit
def _parts(x, CHAIN: tl.constexpr):
    """x's bf16 hi and lo parts. Where the chain takes both (CHAIN >= 2), hi + lo is within 2^-16 of x: hi is x
    truncated to bf16 by a mask on its bits, lo the rest rounded to bf16. Truncating costs one bit against
    rounding hi to nearest (2^-17), and saves a conversion (F2F, a quarter-rate instruction) per element on the
    chain between two products, with the same errors against float64 to three digits. The single-bf16 chain
    (CHAIN 1) rounds hi to nearest: truncated, its one rounding a step would bias S."""
    if CHAIN == 1:
        return bf16_pair(x)
    bits = x.to(tl.uint32, bitcast=True)
    hi = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), (x - hi).to(tl.bfloat16)


@triton.jit
def kda_state_pass_kernel(
    wqk, u, aqk, egl, o, state, cu_seqlens, chunk_offsets, state_slots, has_initial_state, wqk_p, u_p, aqk_p,
    v, stride_v, chunk_saves, state_p,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    CHAIN: tl.constexpr, NS: tl.constexpr, SQ: tl.constexpr, SKD: tl.constexpr,
    A_LO: tl.constexpr, DOT_F32: tl.constexpr, L2_AHEAD: tl.constexpr = 0, AIB: tl.constexpr = False,
    SAVE: tl.constexpr = False,
):
    """``wqk``, ``u``, ``aqk`` and ``state`` are tensor descriptors over the scratch and the state slots viewed
    as [rows, K], [rows, 64], [rows, 64] and [slots * H * K, V] (the state float32 or bf16: read into float32,
    rounded to its dtype at each store, the final state's and a checkpoint's): each tile moves between memory and shared
    memory by the copy engine, and no tensor of pointers stays live across the loop. CHAIN is 3 (bf16x3), 2
    (bf16x2) or 1 (bf16); ``wqk`` has NS slots per chunk and head, w's at 0, qg's at SQ, kd's at SKD, each lo
    half (where written) in the next slot; ``u`` holds u^T ([V, 64]) per chunk and head, ``aqk`` Aqk ([64, 64]
    bf16, with A_LO its lo half next: ``Aqk v'`` in the chain's precision, Aqk in kd's place).

    The state is carried transposed, ``Z = S^T`` [BV, K]: ``v'^T = u^T - Z w^T``, ``o^T = Z qg^T + v'^T Aqk^T``,
    ``Z = exp(gl) Z + v'^T kd``. Every product then takes Z's or v'^T's bf16 parts, which live in registers, as
    its first operand, and a tile the copy engine brought to shared memory as its second: nothing the chain
    computes goes through shared memory on its way to the next product.

    ``wqk_p``, ``u_p`` and ``aqk_p`` are the same scratch as pointers: with L2_AHEAD, each step first asks the L2
    for the tiles of the step that many ahead (one bulk prefetch per tensor, from the first thread). Triton issues
    a two-deep ring's copies for a step at the end of the step before, so without it each step begins by waiting
    on DRAM.

    With AIB (bf16 v) the pass forms u itself, ``u^T = v^T Aib^T`` (two products: v exact in bf16, ``Aib = Ai
    diag(beta)`` as the off-diagonal kernel's bf16 hi + lo pair, which ``u`` and ``u_p`` then hold, [rows, 64] per
    half), from v's [64, BV] tiles through a descriptor made here over the sequence's own rows (``v``,
    ``stride_v``: the copy engine fills the rows past its end with zeros, so another sequence's values never enter
    the products), and w's slots hold ``-kg = -k exp(gc)`` (the diagonal kernel's) instead of ``w = Aib kg``: the
    pass applies Aib after the state, ``v'^T = u^T + (Z (-kg)^T) Aib^T``, the second product in the chain's
    precision (``Z (-kg)^T``'s bf16 parts against Aib's pair). Without AIB (fp16) the w/u kernel writes w, and u
    in float32.

    With SAVE, ``chunk_saves`` [chunks] int32 names per chunk a state slot (or -1): the state after that chunk is
    also stored there (prefix checkpoints inside the step, prefill.py), through plain pointer stores into
    ``state_p`` (the state slots as a tensor), as the float32 kernels store theirs: with a descriptor store under
    that data-dependent branch inside the pipelined loop, the checkpoint tests failed on the H100 for this kernel
    alone."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    c0 = tl.load(chunk_offsets + i_n)
    slot = tl.load(state_slots + i_n)
    has_init = tl.load(has_initial_state + i_n) != 0
    o_r = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    # A fresh sequence ignores whatever its slot holds (NaN included).
    r_s = (slot * H + i_h) * K
    b_z = tl.trans(tl.where(has_init, state.load([r_s, i_v * BV]).to(tl.float32), 0.0))
    nt = tl.cdiv(L, 64).to(tl.int32)
    if AIB:
        v_d = tl.make_tensor_descriptor(v + bos * stride_v + i_h * V + i_v * BV, [L.to(tl.int32), BV], [stride_v, 1],
                                        [64, BV])
    # exp(gl) is loaded a step ahead: a plain load waits at its first use and the pipeliner leaves it in place, so
    # loaded where it is used it costs a global round trip in every step. A sequence without chunks loads nothing
    # (its first chunk may lie past the end of the scratch).
    b_e_next = tl.load(egl + (c0 * H + i_h).to(tl.int64) * K + o_k, mask=o_k < tl.where(nt > 0, K, 0))
    for i_t in range(0, nt):
        base = (c0 + i_t) * H + i_h
        if L2_AHEAD:
            ahead = ((c0 + tl.minimum(i_t + L2_AHEAD, nt - 1)) * H + i_h).to(tl.int64)
            prefetch_l2(wqk_p + ahead * (NS * 64 * K), NS * 64 * K * 2)
            if AIB:
                prefetch_l2(u_p + ahead * (2 * 4096), 2 * 4096 * 2)  # Aib's pair in u's place
            else:
                prefetch_l2(u_p + (ahead * V + i_v * BV) * 64, BV * 64 * 4)
            prefetch_l2(aqk_p + ahead * ((1 + A_LO) * 4096), (1 + A_LO) * 4096 * 2)
        b_e = b_e_next
        b_e_next = tl.load(egl + ((c0 + tl.minimum(i_t + 1, nt - 1)) * H + i_h).to(tl.int64) * K + o_k)
        r_w = base * (NS * 64)
        r_a = base * ((1 + A_LO) * 64)
        b_wh = tl.trans(wqk.load([r_w, 0]))
        b_qh = tl.trans(wqk.load([r_w + SQ * 64, 0]))
        b_kh = wqk.load([r_w + SKD * 64, 0])
        b_zh, b_zl = _parts(b_z, CHAIN)
        # the decay now, while the step's first products run: Z itself is not read again this step
        b_z = b_z * b_e[None, :]
        # the output's state part first, so that Z's parts are free before v' is formed
        b_o = mma_bf16(b_zh, b_qh, tl.zeros([BV, 64], dtype=tl.float32), DOT_F32)
        b_o = mma_bf16(b_zl, b_qh, b_o, DOT_F32)
        b_ws = mma_bf16(b_zh, b_wh, tl.zeros([BV, 64], dtype=tl.float32), DOT_F32)
        if CHAIN == 3:
            b_ws = mma_bf16(b_zh, tl.trans(wqk.load([r_w + 64, 0])), b_ws, DOT_F32)
        if CHAIN >= 2:
            b_ws = mma_bf16(b_zl, b_wh, b_ws, DOT_F32)
        if AIB:
            b_vt = tl.trans(v_d.load([i_t * 64, 0]))
            r_u = base * (2 * 64)  # Aib's hi and lo [64, 64] halves
            b_ah = tl.trans(u.load([r_u, 0]))
            b_al = tl.trans(u.load([r_u + 64, 0]))
            b_u = mma_bf16(b_vt, b_al, mma_bf16(b_vt, b_ah, tl.zeros([BV, 64], dtype=tl.float32), DOT_F32), DOT_F32)
            # v'^T = u^T + (Z (-kg)^T) Aib^T: b_ws holds Z (-kg)^T (w's slots hold -kg); v stays the first operand
            # of u's products (as the accumulator its tile's copy left the pipeline: each step waited for it)
            b_th, b_tl = _parts(b_ws, CHAIN)
            b_vn = mma_bf16(b_th, b_ah, b_u, DOT_F32)
            if CHAIN >= 2:
                b_vn = mma_bf16(b_tl, b_ah, mma_bf16(b_th, b_al, b_vn, DOT_F32), DOT_F32)
        else:
            b_vn = u.load([base * V + i_v * BV, 0]) - b_ws
        b_vh, b_vl = _parts(b_vn, CHAIN)
        # the output's in-chunk part, v' against Aqk (lower triangular, its upper blocks zeros)
        b_at = tl.trans(aqk.load([r_a, 0]))
        b_o = mma_bf16(b_vh, b_at, b_o, DOT_F32)
        if A_LO:
            b_o = mma_bf16(b_vh, tl.trans(aqk.load([r_a + 64, 0])), b_o, DOT_F32)
        if CHAIN >= 2:
            b_o = mma_bf16(b_vl, b_at, b_o, DOT_F32)
        rows = i_t * 64 + o_r
        tl.store(o + (bos + rows)[None, :] * (H * V) + i_h * V + o_v[:, None], b_o.to(o.dtype.element_ty),
                 mask=(rows < L)[None, :])
        b_z = mma_bf16(b_vh, b_kh, b_z, DOT_F32)
        if CHAIN == 3:
            b_z = mma_bf16(b_vh, wqk.load([r_w + SKD * 64 + 64, 0]), b_z, DOT_F32)
        if CHAIN >= 2:
            b_z = mma_bf16(b_vl, b_kh, b_z, DOT_F32)
        if SAVE:
            dst = tl.load(chunk_saves + c0 + i_t).to(tl.int64)
            if dst >= 0:  # Z = S^T: element (v, k) goes to the slot's row k, column v
                slot_rows = (dst * H + i_h) * K + o_k
                tl.store(state_p + slot_rows[None, :] * V + o_v[:, None], b_z.to(state_p.dtype.element_ty),
                         mask=(o_v < V)[:, None])
    state.store([r_s, i_v * BV], tl.trans(b_z).to(state.dtype))

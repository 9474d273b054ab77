"""KDA prefill (v3), the state pass written in Gluon (Triton's explicit-layout dialect) for Hopper: the same
products as ``kda_state64_kernel`` (kda_prefill_v3.py, which stays the path under Triton's CPU interpreter and
for ``out_x3``), scheduled by hand.

Triton's own pipeliner makes a warpgroup product asynchronous only when its register operand is defined outside
the loop or by another product; every product of the state pass takes Z's or v''s bf16 parts, split in the step,
so each one was followed by a full wait: the step's ten products ran one after another with their whole latency,
and the tiles' copies were placed by the pipeliner. Here:

- the tiles of a step (w, qg and kd with their lo halves, u^T, Aqk, exp(gl)) come by the copy engine into a ring
  of ``STAGES`` buffers, one barrier per buffer, and a buffer is refilled as soon as the step that read it has
  waited for its last product;
- the products are issued asynchronously and waited for only where a value is needed: the output's ``Z qg^T``
  runs behind ``Z w^T`` (whose wait leaves it in flight), and ``v'^T Aqk^T`` behind the state update ``v'^T kd``.

Per step, with ``Z = S^T`` [BV, K] in float32 registers: ``v'^T = u^T - Z w^T``,
``o^T = Z qg^T + v'^T Aqk^T``, ``Z = exp(gl) Z + v'^T kd``; the chain's products in ``CHAIN`` bf16 parts
(kda_prefill_v3.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# the copy engine's global -> shared copy: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before
_copy_in = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _issue_tiles(t, nt, c0, i_h, i_v, tiles, u_s, a_s, e_s, bars, wqk_d, u_d, aqk_d, egl_d,
                 H: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, CHAIN: gl.constexpr, NS: gl.constexpr,
                 SQ: gl.constexpr, SKD: gl.constexpr, A_LO: gl.constexpr, NT: gl.constexpr,
                 STAGES: gl.constexpr):
    """Step t's tiles into ring buffer ``t % STAGES`` (nothing past the sequence's last step): tile slots 0 w,
    1 qg, 2 kd, 3 w's lo half, 4 kd's; Aqk and its lo half; u^T; exp(gl)."""
    s = t % STAGES
    pred = t < nt
    bar = bars.index(s)
    NBYTES: gl.constexpr = (NT * wqk_d.block_type.nbytes + u_d.block_type.nbytes
                            + (1 + A_LO) * aqk_d.block_type.nbytes + egl_d.block_type.nbytes)
    mbarrier.expect(bar, NBYTES, pred=pred)
    base = (c0 + t) * H + i_h
    r_w = base * (NS * 64)
    _copy_in(wqk_d, [r_w, 0], bar, tiles.index(s * NT), pred=pred)
    _copy_in(wqk_d, [r_w + SQ * 64, 0], bar, tiles.index(s * NT + 1), pred=pred)
    _copy_in(wqk_d, [r_w + SKD * 64, 0], bar, tiles.index(s * NT + 2), pred=pred)
    if CHAIN == 3:
        _copy_in(wqk_d, [r_w + 64, 0], bar, tiles.index(s * NT + 3), pred=pred)
        _copy_in(wqk_d, [r_w + SKD * 64 + 64, 0], bar, tiles.index(s * NT + 4), pred=pred)
    r_a = base * ((1 + A_LO) * 64)
    _copy_in(aqk_d, [r_a, 0], bar, a_s.index(s * (1 + A_LO)), pred=pred)
    if A_LO:
        _copy_in(aqk_d, [r_a + 64, 0], bar, a_s.index(s * (1 + A_LO) + 1), pred=pred)
    _copy_in(u_d, [base * V + i_v * BV, 0], bar, u_s.index(s), pred=pred)
    _copy_in(egl_d, [base, 0], bar, e_s.index(s), pred=pred)


@gluon.jit
def _parts(x, layout: gl.constexpr):
    """x's bf16 hi and lo parts (hi + lo within 2^-17 of x) as first operands of a warpgroup product."""
    hi = x.to(gl.bfloat16)
    lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
    return gl.convert_layout(hi, layout, assert_trivial=True), gl.convert_layout(lo, layout, assert_trivial=True)


@gluon.jit
def _state_offsets(slot, i_h, i_v, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                   layout: gl.constexpr):
    """Offsets of the slot's state block [K, i_v * BV + BV) as the transposed tile Z [BV, K] in ``layout``: an
    int64 base and int32 offsets within the block (an int64 tile takes twice the registers)."""
    o_m = gl.arange(0, BV, layout=gl.SliceLayout(1, layout))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    return (slot * H + i_h) * (K * V) + i_v * BV, o_k[None, :] * V + o_m[:, None]


@gluon.jit
def kda_state64_gluon_kernel(
    wqk_d, u_d, aqk_d, egl_d, o, state, cu_seqlens, chunk_offsets, state_slots, has_initial_state,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, CHAIN: gl.constexpr,
    NS: gl.constexpr, SQ: gl.constexpr, SKD: gl.constexpr, A_LO: gl.constexpr, STAGES: gl.constexpr,
):
    """Grid (V / BV, sequences * H), one warpgroup. The descriptors and the scratch layout are
    ``kda_state64_kernel``'s (kda_prefill_v3.py), plus ``egl_d`` over exp(gl) as [chunks * H, K] rows."""
    NT: gl.constexpr = 5 if CHAIN == 3 else 3
    # o^T and w S are [BV, 64]; the state Z is [BV, K]: two accumulator shapes, and their first operands
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    mma_z: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    a_z: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_z, k_width=2)

    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = gl.load(cu_seqlens + i_n).to(gl.int64)
    L = gl.load(cu_seqlens + i_n + 1).to(gl.int64) - bos
    c0 = gl.load(chunk_offsets + i_n)
    slot = gl.load(state_slots + i_n).to(gl.int64)
    has_init = gl.load(has_initial_state + i_n) != 0
    nt = ((L + 63) // 64).to(gl.int32)

    tiles = gl.allocate_shared_memory(gl.bfloat16, [STAGES * NT, 64, K], wqk_d.layout)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (1 + A_LO), 64, 64], aqk_d.layout)
    u_s = gl.allocate_shared_memory(gl.float32, [STAGES, BV, 64], u_d.layout)
    e_s = gl.allocate_shared_memory(gl.float32, [STAGES, 1, K], egl_d.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    for b in gl.static_range(STAGES):
        _issue_tiles(b, nt, c0, i_h, i_v, tiles, u_s, a_s, e_s, bars, wqk_d, u_d, aqk_d, egl_d,
                     H, V, BV, CHAIN, NS, SQ, SKD, A_LO, NT, STAGES)

    # the initial state, transposed (a fresh sequence ignores whatever its slot holds, NaN included)
    r_s, off_s = _state_offsets(slot, i_h, i_v, H, K, V, BV, mma_z)
    z = gl.where(has_init, gl.load(state + r_s + off_s), 0.0)
    # the output's offsets, formed in each step (a pointer tile held through the loop takes 64 registers)
    o_om = gl.arange(0, BV, layout=gl.SliceLayout(1, mma_o))
    o_on = gl.arange(0, 64, layout=gl.SliceLayout(0, mma_o))

    for t in range(0, nt):
        s = t % STAGES
        mbarrier.wait(bars.index(s), (t // STAGES) & 1)
        w_t = tiles.index(s * NT).permute((1, 0))
        q_t = tiles.index(s * NT + 1).permute((1, 0))
        kd = tiles.index(s * NT + 2)
        a_t = a_s.index(s * (1 + A_LO)).permute((1, 0))
        zh, zl = _parts(z, a_o)
        zero_o = gl.zeros([BV, 64], gl.float32, mma_o)  # made here: held through the loop it takes 32 registers
        # w S first (the chain waits for it), then the output's state part, left in flight
        ws = warpgroup_mma(zh, w_t, zero_o, use_acc=False, is_async=True)
        if CHAIN == 3:
            ws = warpgroup_mma(zh, tiles.index(s * NT + 3).permute((1, 0)), ws, is_async=True)
        if CHAIN >= 2:
            ws = warpgroup_mma(zl, w_t, ws, is_async=True)
        b_o = warpgroup_mma(zh, q_t, zero_o, use_acc=False, is_async=True)
        b_o = warpgroup_mma(zl, q_t, b_o, is_async=True)
        ws = warpgroup_mma_wait(num_outstanding=2, deps=(ws,))
        v = u_s.index(s).load(mma_o) - ws
        vh, vl = _parts(v, a_z)
        e = e_s.index(s).reshape([K]).load(gl.SliceLayout(0, mma_z))
        # the state update, then the output's in-chunk part behind it
        z = warpgroup_mma(vh, kd, z * e[None, :], is_async=True)
        if CHAIN == 3:
            z = warpgroup_mma(vh, tiles.index(s * NT + 4), z, is_async=True)
        if CHAIN >= 2:
            z = warpgroup_mma(vl, kd, z, is_async=True)
        vh_o = gl.convert_layout(vh, a_o, assert_trivial=True)
        vl_o = gl.convert_layout(vl, a_o, assert_trivial=True)
        b_o = warpgroup_mma(vh_o, a_t, b_o, is_async=True)
        if A_LO:
            b_o = warpgroup_mma(vh_o, a_s.index(s * (1 + A_LO) + 1).permute((1, 0)), b_o, is_async=True)
        if CHAIN >= 2:
            b_o = warpgroup_mma(vl_o, a_t, b_o, is_async=True)
        b_o, z, zh, zl, vh, vl, vh_o, vl_o = warpgroup_mma_wait(
            num_outstanding=0, deps=(b_o, z, zh, zl, vh, vl, vh_o, vl_o))
        # every product of this step is done: its buffer takes the tiles STAGES steps ahead
        _issue_tiles(t + STAGES, nt, c0, i_h, i_v, tiles, u_s, a_s, e_s, bars, wqk_d, u_d, aqk_d, egl_d,
                     H, V, BV, CHAIN, NS, SQ, SKD, A_LO, NT, STAGES)
        rows = t * 64 + o_on
        p_o = o + (bos + rows)[None, :] * (H * V) + (i_h * V + i_v * BV + o_om)[:, None]
        gl.store(p_o, b_o.to(o.dtype.element_ty), mask=(rows < L)[None, :])
    r_s, off_s = _state_offsets(slot, i_h, i_v, H, K, V, BV, mma_z)
    gl.store(state + r_s + off_s, z)
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))


def descriptors(wqk, u, aqk, egl, K: int, BV: int) -> tuple:
    """The copy engine's descriptors over v3's scratch (``v3_launches``: ``wqk`` [chunks, H, NS, 64, K] bf16, ``u``
    [chunks, H, V, 64] float32, ``aqk`` [chunks, H, 1 + A_LO, 64, 64] bf16, ``egl`` [chunks, H, K] float32), in
    the kernel's argument order."""
    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float32)
        return TensorDescriptor.from_tensor(t, block, layout)

    return (desc(wqk.view(-1, K), [64, K]), desc(u.view(-1, 64), [BV, 64]), desc(aqk.view(-1, 64), [64, 64]),
            desc(egl.view(-1, K), [1, K]))


def state_pass_gluon(wqk, u, aqk, egl, o, state, cu_t, offsets_t, slots_t, init_t, *, H: int, K: int, V: int,
                     BV: int, chain: int, slots: dict, a_lo: int, stages: int):
    """Launch the Gluon state pass over v3's scratch (``descriptors``)."""
    kda_state64_gluon_kernel[(V // BV, (cu_t.numel() - 1) * H)](
        *descriptors(wqk, u, aqk, egl, K, BV), o, state, cu_t, offsets_t, slots_t, init_t,
        H=H, K=K, V=V, BV=BV, CHAIN=chain, **slots, A_LO=a_lo, STAGES=stages, num_warps=4,
    )

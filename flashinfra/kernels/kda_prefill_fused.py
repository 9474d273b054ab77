"""KDA prefill (v3) on Hopper: kernel B's tiles formed inside the state pass, by a second warpgroup, in Gluon
(Triton's explicit-layout dialect).

The Triton state pass (``kda_state64_kernel``, kda_prefill_v3.py) is a chain of dependent products per 64-token
chunk; one warpgroup per (value block, sequence, head) waits on it most of each step, and the tiles it reads
(w, qg, kd with their lo halves, u^T: 112 KB per chunk and head) are written by kernel B and read back. Here each
program has two partitions (``gl.warp_specialize``) that share shared memory:

- the chain (the default partition, 4 warps): the state ``Z = S^T`` [BV, K] in float32 registers, per chunk
  ``v'^T = u^T - Z w^T``, ``o^T = Z qg^T + v'^T Aqk^T``, ``Z = exp(gl) Z + v'^T kd``, the products in the chain's
  bf16 parts as kda_prefill_v3.py;
- the tiles (a worker partition, 8 warps), a chunk ahead: from q, k, v, the gate pass's ``gc`` and ``bc``, kernel
  D's norm factors and kernel A's ``Ai`` and ``Aqk``, it forms kernel B's tiles (kda_prefill_intra64_b.py) in
  registers, ``w = Ai (beta k exp(gc))`` and ``u = Ai (beta v)`` as three bf16 products each on the tensor cores,
  and writes them to a ring of two stages (w's and kd's pairs, u^T, exp(gl)); qg and Aqk's pair, read by the
  chain's products around v', have one buffer, filled once the chain has finished the previous chunk.

Barriers (one arrival each): ``ready[s]`` / ``empty[s]`` for ring stage s, ``q_ready`` / ``q_empty`` for the
single buffer. Shared memory at K = 128, BV = 64 (bf16x3): the ring 2 x 80.5 KB, qg and Aqk 32 KB, the products'
staging 2 x 16 KB: 225 KB.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _split(x):
    """x's bf16 hi and lo parts, hi + lo within 2^-16 of x: hi is x truncated by a mask on its bits (no conversion
    instruction), lo the rest rounded to nearest (kda_prefill_v3.py, ``_parts``)."""
    bits = x.to(gl.uint32, bitcast=True)
    hi = (bits >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    return hi, (x - (bits & 0xFFFF0000).to(gl.float32, bitcast=True)).to(gl.bfloat16)


@gluon.jit
def _parts(x, layout: gl.constexpr):
    """The chain's split of Z or v', as first operands of a warpgroup product."""
    hi, lo = _split(x)
    return gl.convert_layout(hi, layout, assert_trivial=True), gl.convert_layout(lo, layout, assert_trivial=True)


@gluon.jit
def _product3(a_hi, a_lo, x_s, acc_layout: gl.constexpr, N: gl.constexpr, ASYNC: gl.constexpr = False):
    """``A X`` from A's bf16 parts (registers) and X's (``x_s`` 0 and 1): hi hi + hi lo + lo hi, float32 (with
    ASYNC issued only: ``warpgroup_mma_wait`` before its use)."""
    acc = warpgroup_mma(a_hi, x_s.index(0), gl.zeros([64, N], gl.float32, acc_layout), use_acc=False,
                        is_async=ASYNC)
    acc = warpgroup_mma(a_hi, x_s.index(1), acc, is_async=ASYNC)
    return warpgroup_mma(a_lo, x_s.index(0), acc, is_async=ASYNC)


@gluon.jit
def _stage(x_s, x):
    """x's bf16 parts into the products' staging buffers, visible to the tensor cores."""
    hi, lo = _split(x)
    x_s.index(0).store(hi)
    x_s.index(1).store(lo)
    fence_async_shared()


@gluon.jit
def _gate_tiles(gc, i_ch, o_r, o_c, hh: gl.constexpr, K: gl.constexpr):
    """The chunk's gate sums ``gc`` over key columns [64 hh, 64 hh + 64), and their last row (the chunk's total)."""
    cols = hh * 64 + o_c
    return (gl.load(gc + i_ch * (64 * K) + o_r[:, None] * K + cols[None, :]),
            gl.load(gc + i_ch * (64 * K) + 63 * K + cols))


@gluon.jit
def _row_tile(x, o_r, o_c, m, stride, col0):
    """Columns [col0, col0 + 64) of the chunk's rows of x (``x`` at the chunk's first row; zeros past the
    sequence's end), in x's dtype."""
    return gl.load(x + (o_r[:, None] * stride + (col0 + o_c)[None, :]), mask=m[:, None], other=0.0)


@gluon.jit
def _fresh(x):
    """x, as a value the compiler cannot move out of a loop: offsets formed from it are recomputed in each step
    (a few integer instructions) instead of being held across the loop, where they spill. Only for row indices:
    the compiler no longer knows the value's contiguity, which along a row would cost the vector loads."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _key_front(g_t, g_l, k_t, q_t, r_q, r_k, b, t_s, e_s, x_s, s, hh: gl.constexpr, CHAIN: gl.constexpr):
    """Key columns [64 hh, 64 hh + 64) of the chunk from their tiles: exp(gl) and kd = k exp(gl - gc) into ring
    stage s, ``beta k exp(gc)``'s parts into the products' staging buffers; returns qg's columns (bf16)."""
    SKD: gl.constexpr = CHAIN - 1  # ring slots: w (and its lo half), kd (and its lo half)
    NT: gl.constexpr = 2 * SKD
    e_t = gl.exp2(g_t * LOG2E)
    e_s.index(s).slice(hh * 64, 64).store(gl.exp2(g_l * LOG2E))
    k_t = k_t.to(gl.float32) * r_k[:, None]
    kd_h, kd_l = _split(k_t * gl.exp2((g_l[None, :] - g_t) * LOG2E))
    t_s.index(s * NT + SKD).slice(hh * 64, 64, dim=1).store(kd_h)
    if CHAIN == 3:
        t_s.index(s * NT + SKD + 1).slice(hh * 64, 64, dim=1).store(kd_l)
    _stage(x_s, k_t * b[:, None] * e_t)
    return (q_t.to(gl.float32) * r_q[:, None] * e_t).to(gl.bfloat16)


@gluon.jit
def _store_w(w, t_s, s, hh: gl.constexpr, CHAIN: gl.constexpr):
    """w's key columns [64 hh, 64 hh + 64) into ring stage s."""
    NT: gl.constexpr = 2 * (CHAIN - 1)
    w_h, w_l = _split(w)
    t_s.index(s * NT).slice(hh * 64, 64, dim=1).store(w_h)
    if CHAIN == 3:
        t_s.index(s * NT + 1).slice(hh * 64, 64, dim=1).store(w_l)


@gluon.jit
def _prefetch(p):
    """Ask the L2 for the 128-byte lines at the pointers ``p`` (no registers held, nothing waited for)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [p], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_chunk(q, k, v, gc, ai, aqk, bos, L, c0, t, i_h, i_v, stride_q, stride_k, stride_v,
                    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, A_LO: gl.constexpr,
                    TW: gl.constexpr):
    """Chunk t's inputs into the L2 (its rows clamped into the sequence): gc, Ai and Aqk whole, q's and k's
    rows and the program's value columns, a line per lane (a line twice where a tensor has fewer)."""
    lines: gl.constexpr = gl.BlockedLayout([1], [32], [TW], [0])
    o_l = gl.arange(0, 32 * TW, layout=lines)
    i_ch = ((c0 + t) * H + i_h).to(gl.int64)
    row = bos + gl.minimum(t * 64 + (o_l // 2) % 64, L - 1)
    for j in gl.static_range(K // (16 * TW)):
        _prefetch(gc + i_ch * (64 * K) + (j * 32 * TW + o_l) * 32)
    _prefetch(ai + i_ch * 4096 + (o_l % 128) * 32)
    _prefetch(aqk + i_ch * ((1 + A_LO) * 4096) + (o_l % (64 * (1 + A_LO))) * 64)
    _prefetch(k + row * stride_k + i_h * K + (o_l % 2) * 64)
    _prefetch(q + row * stride_q + i_h * K + (o_l % 2) * 64)
    _prefetch(v + row * stride_v + i_h * V + i_v * BV)


@gluon.jit
def _tiles_partition(q, k, v, gc, bc, rn, ai, aqk, t_s, q_s, u_s, a_s, e_s, x_s, y_s, ready, empty, q_ready,
                     q_empty, stride_q, stride_k, stride_v, bos, L, c0, nt, i_h, i_v,
                     H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     CHAIN: gl.constexpr, A_LO: gl.constexpr, PREFETCH: gl.constexpr, ROLE: gl.constexpr,
                     TW: gl.constexpr):
    """The worker partition: kernel B's tiles, a chunk ahead of the chain (module docstring). Each load is issued
    a block of work before its first use; w's products for one key half run while the next half forms."""
    # two warpgroups: each product's columns split between them, the tiles' rows
    mma_w: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, TW // 4],
                                                    instr_shape=[16, 256 // TW, 16])
    a_w: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_w, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [TW, 1], [1, 0])
    o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    a_r = gl.arange(0, 64, layout=gl.SliceLayout(1, a_w))
    a_c = gl.arange(0, 64, layout=gl.SliceLayout(0, a_w))
    if PREFETCH and nt > 0:  # a sequence without chunks touches nothing (its chunk index may lie past the scratch)
        _prefetch_chunk(q, k, v, gc, ai, aqk, bos, L, c0, 0, i_h, i_v, stride_q, stride_k, stride_v, H, K, V, BV,
                        A_LO, TW)
    for t in range(0, nt):
        s = t % 2
        if ROLE == 1:
            mbarrier.wait(empty.index(s), ((t // 2) & 1) ^ 1)
            mbarrier.wait(q_empty, (t & 1) ^ 1)
            mbarrier.arrive(q_ready, count=1)
            mbarrier.arrive(ready.index(s), count=1)
        else:
            if PREFETCH:
                _prefetch_chunk(q, k, v, gc, ai, aqk, bos, L, c0, gl.minimum(t + 1, nt - 1), i_h, i_v, stride_q,
                                stride_k, stride_v, H, K, V, BV, A_LO, TW)
            i_ch = ((c0 + t) * H + i_h).to(gl.int64)
            f_r, f_c = _fresh(o_r), o_c
            m = t * 64 + f_r < L
            t0 = bos + t * 64
            q_c = q + t0 * stride_q
            k_c = k + t0 * stride_k
            v_c = v + t0 * stride_v
            r_q = gl.load(rn + i_ch * 128 + f_r)
            r_k = gl.load(rn + i_ch * 128 + 64 + f_r)
            b = gl.load(bc + i_ch * 64 + f_r)
            # Ai's lower blocks (zeros above), as the products' first operand
            f_ar, f_ac = _fresh(a_r), a_c
            b_ai = gl.load(ai + i_ch * 4096 + f_ar[:, None] * 64 + f_ac[None, :],
                           mask=(f_ac[None, :] // 16) <= (f_ar[:, None] // 16), other=0.0)
            g_t, g_l = _gate_tiles(gc, i_ch, f_r, f_c, 0, K)
            k_t = _row_tile(k_c, f_r, f_c, m, stride_k, i_h * K)
            q_t = _row_tile(q_c, f_r, f_c, m, stride_q, i_h * K)
            ai_h, ai_l = _split(b_ai)
            mbarrier.wait(empty.index(s), ((t // 2) & 1) ^ 1)
            # w = Ai (beta k exp(gc)) per key half, its products issued and left running while the next half's
            # tiles load and form; each load issued a block of work before its use
            qg0 = _key_front(g_t, g_l, k_t, q_t, r_q, r_k, b, t_s, e_s, x_s, s, 0, CHAIN)
            w = _product3(ai_h, ai_l, x_s, mma_w, 64, True)
            g_t, g_l = _gate_tiles(gc, i_ch, f_r, f_c, 1, K)
            k_t = _row_tile(k_c, f_r, f_c, m, stride_k, i_h * K + 64)
            q_t = _row_tile(q_c, f_r, f_c, m, stride_q, i_h * K + 64)
            qg1 = _key_front(g_t, g_l, k_t, q_t, r_q, r_k, b, t_s, e_s, y_s, s, 1, CHAIN)
            b_v = _row_tile(v_c, f_r, f_c, m, stride_v, i_h * V + i_v * BV)
            w = warpgroup_mma_wait(num_outstanding=0, deps=(w,))
            _store_w(w, t_s, s, 0, CHAIN)
            w = _product3(ai_h, ai_l, y_s, mma_w, 64, True)
            # u = Ai (beta v) for this program's value columns, stored transposed
            _stage(x_s, b_v.to(gl.float32) * b[:, None])
            w = warpgroup_mma_wait(num_outstanding=0, deps=(w,))
            _store_w(w, t_s, s, 1, CHAIN)
            u_s.index(s).store(gl.permute(_product3(ai_h, ai_l, x_s, mma_w, BV), (1, 0)))
            fence_async_shared()
            mbarrier.arrive(ready.index(s), count=1)
            # qg and Aqk last, into their one buffer, free once the chain has finished the previous chunk
            b_a = gl.load(aqk + i_ch * ((1 + A_LO) * 4096) + f_r[:, None] * 64 + f_c[None, :])
            if A_LO:
                b_al = gl.load(aqk + i_ch * ((1 + A_LO) * 4096) + 4096 + f_r[:, None] * 64 + f_c[None, :])
            mbarrier.wait(q_empty, (t & 1) ^ 1)
            q_s.slice(0, 64, dim=1).store(qg0)
            q_s.slice(64, 64, dim=1).store(qg1)
            a_s.index(0).store(b_a)
            if A_LO:
                a_s.index(1).store(b_al)
            fence_async_shared()
            mbarrier.arrive(q_ready, count=1)


@gluon.jit
def _chain_partition(z, t_s, q_s, u_s, a_s, e_s, ready, empty, q_ready, q_empty, o, bos, L, nt, i_h, i_v,
                     H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     CHAIN: gl.constexpr, A_LO: gl.constexpr, ROLE: gl.constexpr):
    """The default partition: the state's chain over the chunks (module docstring); returns the final Z."""
    SKD: gl.constexpr = CHAIN - 1  # ring slots: w (and its lo half), kd (and its lo half)
    NT: gl.constexpr = 2 * SKD
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    mma_z: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    a_z: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_z, k_width=2)
    o_om = gl.arange(0, BV, layout=gl.SliceLayout(1, mma_o))
    o_on = gl.arange(0, 64, layout=gl.SliceLayout(0, mma_o))
    for t in range(0, nt):
        s = t % 2
        mbarrier.wait(ready.index(s), (t // 2) & 1)
        if ROLE == 2:
            mbarrier.wait(q_ready, t & 1)
            mbarrier.arrive(q_empty, count=1)
            mbarrier.arrive(empty.index(s), count=1)
        else:
            mbarrier.wait(q_ready, t & 1)
            w_t = t_s.index(s * NT).permute((1, 0))
            q_t = q_s.permute((1, 0))
            kd = t_s.index(s * NT + SKD)
            zh, zl = _parts(z, a_o)
            # the decay now, while the step's first products run: Z itself is not read again this step
            z = z * e_s.index(s).load(gl.SliceLayout(0, mma_z))[None, :]
            zero_o = gl.zeros([BV, 64], gl.float32, mma_o)
            # w S first (the chain waits for it), then the output's state part, left in flight
            ws = warpgroup_mma(zh, w_t, zero_o, use_acc=False, is_async=True)
            if CHAIN == 3:
                ws = warpgroup_mma(zh, t_s.index(s * NT + 1).permute((1, 0)), ws, is_async=True)
            ws = warpgroup_mma(zl, w_t, ws, is_async=True)
            b_o = warpgroup_mma(zh, q_t, zero_o, use_acc=False, is_async=True)
            b_o = warpgroup_mma(zl, q_t, b_o, is_async=True)
            ws = warpgroup_mma_wait(num_outstanding=2, deps=(ws,))
            vn = u_s.index(s).load(mma_o) - ws
            vh, vl = _parts(vn, a_z)
            z = warpgroup_mma(vh, kd, z, is_async=True)
            if CHAIN == 3:
                z = warpgroup_mma(vh, t_s.index(s * NT + SKD + 1), z, is_async=True)
            z = warpgroup_mma(vl, kd, z, is_async=True)
            vh_o = gl.convert_layout(vh, a_o, assert_trivial=True)
            vl_o = gl.convert_layout(vl, a_o, assert_trivial=True)
            a_t = a_s.index(0).permute((1, 0))
            b_o = warpgroup_mma(vh_o, a_t, b_o, is_async=True)
            if A_LO:
                b_o = warpgroup_mma(vh_o, a_s.index(1).permute((1, 0)), b_o, is_async=True)
            b_o = warpgroup_mma(vl_o, a_t, b_o, is_async=True)
            b_o, z, zh, zl, vh, vl, vh_o, vl_o = warpgroup_mma_wait(
                num_outstanding=0, deps=(b_o, z, zh, zl, vh, vl, vh_o, vl_o))
            mbarrier.arrive(empty.index(s), count=1)
            mbarrier.arrive(q_empty, count=1)
            rows = t * 64 + o_on
            p_o = o + (bos + rows)[None, :] * (H * V) + (i_h * V + i_v * BV + o_om)[:, None]
            gl.store(p_o, b_o.to(o.dtype.element_ty), mask=(rows < L)[None, :])
    return (z,)


@gluon.jit
def _state_ptrs(state, slot, i_h, i_v, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                layout: gl.constexpr):
    """The slot's state block [K, i_v * BV + BV) as the transposed tile Z [BV, K] in ``layout``."""
    o_m = gl.arange(0, BV, layout=gl.SliceLayout(1, layout))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    return state + ((slot * H + i_h) * (K * V) + i_v * BV) + o_k[None, :] * V + o_m[:, None]


@gluon.jit
def kda_state_tiles_kernel(
    q, k, v, gc, bc, rn, ai, aqk, o, state, cu_seqlens, chunk_offsets, state_slots, has_initial_state,
    stride_q, stride_k, stride_v,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, CHAIN: gl.constexpr,
    A_LO: gl.constexpr, TILE_REGS: gl.constexpr, PREFETCH: gl.constexpr, ROLE: gl.constexpr = 0,
    TILE_WARPS: gl.constexpr = 8,
):
    """Grid (V / BV, sequences * H), 4 warps plus the tiles' 4 (``TILE_REGS`` registers each). The scratch is
    v3's (kda_prefill_v3.py, ``v3_launches``) without kernel B's: ``gc`` [chunks, H, 64, K] and ``bc``
    [chunks, H, 64] (the gate pass), ``rn`` [chunks, H, 2, 64] (kernel D), ``ai`` [chunks, H, 64, 64] float32
    and ``aqk`` [chunks, H, 1 + A_LO, 64, 64] bf16 (kernels D and A). CHAIN 3 (bf16x3) or 2 (bf16x2); K = 128,
    BV = 64."""
    mma_z: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, K], gl.bfloat16)
    half: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = gl.load(cu_seqlens + i_n).to(gl.int64)
    L = gl.load(cu_seqlens + i_n + 1).to(gl.int64) - bos
    c0 = gl.load(chunk_offsets + i_n)
    slot = gl.load(state_slots + i_n).to(gl.int64)
    has_init = gl.load(has_initial_state + i_n) != 0
    nt = ((L + 63) // 64).to(gl.int32)

    t_s = gl.allocate_shared_memory(gl.bfloat16, [4 * (CHAIN - 1), 64, K], tile)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [64, K], tile)
    u_s = gl.allocate_shared_memory(gl.float32, [2, BV, 64], plain)
    a_s = gl.allocate_shared_memory(gl.bfloat16, [1 + A_LO, 64, 64], half)
    e_s = gl.allocate_shared_memory(gl.float32, [2, K], flat)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], half)
    y_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], half)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(empty.index(b), count=1)
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=1)

    # the initial state, transposed (a fresh sequence ignores whatever its slot holds, NaN included)
    z = gl.where(has_init, gl.load(_state_ptrs(state, slot, i_h, i_v, H, K, V, BV, mma_z)).to(gl.float32), 0.0)
    z = gl.warp_specialize([
        (_chain_partition, (z, t_s, q_s, u_s, a_s, e_s, ready, empty, q_ready, q_empty, o, bos, L, nt, i_h,
                            i_v, H, K, V, BV, CHAIN, A_LO, ROLE)),
        (_tiles_partition, (q, k, v, gc, bc, rn, ai, aqk, t_s, q_s, u_s, a_s, e_s, x_s, y_s, ready, empty, q_ready,
                            q_empty, stride_q, stride_k, stride_v, bos, L, c0, nt, i_h, i_v, H, K, V, BV,
                            CHAIN, A_LO, PREFETCH, ROLE, TILE_WARPS)),
    ], [TILE_WARPS], [TILE_REGS])[0]
    gl.store(_state_ptrs(state, slot, i_h, i_v, H, K, V, BV, mma_z), z.to(state.dtype.element_ty))

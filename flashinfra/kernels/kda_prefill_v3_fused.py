"""KDA prefill (v3), the state pass with the per-chunk tiles computed in it (``tiles="state"`` in
kda_prefill_v3.py): one sequential pass per (value block, sequence, head) that reads the inputs and the
in-chunk matrices ``Aqk`` and ``(I + L)^-1`` (from the split form's two kernels) and carries the state.

``kda_intra64_b_kernel`` writes per chunk and head 80 KB of bf16 pairs (w, qw, kd) and 64 KB of float32
(u, ou), which ``kda_state64_kernel`` reads back; here each chunk's tiles are formed in registers from
q, k, g, beta, v and the two [64, 64] matrices (about 100 KB per 64-token step at BV=64, against B's 100 KB
read and 144 KB written plus the state pass's 112 KB read), with the same products in ``LOCAL_PRECISION``
as kernel B:

    gc = cumsum(g), w = Ai (beta k exp(gc)), kd = k exp(gl - gc), qw = q exp(gc) - Aqk w,
    u = Ai (beta v), ou = Aqk u,

then as ``kda_state64_kernel``: ``v' = u - w S``, ``o = ou + qw S``, ``S = exp(gl) S + kd^T v'``, the
products that carry S in the chain precision (w, kd, S and v' split into bf16 hi + lo in registers for
bf16x3; w and kd one bf16 each for bf16x2), the output product with qw's hi part (and its lo part with
``OUT_X3``). The K-side work (w, kd, qw) is repeated by each of the ``V / BV`` value blocks of a head.
kd's bf16 parts wait for the state update in a per-program scratch (16 or 32 KB, rewritten every chunk, so it
stays in L1/L2): held in registers through the output products they spill, formed again they cost about a
fifth of the loop's instructions.

Same semantics as the other v3 forms: varlen via ``cu_seqlens``, state slots read (or ignored, NaN
included, for a fresh sequence) and written, the gate with its lower bound and beta's sigmoid computed
from the raw projections (``load_gate_beta`` with v3's per-token log-decay bound of -10).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra import env
from flashinfra.kernels.kda_gate import kda_log_decay


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a b`` with bf16 operands; DOT_F32 (Triton's CPU interpreter, whose bf16 dot is wrong) widens
    them to float32 first."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _exp(x, INTERP: tl.constexpr):
    """exp(x), x <= 0 here, as one ``ex2.approx.ftz`` (tl.exp's non-ftz form adds a range check and two
    scalings around it: about 3 instructions per element); results below 2^-126 flush to zero, far below
    anything they multiply. The interpreter has no inline assembly."""
    if INTERP:
        return tl.exp(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _prefetch(x, rows, stride_t, m_t, D: tl.constexpr, INTERP: tl.constexpr):
    """Ask the L2 for rows ``rows`` (int64) of a [T, H * D] input from x (the head's first column), one request
    per 128-byte line, rows where m_t is false left out; no registers are held for the data."""
    if not INTERP:
        E: tl.constexpr = 128 * 8 // x.dtype.element_ty.primitive_bitwidth  # elements per line
        NL: tl.constexpr = (D + E - 1) // E
        p = x + rows[:, None] * stride_t + (tl.arange(0, NL) * E)[None, :]
        tl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l,b",
                                  [p, m_t[:, None] & (tl.arange(0, NL) >= 0)[None, :]], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _rows2(a, b):
    """[a; b]: two [64, N] tiles stacked into one [128, N] (one 128-row product instead of two of 64)."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (128, a.shape[1]))


@triton.jit
def _split(x, LO: tl.constexpr):
    """x as bf16 hi and (with LO) lo parts, hi + lo within 2^-17 of x; without LO, lo is hi (unused)."""
    hi = x.to(tl.bfloat16)
    if LO:
        return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, hi


@triton.jit
def _tile(x, rows, stride_t, col, o_c, m_t, CM: tl.constexpr):
    """Rows ``rows`` (int64, absolute) and columns ``col + o_c`` of a [T, H * D] input, float32, zero past
    the sequence's end. ``rows`` changes every chunk, so no tensor of offsets stays live across the loop."""
    p = x + rows[:, None] * stride_t + col + o_c[None, :]
    return tl.load(p, mask=m_t[:, None], other=0.0, cache_modifier=CM).to(tl.float32)


@triton.jit
def _gate(g, dt_bias, rate, lower_bound, rows, stride_g_t, col, o_c, m_t, CM: tl.constexpr,
          GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """A K half of the log-decay as ``load_gate_beta`` forms it (v3's per-token bound of -10), and its
    cumulative sum over the chunk and total."""
    b_g = _tile(g, rows, stride_g_t, col, o_c, m_t, CM)
    if GATE_IN_KERNEL:
        b_g = kda_log_decay(b_g + tl.load(dt_bias + col + o_c).to(tl.float32)[None, :], rate, lower_bound,
                            HAS_LOWER_BOUND)
    b_g = tl.maximum(b_g, -10.0)
    if GATE_IN_KERNEL:  # the gate of a masked (zero) row is not zero; a given g is
        b_g = tl.where(m_t[:, None], b_g, 0.0)
    return tl.cumsum(b_g, 0), tl.sum(b_g, 0)


@triton.jit
def _half_out(q, k, g, dt_bias, rate, lower_bound, rows, stride_q_t, stride_k_t, stride_g_t, col, o_c, m_t, r_q, r_k,
              b_b, ai_s, aqk_s, b_s, b_ws, b_o, p_kd, LP: tl.constexpr, CHAIN: tl.constexpr, OUT_X3: tl.constexpr,
              GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, DOT_F32: tl.constexpr):
    """One K half of ``w = Ai (beta k exp(gc))`` and ``qw = q exp(gc) - Aqk w`` (each column of them depends on
    its own columns of q, k and g only), and its share of ``w S`` (in the chain precision) and ``qw S``;
    ``kd = k exp(gl - gc)``'s bf16 parts go to the program's scratch at p_kd (hi, then lo for bf16x3) for
    the state update. Returns ``exp(gl)`` too."""
    b_gc, b_gl = _gate(g, dt_bias, rate, lower_bound, rows, stride_g_t, col, o_c, m_t, "", GATE_IN_KERNEL,
                       HAS_LOWER_BOUND)
    b_k = _tile(k, rows, stride_k_t, col, o_c, m_t, "") * r_k[:, None]
    b_kdh, b_kdl = _split(b_k * _exp(b_gl[None, :] - b_gc, DOT_F32), CHAIN == 3)
    KH: tl.constexpr = o_c.shape[0]
    off = tl.arange(0, 64)[:, None] * KH + o_c[None, :]
    tl.store(p_kd + off, b_kdh)
    if CHAIN == 3:
        tl.store(p_kd + 64 * KH + off, b_kdl)
    b_eg = _exp(b_gc, DOT_F32)
    b_w = tl.dot(ai_s, b_k * b_b[:, None] * b_eg, input_precision=LP)
    # -qw accumulated on -q exp(gc): one [64, K / 2] tile live instead of two
    b_qw = tl.dot(aqk_s, b_w, -(_tile(q, rows, stride_q_t, col, o_c, m_t, "") * r_q[:, None] * b_eg),
                  input_precision=LP)
    b_qh, b_ql = _split(-b_qw, OUT_X3)
    b_wh, b_wl = _split(b_w, CHAIN == 3)
    b_sh = b_s.to(tl.bfloat16)
    b_sl = (b_s - b_sh.to(tl.float32)).to(tl.bfloat16)
    # w S and qw S as 128-row products on [w; qw] where both take the same part of S: each product waits for
    # the tensor cores before the next, so fewer and larger ones shorten the step
    b_wq = _rows2(b_wh, b_qh)
    b_acc = _mma(b_wq, b_sh, _rows2(b_ws, b_o), DOT_F32)
    if CHAIN >= 2:
        b_acc = _mma(b_wq, b_sl, b_acc, DOT_F32)
    if CHAIN == 3 and OUT_X3:
        b_acc = _mma(_rows2(b_wl, b_ql), b_sh, b_acc, DOT_F32)
    b_ws, b_o = tl.split(tl.permute(tl.reshape(b_acc, (2, 64, b_ws.shape[1])), (1, 2, 0)))
    if CHAIN == 1:
        b_o = _mma(b_qh, b_sl, b_o, DOT_F32)
    if CHAIN == 3 and not OUT_X3:
        b_ws = _mma(b_wl, b_sh, b_ws, DOT_F32)
    if OUT_X3 and CHAIN != 3:
        b_o = _mma(b_ql, b_sh, b_o, DOT_F32)
    return b_ws, b_o, tl.exp(b_gl)


@triton.jit
def _half_state(p_kd, o_c, b_egl, b_s, b_vh, b_vl, CHAIN: tl.constexpr, DOT_F32: tl.constexpr):
    """One K half of ``S = exp(gl) S + kd^T v'``, kd^T read back from the scratch (written by _half_out;
    held in registers through the output products instead, its parts spill)."""
    KH: tl.constexpr = o_c.shape[0]
    o_2 = tl.arange(0, 128)
    b_s = b_s * b_egl[:, None]
    if CHAIN == 3:
        # [kd_hi^T, kd_lo^T] [v'_hi; v'_hi] (the scratch holds hi then lo: 128 rows) + kd_hi^T v'_lo
        b_s = _mma(tl.load(p_kd + o_2[None, :] * KH + o_c[:, None]), _rows2(b_vh, b_vh), b_s, DOT_F32)
        b_s = _mma(tl.load(p_kd + tl.arange(0, 64)[None, :] * KH + o_c[:, None]), b_vl, b_s, DOT_F32)
    elif CHAIN == 2:
        # [kd^T, kd^T] [v'_hi; v'_lo]
        b_s = _mma(tl.load(p_kd + (o_2 % 64)[None, :] * KH + o_c[:, None]), _rows2(b_vh, b_vl), b_s, DOT_F32)
    else:
        b_s = _mma(tl.load(p_kd + tl.arange(0, 64)[None, :] * KH + o_c[:, None]), b_vh, b_s, DOT_F32)
    return b_s


@triton.jit
def kda_state64_fused_kernel(
    q, k, v, g, beta, A_log, dt_bias, lower_bound, o, aqk, ai, state, kd_buf,
    cu_seqlens, chunk_offsets, state_slots, has_initial_state,
    stride_q_t, stride_k_t, stride_v_t, stride_g_t, stride_b_t, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, CHAIN: tl.constexpr,
    OUT_X3: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
    BETA_LOGITS: tl.constexpr, LOCAL_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid (V / BV, sequences * H). ``aqk`` and ``ai`` are [chunks, H, 64, 64] float32 with zeros above the
    diagonal blocks (the off-diagonal kernel's ``ZERO_UPPER``: a masked copy would be a register operand of
    the products instead of a shared-memory one), ``state`` [slots, H, K, V]; q, k, v, g, beta are read
    with masks (rows past the sequence end are zeros). No tensor descriptors: one pipeline stage, and the
    copy engine's single-stage loads once faulted in the other state pass (kda_prefill_v3.py).
    The state and the K-side tiles are held as two K halves (two tensors each), so that no [64, K] float32
    tile is live (at 4 warps one is 64 registers per thread), in this order per chunk: the rows' norms,
    per half kd (to ``kd_buf``), w and qw and their products with S, then u, ou and v', then per half the
    new S with kd read back."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    c0 = tl.load(chunk_offsets + i_n)
    slot = tl.load(state_slots + i_n)
    has_init = tl.load(has_initial_state + i_n) != 0
    LP: tl.constexpr = LOCAL_PRECISION
    KH: tl.constexpr = K // 2
    o_t = tl.arange(0, 64)
    o_c = tl.arange(0, KH)
    o_k = tl.arange(0, K)
    rate = tl.exp(tl.load(A_log + i_h).to(tl.float32)) if GATE_IN_KERNEL else 1.0
    dt_bias += i_h * K
    q += i_h * K
    k += i_h * K
    g += i_h * K
    v += i_h * V + i_v * BV
    o += i_h * V + i_v * BV
    beta += i_h
    # this program's scratch for kd's bf16 parts: [2 halves, 1 or 2 parts, 64, K / 2]
    NP: tl.constexpr = 2 if CHAIN == 3 else 1
    kd_buf += (i_nh * tl.num_programs(0) + i_v).to(tl.int64) * (2 * NP * 64 * KH)
    # A fresh sequence ignores whatever its slot holds (NaN included).
    r_s = (slot * H + i_h) * K
    p_s = state + (r_s + o_c).to(tl.int64)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
    b_s0 = tl.where(has_init, tl.load(p_s), 0.0)
    b_s1 = tl.where(has_init, tl.load(p_s + KH * V), 0.0)
    for i_t in range(0, tl.cdiv(L, 64)):
        rows = (bos + i_t * 64 + o_t).to(tl.int64)
        m_t = o_t < L - i_t * 64
        if PREFETCH:
            # the next chunk's rows to the L2 now: the loop has one stage, and its first loads would wait on
            # memory (rows clamped into the sequence and chunks into its own, so that every address is valid)
            r_n = tl.minimum(rows + 64, bos + L - 1)
            m_n = o_t < L - i_t * 64 - 64
            _prefetch(k, r_n, stride_k_t, m_n, K, DOT_F32)
            _prefetch(q, r_n, stride_q_t, m_n, K, DOT_F32)
            _prefetch(g, r_n, stride_g_t, m_n, K, DOT_F32)
            _prefetch(v, r_n, stride_v_t, m_n, BV, DOT_F32)
            r_p = (((c0 + tl.minimum(i_t + 1, tl.cdiv(L, 64) - 1)) * H + i_h) * 64 + o_t).to(tl.int64)
            _prefetch(ai, r_p, 64, m_n, 64, DOT_F32)
            _prefetch(aqk, r_p, 64, m_n, 64, DOT_F32)
        b_x = _tile(k, rows, stride_k_t, 0, o_k, m_t, "")
        r_k = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)
        b_x = _tile(q, rows, stride_q_t, 0, o_k, m_t, "")
        r_q = scale / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)
        b_b = tl.load(beta + rows * stride_b_t, mask=m_t, other=0.0).to(tl.float32)
        if BETA_LOGITS:
            b_b = tl.sigmoid(b_b)
        b_b = tl.where(m_t, b_b, 0.0)
        # rows of the [chunks * H * 64, 64] matrices, formed per chunk (a loop-invariant tensor of offsets
        # would be held through the loop)
        r_a = (((c0 + i_t) * H + i_h) * 64 + o_t).to(tl.int64)[:, None] * 64 + o_t[None, :]
        ai_s = tl.load(ai + r_a)
        aqk_s = tl.load(aqk + r_a)
        # o = qg S + Aqk v' with v' = u - w S, folded: qw = q exp(gc) - Aqk w, o = qw S + ou, ou = Aqk u
        b_ws = tl.zeros([64, BV], dtype=tl.float32)
        b_o = tl.zeros([64, BV], dtype=tl.float32)
        tl.debug_barrier()  # the previous chunk's kd has been read by every thread
        b_ws, b_o, egl0 = _half_out(q, k, g, dt_bias, rate, lower_bound, rows, stride_q_t, stride_k_t, stride_g_t, 0,
                                    o_c, m_t, r_q, r_k, b_b, ai_s, aqk_s, b_s0, b_ws, b_o, kd_buf, LP, CHAIN, OUT_X3,
                                    GATE_IN_KERNEL, HAS_LOWER_BOUND, DOT_F32)
        b_ws, b_o, egl1 = _half_out(q, k, g, dt_bias, rate, lower_bound, rows, stride_q_t, stride_k_t, stride_g_t, KH,
                                    o_c, m_t, r_q, r_k, b_b, ai_s, aqk_s, b_s1, b_ws, b_o, kd_buf + NP * 64 * KH, LP,
                                    CHAIN, OUT_X3, GATE_IN_KERNEL, HAS_LOWER_BOUND, DOT_F32)
        b_u = tl.dot(ai_s, _tile(v, rows, stride_v_t, 0, tl.arange(0, BV), m_t, "") * b_b[:, None],
                     input_precision=LP)
        b_o = tl.dot(aqk_s, b_u, b_o, input_precision=LP)
        tl.store(o + rows[:, None] * (H * V) + tl.arange(0, BV)[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None])
        b_vn = b_u - b_ws
        b_vh = b_vn.to(tl.bfloat16)
        b_vl = (b_vn - b_vh.to(tl.float32)).to(tl.bfloat16)
        tl.debug_barrier()  # kd's parts written by other threads
        b_s0 = _half_state(kd_buf, o_c, egl0, b_s0, b_vh, b_vl, CHAIN, DOT_F32)
        b_s1 = _half_state(kd_buf + NP * 64 * KH, o_c, egl1, b_s1, b_vh, b_vl, CHAIN, DOT_F32)
    p_s = state + (r_s + o_c).to(tl.int64)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
    tl.store(p_s, b_s0)
    tl.store(p_s + KH * V, b_s1)


def fused_state_launch(q, k, v, g, beta, gate_args: dict, A_log, dt_bias, lower_bound: float, o, state, aqk, ai,
                       cu_t, offsets_t, slots_t, init_t, num_seqs: int, *, BV: int, chain: int, out_x3: bool,
                       local_precision: str, num_warps: int, num_stages: int, prefetch: bool = True):
    """The fused state pass as a closure (the benchmark times it on its own), over ``aqk`` and ``ai``
    [chunks, H, 64, 64] float32 as the split form's kernels leave them; ``gate_args`` are the
    GATE_IN_KERNEL, HAS_LOWER_BOUND and BETA_LOGITS flags; ``chain`` is 3 (bf16x3), 2 (bf16x2) or 1;
    ``prefetch``: the next chunk's inputs requested into the L2 at the start of each step."""
    T, H, K = q.shape
    V = v.shape[-1]
    if K < 32:
        raise ValueError(f"kda_prefill v3: tiles='state' needs K >= 32 (two K halves of 16 or more), got K={K}")
    grid = (triton.cdiv(V, BV), num_seqs * H)
    kd_buf = torch.empty(grid[0] * grid[1], 64 * K * (2 if chain == 3 else 1), dtype=torch.bfloat16, device=q.device)
    def launch():
        kda_state64_fused_kernel[grid](
            q, k, v, g, beta, A_log, dt_bias, lower_bound, o, aqk, ai, state, kd_buf, cu_t, offsets_t, slots_t, init_t,
            q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), K**-0.5,
            H=H, K=K, V=V, BV=BV, CHAIN=chain, OUT_X3=out_x3, LOCAL_PRECISION=local_precision,
            DOT_F32=env.triton_interpret(), PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
            **gate_args,
        )

    return launch

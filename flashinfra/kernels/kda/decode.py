"""The whole decode step of one KDA layer between its input and output projections, fused.

Per sequence (one new token) and head: the causal conv update with SiLU over the head's q, k and v
channels (the conv slot read and shifted in place), the forget gate with its lower bound, beta, the q/k
L2 norm, the delta-rule step on the recurrent state (read from and written back to its slot in place)
and the gated RMSNorm of the output. The unfused path runs ``causal_conv1d_decode``, ``kda_gate``,
``sigmoid``, ``kda_decode`` and the gated norm as separate ops, each reading and writing memory; here
the only traffic is the inputs, the output (written, read back for the norm, written again) and the two
slots.

Kernel layouts, chosen per batch size and state dtype by ``decode_config`` (measured on an H200 in
bench/notes/kda_decode.md):
- ``"block"``: one program per (sequence, head, block of ``BV`` value columns), so many state loads are in
  flight at once, then a second small launch per (sequence, head) for the gated RMSNorm (it needs the
  head's whole output) and the q/k conv shift (every V block of the head reads those channels first).
  Stream order between the launches replaces any synchronisation between programs.
- ``"prep"``: the block layout with the head's q/k conv, L2 norms, gate and beta computed once per
  (sequence, head) by a first small launch (which also shifts the q/k conv slot) into a float32 scratch, so
  the state programs do only the recurrence and the v conv; three launches.
- ``"stream"``, ``"tiles"`` (state kernels in ``kda_layer_decode_stream.py``): the prep launch also computes
  the v conv and shifts the whole conv slot, so the state kernel reads only the scratch and its state tiles:
  persistent programs with the state through a tensor descriptor in a pipelined loop, or one program per
  tile. The norm launch follows (both apply the norm themselves when a tile is a whole head row: two
  launches).

Layouts measured slower at every size and removed (bench/notes/kda_decode.md): one program per head walking
its state, persistent programs prefetching the next tile into registers, the head work inside the state
launch, two tiles per program, one program per head holding its state as two column halves with the norm.

Options: the prep and norm launches with several heads of a sequence per program (``prep_heads`` /
``norm_heads``, ``kda_layer_decode_prep.py``; layouts with a prep launch), and the block layout's norm launch as a
programmatic dependent of its state launch (``pdl``), so that its start-up overlaps the state launch's end;
and the batch in micro-batches on two streams (``micro_batches``, microbatch.py), so that one half's prep and norm
launches run beside the other half's state launch.

The reference ``kda_layer_decode_ref`` is that unfused composition; the kernels round where it rounds
(conv output and recurrence output to the activation dtype) so both agree to that dtype's precision.
The recurrent state may be float32 or bfloat16 (half the bytes; rounded once per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from flashinfra.kernels.kda.conv import causal_conv1d_decode_ref
from flashinfra.kernels.dispatch import register_cap, use_triton
from flashinfra.kernels.kda.decode_recurrence import (blocks_inside, check_block_options, check_dot_sums, dot_sums_fit,
                                           kda_decode_ref)
from flashinfra.kernels.kda.gate import kda_gate_ref
from flashinfra.kernels.kda.common import (conv_shift, conv_shift_load, conv_shift_store, conv_silu,
                                                       conv_slot, gated_norm, head_inputs, load_state, state_step,
                                                       state_tile, store_state)
from flashinfra.kernels.kda.decode_prep import check_heads, norm_heads_launch, prep_heads_launch
from flashinfra.kernels.kda.decode_stream import check_stream_layout, stream_state_launch
from flashinfra.kernels.microbatch import micro_ranges, on_two_streams
from flashinfra.kernels.norms import gated_rms_norm_ref


def kda_layer_decode_ref(
    qkv: torch.Tensor,  # [B, H*K + H*K + H*V] q|k|v before the conv, one token per sequence
    conv_weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    g_raw: torch.Tensor,  # [B, H*K] f_b(f_a(x)) before the bias
    beta_logits: torch.Tensor,  # [B, H]
    gate: torch.Tensor,  # [B, H*V] output gate, before its sigmoid
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H*K]
    lower_bound: float | None,
    norm_weight: torch.Tensor,  # [V]
    eps: float,
    state: torch.Tensor,  # [num_slots, H, K, V], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, H, V] in qkv's dtype
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    y = causal_conv1d_decode_ref(qkv, conv_weight, conv_state, state_slots)
    q, k, v = y[:, : H * K].view(B, H, K), y[:, H * K : 2 * H * K].view(B, H, K), y[:, 2 * H * K :].view(B, H, V)
    g = kda_gate_ref(g_raw.view(B, H, K), A_log, dt_bias, lower_bound)
    o = kda_decode_ref(q, k, v, g, torch.sigmoid(beta_logits.float()), state, state_slots)
    return gated_rms_norm_ref(o, gate.view(B, H, V), norm_weight, eps)


@triton.jit
def kda_layer_decode_block_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, state_slots, out, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, PREPPED: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    """Grid (cdiv(V, BV), B * H): the recurrence of one [K, BV] state block, its unnormalised output
    (rounded to out's dtype) and the shift of its own v channels' conv slot (no other program reads
    them). The head's q, k, decay and beta are either recomputed by each V block (q/k conv and gate, a
    few KB from L2) or, with ``PREPPED``, read from ``heads`` as the prep kernel wrote them. EVEN (BK == K
    and BV divides V): every block inside the state, no masks."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, (o_v < V) | EVEN  # a constant mask, folded away, where EVEN
    p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
    b_s = load_state(p_s, m_s, not EVEN).to(tl.float32)  # issued first: the big load
    x_row = qkv + i_b * stride_x
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    if PREPPED:
        p_h = heads + i_bh * 4 * BK + o_k
        b_q, b_k, b_decay = tl.load(p_h), tl.load(p_h + BK), tl.load(p_h + 2 * BK)
        b_beta = tl.load(heads + i_bh * 4 * BK + 3 * BK)
    else:
        b_q, b_k, b_decay, b_beta = head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                                beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k,
                                                scale, H, K, W, BW, HAS_LOWER_BOUND)
    b_v = conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W)
    b_shift = conv_shift_load(x_row, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W, BW)
    b_s, b_o = state_step(b_s, b_q, b_k, b_decay, b_beta, b_v)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    store_state(p_s, b_s, m_s, not EVEN)
    tl.debug_barrier()  # every thread's reads of the v channels' slot are done
    conv_shift_store(cs_slot, 2 * H * K + i_h * V + o_v, m_v, b_shift, W, BW)


@triton.jit
def kda_layer_decode_norm_kernel(
    qkv, conv_state, gate, norm_w, eps, state_slots, out, stride_x, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, SHIFT_QK: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * H,), after the block kernel: the head's gated RMSNorm and, unless the prep kernel did it,
    its q/k conv shift; with ``PDL`` (launched as a programmatic dependent of the block layout's state launch,
    so that its start-up overlaps that launch's end) it waits for the state launch's writes first."""
    if PDL:
        gdc_wait()
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    x_row = qkv + i_b * stride_x
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    gated_norm(out + i_bh * V, gate + i_b * stride_gate + i_h * V, norm_w, eps, V, BVF)
    if SHIFT_QK:
        conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
        conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)


@triton.jit
def kda_layer_decode_prep_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, R: tl.constexpr, PREP_V: tl.constexpr = False, BVF: tl.constexpr = 1,
    EVICT: tl.constexpr = "",
):
    """Grid (B * H,), before the state kernel, for conv widths above 4 (narrower ones take the several-heads
    prep kernel with one head per program, kda_layer_decode_prep.py): the head's q, k (conv, L2 norm, scale),
    decay and beta, once, into ``heads`` float32, and the q/k conv shift (the only reader of those channels).
    ``heads`` is [B * H, 4, R] (rows q, k, decay, then beta in the first column; R = BK) or, with
    ``PREP_V``, [B * H, 5, R] (rows q, k, decay, the v conv output, beta; R = max(BK, BVF)), this program
    then also shifting the v channels' conv slot, so that the state kernel reads only ``heads`` and the
    state."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    x_row = qkv + i_b * stride_x
    cs_slot = conv_slot(conv_state, slot, H, K, V, W)
    b_q, b_k, b_decay, b_beta = head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                            beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k, scale,
                                            H, K, W, BW, HAS_LOWER_BOUND)
    p_h = heads + i_bh * (5 if PREP_V else 4) * R + o_k
    tl.store(p_h, tl.where(m_k, b_q, 0.0), eviction_policy=EVICT)
    tl.store(p_h + R, tl.where(m_k, b_k, 0.0), eviction_policy=EVICT)
    tl.store(p_h + 2 * R, b_decay, eviction_policy=EVICT)
    if PREP_V:
        o_f = tl.arange(0, BVF)
        m_f = o_f < V
        b_v = conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_f, m_f, W)
        tl.store(heads + i_bh * 5 * R + 3 * R + o_f, tl.where(m_f, b_v, 0.0), eviction_policy=EVICT)
        tl.store(p_h + 4 * R, tl.where(o_k == 0, b_beta, 0.0), eviction_policy=EVICT)
        conv_shift(x_row, cs_slot, 2 * H * K + i_h * V + o_f, m_f, W, BW)
    else:
        tl.store(p_h + 3 * R, tl.where(o_k == 0, b_beta, 0.0), eviction_policy=EVICT)
    conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
    conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)


GRIDS = ("block", "prep", "stream", "tiles")


def decode_config(B: int, state_dtype: torch.dtype) -> dict:
    """Launch options per batch size and state dtype: at each size timed in a CUDA graph on an H200 (H=64,
    K=V=128; bench/results/kda_decode.json, kda_decode_microbatch*.json) the fastest variant where it beat the
    previous choice by more than 0.5%, else the previous choice; between timed sizes the nearer one.
    B=1: the block layout ([K, 32] on 2 warps) with its norm launch dependent (``pdl``, 4-8% faster): the other
    layouts' extra launches cost more than they save for one sequence.
    fp32 state: the prep layout ([K, 64] on 4 warps at most 128 registers, four programs per SM; the state kernel is
    near the copy bandwidth), the prep launch 2 heads per program up to B=32 (1-2% faster at B=16;
    bench/results/kda_decode_refresh_16_64.json), above it one head on 4 warps (1.1-1.3% faster at B=64 and 256 in
    seven runs; bench/results/kda_decode_prep_one_head_4heads_norm.json).
    bf16 state: one program per [K, 64] tile on 4 warps capped at 96 registers with the step's sums over K on the
    tensor cores (``dot_sums``), the prep launch one head per program (at B=2 / 4 / 8 / 12 / 16 / 24 / 32 9.4 /
    11.4 / 15.4 / 19.6 / 24.2 / 40.1 / 51.6 us against the streaming layout's 10.6 / 12.4 / 15.9 / 20.5 / 26.3 /
    44.0 / 55.9, bench/results/kda_decode_microbatch_bf16_tiny.json and _bf16_small.json; at B=64 / 256 91.5 /
    333.4 against 92.0 / 336.8 without ``dot_sums``, kda_decode_dot_sums_layer.json).
    The norm launch 4 heads per program above B=1.
    Two micro-batches on two streams (``micro_batches``, inside CUDA graphs; bench/results/kda_decode_microbatch.json,
    _small.json, _bf16_small.json): fp32 from B=8 (at B=8 / 16 / 64 / 256 20.9 / 43.5 / 148.3 / 565.0 us against
    21.6 / 46.8 / 151.4 / 569.6; at B=32 within 1%), bf16 from B=24 (37.5 / 47.8 at B=24 / 32 against 40.1 / 51.6,
    89.1 / 333.5 at B=64 / 256 against 91.9 / 337.4; equal at B=16, slower at B=8 and 12: 21.1 / 25.2 against
    15.4 / 19.6)."""
    if B <= 1:
        return dict(grid="block", BV=32, num_warps=2, pdl=True)
    norm = dict(prep_warps=4, norm_heads=4, norm_warps=4)
    if state_dtype == torch.float32:
        return dict(grid="prep", BV=64, num_warps=4, maxnreg=128, prep_heads=2 if B <= 32 else 1, **norm,
                    **(dict(micro_batches=2) if B >= 8 else {}))
    return dict(grid="tiles", BV=64, num_warps=4, maxnreg=96, dot_sums=True, prep_heads=1, **norm,
                **(dict(micro_batches=2) if B > 20 else {}))


def _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, norm_weight, state,
                state_slots):
    B = qkv.shape[0]
    if state.dim() != 4 or not state.is_contiguous():
        raise ValueError(f"kda_layer_decode: state must be contiguous [slots, H, K, V], got {tuple(state.shape)}")
    H, K, V = state.shape[1:]
    C, W = conv_weight.shape
    problems = []
    if qkv.dim() != 2 or qkv.shape[1] != 2 * H * K + H * V or qkv.stride(1) != 1:
        problems.append(f"qkv {tuple(qkv.shape)} (want [B, {2 * H * K + H * V}], contiguous channels)")
    if C != 2 * H * K + H * V or W < 2:
        problems.append(f"conv_weight {tuple(conv_weight.shape)}")
    if conv_state.shape[1:] != (C, W - 1) or not conv_state.is_contiguous():
        problems.append(f"conv_state {tuple(conv_state.shape)}")
    if g_raw.shape != (B, H * K) or g_raw.stride(1) != 1:
        problems.append(f"g_raw {tuple(g_raw.shape)}")
    if beta_logits.shape != (B, H) or beta_logits.stride(1) != 1:
        problems.append(f"beta_logits {tuple(beta_logits.shape)}")
    if gate.shape != (B, H * V) or gate.stride(1) != 1:
        problems.append(f"gate {tuple(gate.shape)}")
    if A_log.shape != (H,) or dt_bias.shape != (H * K,) or norm_weight.shape != (V,):
        problems.append(f"A_log {tuple(A_log.shape)} dt_bias {tuple(dt_bias.shape)} "
                        f"norm_weight {tuple(norm_weight.shape)}")
    if state_slots.shape != (B,):
        problems.append(f"state_slots {tuple(state_slots.shape)}")
    if problems:
        raise ValueError(f"kda_layer_decode: H={H} K={K} V={V}, bad shapes: " + "; ".join(problems))


def kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                            norm_weight, eps, state, state_slots, grid: str | None = None, BV: int | None = None,
                            num_warps: int | None = None, out: torch.Tensor | None = None, num_stages: int = 4,
                            per_sm: int | None = None, programs: int | None = None, scratch_l2: bool = False,
                            tma_store: bool = True, launches: str = "all", maxnreg: int | None = None,
                            prep_warps: int | None = None, norm_warps: int | None = None,
                            prep_heads: int | None = None, norm_heads: int | None = None, pdl: bool | None = None,
                            dot_sums: bool | None = None, micro_batches: int | None = None):
    """``grid``, ``BV`` and ``num_warps`` left out come from ``decode_config``; with ``grid`` left out, so do the
    options it sets and the caller does not (``maxnreg``, the prep/norm heads and warps, ``pdl``, ``dot_sums``
    where the state fits it).
    The streaming layout (``"stream"``) also takes ``num_stages`` (the descriptor loop's
    pipeline depth: 4 keeps two tiles in flight behind the one being computed), ``per_sm`` (at most that many persistent
    programs per SM; by default as many as fit), ``programs`` (the grid size itself, for tests) and
    ``scratch_l2`` (the prep launch writes its scratch with the L2 policy evict_last, so that it is still in
    L2 when the state kernel reads it behind the state stream; off by default: at B=256 the scratch is 42 MB,
    most of the L2, which the kernels between the KDA layers would then lose);
    and ``tma_store`` (the new state written back by the copy engine, or by plain stores);
    with ``BV >= V``, ``"stream"`` and ``"tiles"`` apply the gated RMSNorm themselves (two launches). ``launches``
    ("prep", "state" or "norm" instead of "all") runs one launch of a multi-launch layout alone, for the
    benchmark's time split; the result is then incomplete. ``maxnreg`` caps the registers per thread of the
    state kernel (more programs per SM, at the price of spills below what it needs);
    ``prep_warps`` and ``norm_warps`` set the prep and norm launches' warps per program (4 unless the
    configuration says otherwise), ``prep_heads`` and ``norm_heads`` (powers of two; the norm's only with a
    prep launch) their heads of one sequence per program (``kda_layer_decode_prep.py``; 1: one program per
    (sequence, head)). ``pdl`` (the block layout; CUDA; the interpreter runs the launches in order without it):
    the norm launch as a programmatic dependent of the state launch, so that its start-up overlaps the state
    launch's end. ``dot_sums`` (the tiles layout, a bf16 state): the state step's sums over K as one tensor-core
    product (``state_step_dot``). ``micro_batches``: the batch cut into that many row ranges, each launched
    with the options resolved for the whole batch, alternately on the caller's stream and a side stream
    (microbatch.py; one range's prep and norm launches run beside another's state launch); by default the
    configuration's inside a CUDA graph capture, one outside."""
    _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, norm_weight, state,
                state_slots)
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    W = conv_weight.shape[1]
    if out is None:
        out = torch.empty((B, H, V), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (B, H, V) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"kda_layer_decode: out must be contiguous [{B}, {H}, {V}] {qkv.dtype}")
    cfg = decode_config(B, state.dtype)
    base = dict(maxnreg=None, prep_warps=4, norm_warps=4, prep_heads=1, norm_heads=1, pdl=False, dot_sums=False,
                micro_batches=1)
    if grid is None:  # the whole configuration; a caller's own layout takes none of its other options
        base.update((n, v) for n, v in cfg.items() if n in base)
    if not (qkv.is_cuda and torch.cuda.is_current_stream_capturing()):
        # the configuration's micro-batches only inside a CUDA graph: eager, the host's time per launch, which they
        # double, is longer than the layer's GPU time (B=64 fp32 on an H200: 234 us a call eager, 146 in a graph,
        # bench/results/kda_decode_micro_graph_only.json; 694 eager with two micro-batches,
        # kda_decode_micro_eager.json), so there is no GPU idle time for them to fill
        base["micro_batches"] = 1
    maxnreg = base["maxnreg"] if maxnreg is None else maxnreg
    prep_warps = base["prep_warps"] if prep_warps is None else prep_warps
    norm_warps = base["norm_warps"] if norm_warps is None else norm_warps
    prep_heads = base["prep_heads"] if prep_heads is None else prep_heads
    norm_heads = base["norm_heads"] if norm_heads is None else norm_heads
    pdl = base["pdl"] if pdl is None else pdl
    micro_batches = base["micro_batches"] if micro_batches is None else micro_batches
    grid, num_warps = grid or cfg["grid"], num_warps or cfg["num_warps"]
    if grid not in GRIDS:
        raise ValueError(f"kda_layer_decode: grid must be one of {GRIDS}, got {grid!r}")
    if launches not in ("all", "prep", "state", "norm"):
        raise ValueError(f"kda_layer_decode: launches must be 'all', 'prep', 'state' or 'norm', got {launches!r}")
    check_heads(prep_heads, norm_heads, W)
    check_block_options("kda_layer_decode", BV, maxnreg, num_warps, prep_warps, norm_warps)
    if norm_heads > 1 and grid == "block":
        raise ValueError(f"kda_layer_decode: norm_heads > 1 needs a layout with a prep launch, not {grid!r}")
    if pdl and grid != "block":
        raise ValueError(f"kda_layer_decode: pdl is an option of the block layout, not {grid!r}")
    if dot_sums and grid != "tiles":
        raise ValueError(f"kda_layer_decode: dot_sums is an option of the tiles layout, not {grid!r}")
    check_dot_sums("kda_layer_decode", dot_sums, state.dtype, K, BV)
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"kda_layer_decode: micro_batches must be a positive integer, got {micro_batches!r}")
    pdl = pdl and qkv.is_cuda
    if B == 0:
        return out
    BVF = triton.next_power_of_2(V)
    BV = min(BV or cfg["BV"], BVF)
    if dot_sums is None:  # the configuration's, where the state fits it (a caller's own value is checked above)
        dot_sums = base["dot_sums"] and dot_sums_fit(state.dtype, K, BV)
    if micro_batches > 1 and B > 1:
        whole = dict(grid=grid, BV=BV, num_warps=num_warps, num_stages=num_stages, per_sm=per_sm, programs=programs,
                     scratch_l2=scratch_l2, tma_store=tma_store, launches=launches, maxnreg=maxnreg,
                     prep_warps=prep_warps, norm_warps=norm_warps, prep_heads=prep_heads, norm_heads=norm_heads,
                     pdl=pdl, dot_sums=dot_sums, micro_batches=1)

        def rows(lo: int, hi: int) -> None:
            kda_layer_decode_launch(qkv[lo:hi], conv_weight, conv_state, g_raw[lo:hi], beta_logits[lo:hi], gate[lo:hi],
                                    A_log, dt_bias, lower_bound, norm_weight, eps, state, state_slots[lo:hi],
                                    out=out[lo:hi], **whole)

        on_two_streams(micro_ranges(B, micro_batches), rows, qkv.device)
        return out
    lb = float(lower_bound) if lower_bound is not None else 0.0
    A_log, dt_bias, norm_weight = A_log.contiguous(), dt_bias.float().contiguous(), norm_weight.contiguous()
    sizes = dict(H=H, K=K, V=V, BK=triton.next_power_of_2(K), W=W, BW=triton.next_power_of_2(W - 1))
    head_args = (qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb)
    strides = (qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), K**-0.5)
    streamed = grid in ("stream", "tiles")  # the state kernel reads only the scratch and the state
    prepped = grid == "prep" or streamed
    if grid == "stream":
        check_stream_layout(state, BV, sizes["BK"])
    R = max(sizes["BK"], BVF) if streamed else sizes["BK"]
    heads = torch.empty((B * H, 5 if streamed else 4, R) if prepped else (1,), dtype=torch.float32, device=qkv.device)
    run = ("prep", "state", "norm") if launches == "all" else (launches,)
    evict = "evict_last" if streamed and scratch_l2 else ""
    # the several-heads prep kernel for any number of heads per program (one included: fewer instructions than
    # the per-head kernel, which is left for conv widths above 4)
    if prepped and "prep" in run and (prep_heads > 1 or W <= 4):
        prep_heads_launch(*head_args, state_slots, heads, sizes, lower_bound is not None, R, streamed, BVF, evict,
                          prep_heads, prep_warps)
    elif prepped and "prep" in run:
        kda_layer_decode_prep_kernel[(B * H,)](*head_args, state_slots, heads, *strides, **sizes,
                                               HAS_LOWER_BOUND=lower_bound is not None, R=R, PREP_V=streamed,
                                               BVF=BVF, EVICT=evict, num_warps=prep_warps)
    normed = False
    if "state" in run and streamed:
        normed = stream_state_launch(state, heads, state_slots, out, gate, norm_weight, eps, grid, BV, R, num_warps,
                                     num_stages, per_sm, programs, tma_store, maxnreg, dot_sums)
    elif "state" in run:
        kda_layer_decode_block_kernel[(triton.cdiv(V, BV), B * H)](
            *head_args, state, state_slots, out, heads, *strides,
            **sizes, BV=BV, HAS_LOWER_BOUND=lower_bound is not None, PREPPED=prepped,
            EVEN=blocks_inside(K, V, sizes["BK"], BV), num_warps=num_warps, **register_cap(maxnreg))
    if "norm" in run and not normed and norm_heads > 1:
        norm_heads_launch(gate, norm_weight, eps, out, norm_heads, norm_warps)
    elif "norm" in run and not normed:
        kda_layer_decode_norm_kernel[(B * H,)](
            qkv, conv_state, gate, norm_weight, float(eps), state_slots, out, qkv.stride(0), gate.stride(0),
            **sizes, BVF=BVF, SHIFT_QK=not prepped, PDL=pdl, num_warps=norm_warps,
            **({"launch_pdl": True} if pdl else {}))
    return out


def kda_layer_decode(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                     norm_weight, eps, state, state_slots):
    if use_triton(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, state_slots):
        return kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                       lower_bound, norm_weight, eps, state, state_slots)
    return kda_layer_decode_ref(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                lower_bound, norm_weight, eps, state, state_slots)

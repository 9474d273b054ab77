"""The whole decode step of one KDA layer between its input and output projections, fused.

Per sequence (one new token) and head: the causal conv update with SiLU over the head's q, k and v channels (the
conv slot read and shifted in place), the forget gate with its lower bound, beta, the q/k L2 norm, the delta-rule
step on the recurrent state (read from and written back to its slot in place) and the gated RMSNorm of the
output. The unfused path (``kda_layer_decode_ref``) runs the conv, the gate, the recurrence and the norm as
separate ops, each reading and writing memory; here the only traffic is the inputs, the output (written, read
back for the norm, written again) and the two slots.

Launches, chosen per batch size by ``decode_config``:

- block layout (B=1): one program per (sequence, head, block of ``BV`` value columns), so many state loads are
  in flight at once, each recomputing the head's q/k conv and gate (a few KB from L2); then a small launch per
  (sequence, head) for the gated RMSNorm (it needs the head's whole output) and the q/k conv shift (every value
  block reads those channels first), as a programmatic dependent of the state launch so that its start-up
  overlaps the state launch's end. Stream order between launches replaces synchronisation between programs.
- prep layout (B > 1): the head's q/k conv, L2 norms, gate and beta computed once per (sequence, head) by a prep
  launch (which also shifts the q/k conv slot) into a float32 scratch (decode_prep.py), so the state programs do
  only the recurrence and the v conv; then the norm launch. From 8 sequences, inside a CUDA graph, the batch
  runs as two micro-batches on two streams (microbatch.py), so that one half's prep and norm launches run
  beside the other half's state launch.

The kernels round where the reference rounds (conv output and recurrence output to the activation dtype), so
both agree to that dtype's precision. The recurrent state may be float32 or bfloat16 (half the bytes; the
arithmetic is float32, the new state rounded once per step). Conv widths 2 to 4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, register_cap, use_triton
from flashinfra.kernels.kda.common import conv_slot, kda_log_decay, state_step_store, state_tile
from flashinfra.kernels.kda.decode_prep import norm_heads_launch, prep_heads_launch
from flashinfra.kernels.kda.ref import kda_layer_decode_ref
from flashinfra.kernels.microbatch import micro_ranges, on_two_streams
from flashinfra.kernels.launch import cdiv, next_power_of_2, pdl_options, pdl_wait


@triton.jit
def conv_silu(x_row, w, cs_slot, ch, m, W: tl.constexpr):
    """Conv + SiLU of one token on channels ``ch`` (the slot is only read), float32, rounded through x's
    dtype as the unfused conv output is. One 1-D load per tap, so the result comes in the vector layout the
    state block's rows take, not that of a [channels, taps] tile (which made the compiler move the whole
    state block between layouts through shared memory)."""
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(w + ch * W + W - 1, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        b_h = tl.load(cs_slot + ch * (W - 1) + j, mask=m, other=0.0).to(b_x.dtype).to(tl.float32)
        acc += b_h * tl.load(w + ch * W + j, mask=m, other=0.0).to(tl.float32)
    acc = acc * tl.sigmoid(acc)
    return acc.to(b_x.dtype).to(tl.float32)


@triton.jit
def conv_shift(x_row, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """Shift the token into the slot of channels ``ch``: new column j is old column j + 1, the last is x."""
    b_next = conv_shift_load(x_row, cs_slot, ch, m, W, BW)
    tl.debug_barrier()
    conv_shift_store(cs_slot, ch, m, b_next, W, BW)


@triton.jit
def conv_shift_load(x_row, cs_slot, ch, m, W: tl.constexpr, BW: tl.constexpr):
    """The shifted slot of channels ``ch`` as ``conv_shift_store`` writes it ([channels, BW]), read early: a
    program that loads it beside its other inputs and stores it at its end (after a barrier, as every thread's
    reads of the slot must come first) saves the round trip that a load just before the store would wait."""
    o_j = tl.arange(0, BW)
    mm = m[:, None] & (o_j < W - 2)[None, :]
    b_next = tl.load(cs_slot + ch[:, None] * (W - 1) + o_j[None, :] + 1, mask=mm, other=0.0)
    b_x = tl.load(x_row + ch, mask=m, other=0.0)
    return tl.where((o_j == W - 2)[None, :], b_x[:, None].to(b_next.dtype), b_next)


@triton.jit
def conv_shift_store(cs_slot, ch, m, b_next, W: tl.constexpr, BW: tl.constexpr):
    """Store the shifted slot that ``conv_shift_load`` read (after a barrier)."""
    o_j = tl.arange(0, BW)
    tl.store(cs_slot + ch[:, None] * (W - 1) + o_j[None, :], b_next, mask=m[:, None] & (o_j < W - 1)[None, :])


@triton.jit
def head_inputs(x_row, conv_w, cs_slot, g_row, dt_bias, A_log, beta_ptr, lower_bound, i_h, o_k, m_k, scale,
                 H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """The head's normalised q (times ``scale``) and k after the conv, its per-channel decay and beta."""
    b_q = conv_silu(x_row, conv_w, cs_slot, i_h * K + o_k, m_k, W)
    b_k = conv_silu(x_row, conv_w, cs_slot, H * K + i_h * K + o_k, m_k, W)
    b_g, b_beta = head_gate_beta(g_row, dt_bias, A_log, beta_ptr, lower_bound, i_h, o_k, m_k, K, HAS_LOWER_BOUND)
    b_q, b_k = head_qk_norm(b_q, b_k, scale)
    return b_q, b_k, tl.exp(b_g), b_beta


@triton.jit
def head_gate_beta(g_row, dt_bias, A_log, beta_ptr, lower_bound, i_h, o_k, m_k, K: tl.constexpr,
                   HAS_LOWER_BOUND: tl.constexpr):
    """The head's per-channel log-decay and its beta (float32)."""
    b_g = tl.load(g_row + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    b_g = kda_log_decay(b_g, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, HAS_LOWER_BOUND)
    return b_g, tl.sigmoid(tl.load(beta_ptr).to(tl.float32))


@triton.jit
def head_qk_norm(b_q, b_k, scale):
    """The head's conv outputs q and k L2-normalised, q times ``scale``."""
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k


@triton.jit
def load_state(p, m, MASKED: tl.constexpr = True):
    """A state block, read to be written back in place by the same program (``store_state``; MASKED False: the
    block lies inside the state, no mask): kept in L2 as evict_last, so that the write-back finds its lines
    there (as fast as writing to another buffer)."""
    if MASKED:
        b = tl.load(p, mask=m, other=0.0, eviction_policy="evict_last")
    else:
        b = tl.load(p, eviction_policy="evict_last")
    return b


@triton.jit
def store_state(p, b_s, m, MASKED: tl.constexpr = True):
    """Write back, rounded to the state's dtype, the block that ``load_state`` read with the same mask (none
    where the block lies inside the state: fewer instructions and registers)."""
    if MASKED:
        tl.store(p, b_s.to(p.dtype.element_ty), mask=m)
    else:
        tl.store(p, b_s.to(p.dtype.element_ty))


@triton.jit
def gate_apply(b_y, gate_row, norm_w, o_v, m_v):
    """The gated RMSNorm's last step on a normalised output block at columns ``o_v``: times the norm weight and
    sigmoid(gate)."""
    b_gate = tl.load(gate_row + o_v, mask=m_v, other=0.0).to(tl.float32)
    return b_y * tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32) * tl.sigmoid(b_gate)


@triton.jit
def gated_norm(o_row, gate_row, norm_w, eps, V: tl.constexpr, BVF: tl.constexpr):
    """Gated RMSNorm of one head's output row in place (the row holds the recurrence output, rounded)."""
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    b_o = tl.load(o_row + o_f, mask=m_f, other=0.0).to(tl.float32)
    b_o = gate_apply(b_o / tl.sqrt(tl.sum(b_o * b_o) / V + eps), gate_row, norm_w, o_f, m_f)
    tl.debug_barrier()
    tl.store(o_row + o_f, b_o.to(o_row.dtype.element_ty), mask=m_f)


@triton.jit
def kda_layer_decode_block_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, state_slots, out, heads,
    stride_x, stride_g, stride_b, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr, PREPPED: tl.constexpr,
    EVEN: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (cdiv(V, BV), B * H): the recurrence of one [K, BV] state block, its unnormalised output
    (rounded to out's dtype) and the shift of its own v channels' conv slot (no other program reads
    them). The head's q, k, decay and beta are either recomputed by each V block (q/k conv and gate, a
    few KB from L2) or, with ``PREPPED``, read from ``heads`` as the prep kernel wrote them. EVEN (BK == K
    and BV divides V): every block inside the state, no masks."""
    pdl_wait(PDL)
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
    b_s = state_step_store(b_s, b_q, b_k, b_decay, b_beta, b_v, out + i_bh * V, o_v, m_v)
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
    its q/k conv shift."""
    pdl_wait(PDL)
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


# the prep and norm launches' warps per program
PREP_WARPS = NORM_WARPS = 4


def decode_config(B: int) -> dict:
    """The launches per batch size, the fastest timed in a CUDA graph (H=64, K=V=128), for either state dtype.
    B=1: the block layout ([K, 32] on 2 warps, q/k conv and gate recomputed by each block): a prep launch costs more
    than it saves for one sequence.
    Above: the prep layout ([K, 64] on 4 warps at most 128 registers, four programs per SM), the prep launch 2 heads
    per program up to B=32, one above, the norm launch 4 heads per program; from B=8 two micro-batches on two
    streams inside a CUDA graph (one range's prep and norm launches run beside the other's state launch).
    Deterministic mode: the prep layout with one head per prep program whatever B is, so that a sequence's
    reductions (q/k norms, the state's products) have one tile shape in any batch; micro-batches split rows only."""
    if is_deterministic():
        return dict(prep=True, BV=64, num_warps=4, maxnreg=128, prep_heads=1, norm_heads=4,
                    micro_batches=2 if B >= 8 else 1)
    if B <= 1:
        return dict(prep=False, BV=32, num_warps=2, maxnreg=None, micro_batches=1)
    return dict(prep=True, BV=64, num_warps=4, maxnreg=128, prep_heads=2 if B <= 32 else 1, norm_heads=4,
                micro_batches=2 if B >= 8 else 1)


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
    if C != 2 * H * K + H * V or not 2 <= W <= 4:
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


def in_graph_capture(qkv: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph: only there do micro-batches pay. Eager, the host's
    time per launch, which they double, is longer than the layer's GPU time, so there is no idle time to fill."""
    return qkv.is_cuda and torch.cuda.is_current_stream_capturing()


def kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                            norm_weight, eps, state, state_slots, out: torch.Tensor | None = None):
    """Triton ``kda_layer_decode`` in ``decode_config``'s launches; inside a CUDA graph capture, from 8 sequences,
    the batch in two row ranges on two streams (microbatch.py)."""
    _check_args(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, norm_weight, state,
                state_slots)
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    if out is None:
        out = torch.empty((B, H, V), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (B, H, V) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"kda_layer_decode: out must be contiguous [{B}, {H}, {V}] {qkv.dtype}")
    if B == 0:
        return out
    cfg = decode_config(B)
    args = (conv_weight, A_log, dt_bias, lower_bound, norm_weight, eps, state)
    if cfg["micro_batches"] > 1 and in_graph_capture(qkv):
        def rows(lo: int, hi: int) -> None:
            _launch(qkv[lo:hi], conv_state, g_raw[lo:hi], beta_logits[lo:hi], gate[lo:hi], state_slots[lo:hi],
                    out[lo:hi], *args, cfg)

        on_two_streams(micro_ranges(B, cfg["micro_batches"]), rows, qkv.device)
        return out
    _launch(qkv, conv_state, g_raw, beta_logits, gate, state_slots, out, *args, cfg)
    return out


def _launch(qkv, conv_state, g_raw, beta_logits, gate, state_slots, out, conv_weight, A_log, dt_bias, lower_bound,
            norm_weight, eps, state, cfg: dict) -> None:
    """The launches of one row range, in the configuration chosen for the whole batch."""
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    W = conv_weight.shape[1]
    BVF = next_power_of_2(V)
    BV = min(cfg["BV"], BVF)
    pdl = pdl_options(qkv.device)
    prepped = cfg["prep"]
    lb = float(lower_bound) if lower_bound is not None else 0.0
    A_log, dt_bias, norm_weight = A_log.contiguous(), dt_bias.float().contiguous(), norm_weight.contiguous()
    sizes = dict(H=H, K=K, V=V, BK=next_power_of_2(K), W=W, BW=next_power_of_2(W - 1))
    head_args = (qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias, lb)
    strides = (qkv.stride(0), g_raw.stride(0), beta_logits.stride(0), K**-0.5)
    heads = torch.empty((B * H, 4, sizes["BK"]) if prepped else (1,), dtype=torch.float32, device=qkv.device)
    if prepped:
        prep_heads_launch(*head_args, state_slots, heads, sizes, lower_bound is not None, cfg["prep_heads"],
                          PREP_WARPS, pdl)
    kda_layer_decode_block_kernel[(cdiv(V, BV), B * H)](
        *head_args, state, state_slots, out, heads, *strides,
        **sizes, BV=BV, HAS_LOWER_BOUND=lower_bound is not None, PREPPED=prepped,
        EVEN=blocks_inside(K, V, sizes["BK"], BV), num_warps=cfg["num_warps"], **register_cap(cfg["maxnreg"]), **pdl)
    if prepped:
        norm_heads_launch(gate, norm_weight, eps, out, cfg["norm_heads"], NORM_WARPS, pdl)
    else:
        kda_layer_decode_norm_kernel[(B * H,)](
            qkv, conv_state, gate, norm_weight, float(eps), state_slots, out, qkv.stride(0), gate.stride(0),
            **sizes, BVF=BVF, SHIFT_QK=True, num_warps=NORM_WARPS, **pdl)


def blocks_inside(K: int, V: int, BK: int, BV: int) -> bool:
    """Whether every [BK, BV] block of a [K, V] state lies inside it (the block kernel's ``EVEN``: no masks)."""
    return BK == K and V % BV == 0


def kda_layer_decode(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                     norm_weight, eps, state, state_slots):
    if use_triton(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state, state_slots):
        return kda_layer_decode_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                       lower_bound, norm_weight, eps, state, state_slots)
    return kda_layer_decode_ref(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                lower_bound, norm_weight, eps, state, state_slots)

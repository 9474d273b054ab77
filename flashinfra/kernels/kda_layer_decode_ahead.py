"""The KDA layer decode with each head's inputs computed ahead, inside the state launch (``grid="ahead"``).

The prep layout runs the head work (q/k conv, L2 norms, decay, beta) as a launch of its own before the state
launch, so the state stream waits for it: 11 us of a 157 us layer at B=64 (bench/notes/kda_decode.md). Here
one launch does both. Its first ``lead`` programs each compute one head's inputs into the float32 scratch
``heads`` [B * H, 4, BK] (as the prep kernel writes it) and raise that head's ``ready`` flag; then come the
state programs, one per (sequence, head, V block), in head order. The first V block's program of head h,
while its own state tile is on its way, computes the inputs of head h + ``lead``; every state program waits
for its own head's flag (raised ``lead`` heads earlier, so normally long before) and then reads the scratch.
The head work thus runs in the shadow of the state loads instead of before them. The norm launch follows
(it needs a head's whole output row) and lowers the flags again for the next call.

Progress: a program only waits for a flag raised by a program of a lower index, which computes it before
waiting for anything. The GPU starts a one-dimensional grid's programs in index order, so that program
has started (or ended) by then, and the wait ends. The flags are a persistent zeroed buffer per device
(``ready_flags``), one per (sequence, head), lowered by the norm launch: two of these layers must not run
at once on one device (the engine runs its layers in one stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.kda_layer_decode_parts import conv_shift, conv_silu, head_inputs, state_step


@triton.jit
def _head_ahead(hh, qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots, heads,
                ready, stride_x, stride_g, stride_b, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, W: tl.constexpr,
                BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr):
    """Head ``hh``'s q, k, decay and beta into the scratch, its flag raised (release: the rows are visible
    to whoever sees the flag), then its q/k conv slot shifted (no state program reads those channels)."""
    i_b, i_h = hh // H, hh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    x_row = qkv + i_b * stride_x
    cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
    b_q, b_k, b_decay, b_beta = head_inputs(x_row, conv_w, cs_slot, g_raw + i_b * stride_g, dt_bias, A_log,
                                            beta_logits + i_b * stride_b + i_h, lower_bound, i_h, o_k, m_k, scale,
                                            H, K, W, BW, HAS_LOWER_BOUND)
    p_h = heads + hh * 4 * BK + o_k
    tl.store(p_h, tl.where(m_k, b_q, 0.0))
    tl.store(p_h + BK, tl.where(m_k, b_k, 0.0))
    tl.store(p_h + 2 * BK, b_decay)
    tl.store(p_h + 3 * BK, tl.where(o_k == 0, b_beta, 0.0))
    tl.debug_barrier()  # every thread's rows are written before the one thread that raises the flag
    tl.atomic_xchg(ready + hh, 1, sem="release")
    conv_shift(x_row, cs_slot, i_h * K + o_k, m_k, W, BW)
    conv_shift(x_row, cs_slot, H * K + i_h * K + o_k, m_k, W, BW)


@triton.jit
def kda_layer_decode_ahead_kernel(
    qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, state_slots, out, heads, ready,
    stride_x, stride_g, stride_b, scale, n_heads, lead,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, BW: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
):
    """Grid (lead + B * H * cdiv(V, BV),): programs 0 .. lead - 1 compute heads 0 .. lead - 1's inputs; program
    lead + s is V block s % NV of head s // NV (the recurrence of its [K, BV] state block, its unnormalised
    output rounded to out's dtype, its own v channels' conv and slot shift), and, in the first V block, first
    the inputs of head s // NV + lead."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    if pid < lead:
        _head_ahead(pid, qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound, state_slots,
                    heads, ready, stride_x, stride_g, stride_b, scale, H, K, V, BK, W, BW, HAS_LOWER_BOUND)
    else:
        s = pid - lead
        i_bh, i_v = s // NV, s % NV
        i_b, i_h = i_bh // H, i_bh % H
        slot = tl.load(state_slots + i_b).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_s = m_k[:, None] & m_v[None, :]
        p_s = state + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # issued first: the big load
        if i_v == 0 and i_bh + lead < n_heads:
            _head_ahead(i_bh + lead, qkv, conv_w, conv_state, g_raw, beta_logits, A_log, dt_bias, lower_bound,
                        state_slots, heads, ready, stride_x, stride_g, stride_b, scale, H, K, V, BK, W, BW,
                        HAS_LOWER_BOUND)
        flag = tl.atomic_add(ready + i_bh, 0, sem="acquire")
        while flag == 0:
            flag = tl.atomic_add(ready + i_bh, 0, sem="acquire")
        p_h = heads + i_bh * 4 * BK + o_k  # past the flag: read from L2, not from this SM's L1
        b_q = tl.load(p_h, cache_modifier=".cg")
        b_k = tl.load(p_h + BK, cache_modifier=".cg")
        b_decay = tl.load(p_h + 2 * BK, cache_modifier=".cg")
        b_beta = tl.load(heads + i_bh * 4 * BK + 3 * BK, cache_modifier=".cg")
        x_row = qkv + i_b * stride_x
        cs_slot = conv_state + slot * (2 * H * K + H * V) * (W - 1)
        b_v = conv_silu(x_row, conv_w, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W)
        b_s, b_o = state_step(b_s, b_q, b_k, b_decay, b_beta, b_v)
        tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)
        conv_shift(x_row, cs_slot, 2 * H * K + i_h * V + o_v, m_v, W, BW)


_READY: list[torch.Tensor] = []  # every flag buffer ever handed out stays alive: captured graphs hold its address


def ready_flags(device: torch.device, n: int) -> torch.Tensor:
    """The device's zeroed flag buffer, at least ``n`` flags (each call leaves them zero again). Allocated on
    first use, at least 64K flags; a larger one cannot be made while a CUDA graph is being captured."""
    for t in reversed(_READY):
        if t.device == device and t.numel() >= n:
            return t
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"kda_layer_decode: the 'ahead' layout needs {n} flags on {device}; run one decode "
                           "step of this batch size before capturing it in a CUDA graph")
    _READY.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return _READY[-1]


def ahead_state_launch(head_args: tuple, strides: tuple, state: torch.Tensor, state_slots: torch.Tensor,
                       out: torch.Tensor, heads: torch.Tensor, ready: torch.Tensor, sizes: dict, has_lower_bound: bool,
                       BV: int, lead: int, num_warps: int, maxnreg: int | None) -> None:
    """The combined head-inputs and state launch; ``lead`` heads are computed by programs of their own."""
    B, H, V = out.shape
    n_heads = B * H
    lead = max(1, min(lead, n_heads))
    cap = {} if maxnreg is None or not state.is_cuda else dict(maxnreg=maxnreg)
    kda_layer_decode_ahead_kernel[(lead + n_heads * triton.cdiv(V, BV),)](
        *head_args, state, state_slots, out, heads, ready, *strides, n_heads, lead,
        **sizes, BV=BV, HAS_LOWER_BOUND=has_lower_bound, num_warps=num_warps, **cap)

"""Short causal depthwise conv1d with SiLU, over packed variable-length sequences, with its state.

The conv state of a sequence holds its last ``W - 1`` inputs (before the conv), so a later chunk or a
decode step continues exactly where the previous one stopped. The conv runs in the weight's dtype
(float32 in GLM-5.3-Flash) and its output is cast back to the input's dtype.

Triton path: prefill is two launches, the conv (each program a block of tokens of one sequence, a tile of
rows at a time, and a block of channels, reading the history from the slot) and then the state update (one program per
sequence and channel block), so that no program overwrites a slot another program still reads. Decode
is one launch that reads the slot, convolves and writes the shifted slot back. Both accept ``x`` with a
row stride (a column slice of a wider projection output) as long as channels are contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2
from flashinfra.kernels.varlen import cached_int_lists, cached_ints, chunk_tables

# the prefill conv's tile is BT x BC = 32 x 128 over 8 warps: 16 elements a thread and no spill (ptxas, sm_90)
CONV_PREFILL_WARPS = 8
# Rows a prefill conv program covers, a tile at a time: a program of one tile spent most of its life on the chain of
# index loads before its first input load (an 8,192-token chunk was 49,152 programs at two an SM)
CONV_PREFILL_ROWS = 256


def causal_conv1d_prefill_ref(
    x: torch.Tensor,  # [T, C] packed tokens
    weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    cu_seqlens: list[int],  # B + 1 offsets into T
    state_slots: list[int],  # [B] slot of each sequence
    has_initial_state: list[bool],  # [B] False: the sequence starts here, its history is zeros
) -> torch.Tensor:  # [T, C]
    C, W = weight.shape
    out = torch.empty_like(x)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        history = conv_state[slot] if has_initial_state[b] else conv_state.new_zeros(C, W - 1)
        xs = torch.cat([history.to(x.dtype), x[bos:eos].t()], dim=-1)  # [C, W - 1 + L]
        y = F.conv1d(xs.to(weight.dtype)[None], weight[:, None, :], groups=C)[0]  # [C, L]
        out[bos:eos] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = xs[:, xs.shape[-1] - (W - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_decode_ref(
    x: torch.Tensor,  # [B, C] one token per sequence
    weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, C]
    xs = torch.cat([conv_state[state_slots].to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, W]
    y = (xs.to(weight.dtype) * weight[None]).sum(-1)
    conv_state[state_slots] = xs[:, :, 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


@triton.jit
def _conv_rows(x_chunk, p_slot, w, t0, stride_x, L, o_c, m_c, W: tl.constexpr, ROWS: tl.constexpr,
               HISTORY: tl.constexpr):
    """SiLU of the conv at the chunk's first ``ROWS`` rows (``[ROWS, BC]`` float32): per tap the input, at a position
    below 0 the slot's history rounded to the input's dtype (``HISTORY``) or zero."""
    o_r = tl.arange(0, ROWS)
    m_t = t0 + o_r < L
    acc = tl.zeros([ROWS, o_c.shape[0]], dtype=tl.float32)
    for i_w in tl.static_range(W):
        r = o_r - (W - 1) + i_w  # source row relative to the chunk; a position below 0 is in the slot
        m_x = (t0 + r >= 0) & m_t
        b_x = tl.load(x_chunk + r[:, None] * stride_x + o_c[None, :], mask=m_x[:, None] & m_c[None, :], other=0.0)
        if HISTORY:
            m_h = (t0 + r < 0) & m_t
            b_h = tl.load(p_slot + o_c[None, :] * (W - 1) + (W - 1 + t0 + r)[:, None], mask=m_h[:, None] & m_c[None, :],
                          other=0.0)
            b_x += b_h.to(b_x.dtype)
        b_w = tl.load(w + o_c * W + i_w, mask=m_c, other=0.0).to(tl.float32)
        acc += b_x.to(tl.float32) * b_w[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def causal_conv1d_prefill_kernel(
    x, w, conv_state, y, cu_seqlens, chunk_indices, state_slots, has_initial_state,
    stride_x, stride_y, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr, STEPS: tl.constexpr,
):
    """Program (block of channels, chunk of ``STEPS`` tiles of ``BT`` tokens of one sequence): the chunk's rows from
    its input alone, a tile at a time, then, in a sequence's first chunk, its first ``W - 1`` rows again with the
    history (a ``[BH, BC]`` tile, stored in their place): reading the slot across the whole tile, or a 64-bit address
    per element and tap, spilled the tile to the stack."""
    i_c, i_chunk = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_chunk).to(tl.int64)
    t0 = tl.load(chunk_indices + 2 * i_chunk + 1) * (BT * STEPS)  # the chunk's first position in the sequence
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    x_chunk = x + (bos + t0) * stride_x
    y_chunk = y + (bos + t0) * stride_y
    p_slot = conv_state + tl.load(state_slots + i_n).to(tl.int64) * C * (W - 1)
    history = (t0 == 0) & (tl.load(has_initial_state + i_n) != 0)
    o_r = tl.arange(0, BT)
    first = (W - 1) * history.to(tl.int32)  # the history's rows are stored below
    for r0 in range(0, tl.minimum(BT * STEPS, L - t0), BT):
        acc = _conv_rows(x_chunk + r0 * stride_x, p_slot, w, t0 + r0, stride_x, L, o_c, m_c, W, BT, False)
        m_y = (t0 + r0 + o_r < L) & (r0 + o_r >= first)
        tl.store(y_chunk + (r0 + o_r)[:, None] * stride_y + o_c[None, :], acc.to(y.dtype.element_ty),
                 mask=m_y[:, None] & m_c[None, :])
    if history:
        o_h = tl.arange(0, BH)
        acc_h = _conv_rows(x_chunk, p_slot, w, t0, stride_x, L, o_c, m_c, W, BH, True)
        tl.store(y_chunk + o_h[:, None] * stride_y + o_c[None, :], acc_h.to(y.dtype.element_ty),
                 mask=((o_h < W - 1) & (o_h < L))[:, None] & m_c[None, :])


@triton.jit
def causal_conv1d_state_kernel(
    x, conv_state, cu_seqlens, state_slots, has_initial_state, stride_x, C,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    """New slot content: the last W - 1 inputs of [history, x]; all of it is read before any store."""
    i_c, i_n = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    slot = tl.load(state_slots + i_n).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    o_j = tl.arange(0, BW)
    has_init = (tl.load(has_initial_state + i_n) + tl.zeros([BW], tl.int32)) != 0
    m_c, m_j = o_c < C, o_j < W - 1
    p = L - (W - 1) + o_j  # source position of new slot column j
    m = m_c[:, None] & m_j[None, :]
    p_s = conv_state + slot * C * (W - 1) + o_c[:, None] * (W - 1)
    b_x = tl.load(x + (bos + p)[None, :] * stride_x + o_c[:, None], mask=m & (p >= 0)[None, :], other=0.0)
    b_h = tl.load(p_s + (W - 1 + p)[None, :], mask=m & ((p < 0) & has_init)[None, :], other=0.0)
    b_new = b_x.to(conv_state.dtype.element_ty) + b_h
    tl.debug_barrier()
    tl.store(p_s + o_j[None, :], b_new, mask=m)


@triton.jit
def causal_conv1d_decode_kernel(
    x, w, conv_state, y, state_slots, stride_x, stride_y, C,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
):
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    o_j = tl.arange(0, BW)
    m_c, m_j = o_c < C, o_j < W - 1
    m = m_c[:, None] & m_j[None, :]
    p_s = conv_state + slot * C * (W - 1) + o_c[:, None] * (W - 1) + o_j[None, :]
    b_h = tl.load(p_s, mask=m, other=0.0)  # [BC, BW] the last W - 1 inputs
    b_x = tl.load(x + i_b * stride_x + o_c, mask=m_c, other=0.0)  # [BC]
    b_w = tl.load(w + o_c[:, None] * W + o_j[None, :], mask=m, other=0.0).to(tl.float32)
    b_wl = tl.load(w + o_c * W + W - 1, mask=m_c, other=0.0).to(tl.float32)
    # The reference casts the history to x's dtype before the conv: do the same so both agree bit for bit.
    acc = tl.sum(b_h.to(b_x.dtype).to(tl.float32) * b_w, 1) + b_x.to(tl.float32) * b_wl
    acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b * stride_y + o_c, acc.to(y.dtype.element_ty), mask=m_c)
    # Shift: new column j is old column j + 1, the last one is x.
    b_next = tl.load(p_s + 1, mask=m & (o_j < W - 2)[None, :], other=0.0)
    b_next = tl.where((o_j == W - 2)[None, :], b_x[:, None].to(b_next.dtype), b_next)
    tl.debug_barrier()
    tl.store(p_s, b_next, mask=m)


def _check_conv_args(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[int, int]:
    C, W = weight.shape
    if x.dim() != 2 or x.shape[1] != C or x.stride(1) != 1:
        raise ValueError(f"causal_conv1d: x must be [T, {C}] with contiguous channels, got {tuple(x.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, W - 1) or not conv_state.is_contiguous():
        raise ValueError(f"causal_conv1d: conv_state must be contiguous [slots, {C}, {W - 1}], "
                         f"got {tuple(conv_state.shape)}")
    if W < 2:
        raise ValueError(f"causal_conv1d: kernel width must be at least 2, got {W}")
    return C, W


def _output(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"causal_conv1d: out must be {list(x.shape)} {x.dtype} with contiguous channels")
    return out


def _as_index_tensor(values, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=torch.int32)
    return cached_ints(values, device)  # no stream sync (varlen.py)


def causal_conv1d_prefill_launch(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state,
                                 BT: int = 32, BC: int = 128, rows: int = CONV_PREFILL_ROWS,
                                 out: torch.Tensor | None = None) -> torch.Tensor:
    C, W = _check_conv_args(x, weight, conv_state)
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if cu[0] != 0 or cu[-1] != x.shape[0] or any(b > e for b, e in zip(cu, cu[1:])):
        raise ValueError(f"causal_conv1d_prefill: cu_seqlens must rise from 0 to {x.shape[0]}, got {cu}")
    B = len(cu) - 1
    if len(state_slots) != B or len(has_initial_state) != B:
        raise ValueError("causal_conv1d_prefill: need one state slot and one has_initial_state per sequence")
    y = _output(out, x)
    dev = x.device
    steps = max(1, rows // BT)
    idx_t, _, nch = chunk_tables(cu, BT * steps, dev)
    if not nch:
        return y
    if isinstance(state_slots, torch.Tensor) or isinstance(has_initial_state, torch.Tensor):
        cu_t, slots_t, init_t = (_as_index_tensor(t, dev) for t in (cu, state_slots, has_initial_state))
    else:  # one cached copy for the three (varlen.py)
        cu_t, slots_t, init_t = cached_int_lists((cu, state_slots, has_initial_state), dev)
    fast(causal_conv1d_prefill_kernel)[(cdiv(C, BC), nch)](
        x, weight, conv_state, y, cu_t, idx_t, slots_t, init_t, x.stride(0), y.stride(0), C, W=W, BT=BT, BC=BC,
        BH=next_power_of_2(W - 1), STEPS=steps, num_warps=CONV_PREFILL_WARPS,
    )
    fast(causal_conv1d_state_kernel)[(cdiv(C, BC), B)](
        x, conv_state, cu_t, slots_t, init_t, x.stride(0), C, W=W, BW=next_power_of_2(W - 1), BC=BC,
    )
    return y


def causal_conv1d_decode_launch(x, weight, conv_state, state_slots, BC: int = 256,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    C, W = _check_conv_args(x, weight, conv_state)
    if state_slots.shape != (x.shape[0],):
        raise ValueError(f"causal_conv1d_decode: state_slots must be [{x.shape[0]}], got {tuple(state_slots.shape)}")
    y = _output(out, x)
    if x.shape[0] == 0:
        return y
    causal_conv1d_decode_kernel[(cdiv(C, BC), x.shape[0])](
        x, weight, conv_state, y, state_slots, x.stride(0), y.stride(0), C,
        W=W, BW=next_power_of_2(W - 1), BC=BC,
    )
    return y


def causal_conv1d_prefill(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state):
    if use_triton(x, weight, conv_state):
        return causal_conv1d_prefill_launch(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state)
    return causal_conv1d_prefill_ref(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state)


def causal_conv1d_decode(x, weight, conv_state, state_slots):
    if use_triton(x, weight, conv_state, state_slots):
        return causal_conv1d_decode_launch(x, weight, conv_state, state_slots)
    return causal_conv1d_decode_ref(x, weight, conv_state, state_slots)


def causal_conv1d_save_windows(x, conv_state, cu_seqlens: list[int], state_slots: list[int],
                               has_initial_state: list[bool], checkpoints) -> None:
    """For each prefix checkpoint ``(seq, p, slot)`` (checkpoints.py), write into ``slot`` the conv state after
    ``p`` of that sequence's tokens: its last W - 1 inputs, read from ``x`` [T, C] and, where ``p < W - 1``,
    from the sequence's own conv state (zeros for a fresh sequence). Call it before ``causal_conv1d_prefill``,
    which overwrites the sequences' own states. Data movement only, the same on every device."""
    W1 = conv_state.shape[-1]
    if not checkpoints or not W1:
        return
    if all(p >= W1 for _, p, _ in checkpoints):  # the common case: one gather, one scatter
        rows = [cu_seqlens[b] + p - W1 + i for b, p, _ in checkpoints for i in range(W1)]
        rows_t, dst_t = cached_int_lists((rows, [dst for _, _, dst in checkpoints]), x.device)
        win = x.index_select(0, rows_t).view(len(checkpoints), W1, -1).transpose(1, 2)
        conv_state.index_copy_(0, dst_t.long(), win.to(conv_state.dtype))
        return
    for b, p, dst in checkpoints:
        take = min(p, W1)
        bos = cu_seqlens[b]
        win = x[bos + p - take : bos + p].t().to(conv_state.dtype)  # [C, take]
        if take < W1:
            old = conv_state[state_slots[b], :, take:]
            head = old.clone() if has_initial_state[b] else torch.zeros_like(old)
            win = torch.cat([head, win], dim=-1)
        conv_state[dst] = win

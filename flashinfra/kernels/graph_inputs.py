"""A step's batch copied into a CUDA graph's static inputs in one launch (``engine/cuda_graphs.StepBuffers``).

A graph replays ``bs`` rows of ``q`` tokens. A step with ``B <= bs`` rows of at most ``q`` tokens each is copied in:
row ``b``'s token ``i`` goes to ``b * q + i`` (its token id, cache slot and position), the tokens after a row's own
(``q`` minus its length) are pad tokens (id 0, the scratch cache entry, the row's last position), and the rows past
``B`` are padding rows (one token at position 1 of the scratch block, the scratch state slot, a table of the scratch
block, sequence length 2). The row's state slot, sequence length and block table are copied (the table's columns past
the step's width set to 0). ``at[t]`` receives where the step's token ``t`` went, for reading its hidden state back.

The MTP layer's chained draft steps (``engine/draft_graphs.ChainBuffers``) take ``fill_chain``: ``n <= bs`` rows'
block tables and, per chained step ``j < k - 1``, each row's cache slot and position: its next position plus ``j``
while that fits its table (``caps``: the table's capacity in tokens), past it the scratch entry at the table's last
position; a padding row writes the scratch entry at position 1 from a table of the scratch block.

In tensor ops each of these is some twenty launches, each a few microseconds of host time in a step whose host
time is the bottleneck (a speculative step fills two such buffers); here one launch does it all: per graph row, one
program for its tokens, its scalars and the first ``BW`` columns of its table, and one more per further ``BW`` columns
(a row's table at 1M tokens has 65,536 blocks, too many for one program to copy in a decode step's time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2

BW = 256  # block-table columns per program: a row's table is copied by W / BW programs (at 1M tokens, 256 of them)


# every integer argument changes with the step or the buffer: none specialised, one compilation per ``Q``
@triton.jit(do_not_specialize=["B", "w", "W", "stride_src", "scratch_entry", "scratch_slot", "scratch_block"])
def fill_step_kernel(src_ids, cu, src_slot, src_pos, src_state, src_table, src_seq,
                     ids, slot, pos, state, table, seq, at,
                     B, w, W, stride_src, scratch_entry, scratch_slot, scratch_block,
                     Q: tl.constexpr, QP: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0)
    o = tl.program_id(1) * BW + tl.arange(0, BW)  # this program's table columns
    if r < B:
        tl.store(table + r * W + o, tl.load(src_table + r * stride_src + o, mask=o < w, other=0), mask=o < W)
    else:
        tl.store(table + r * W + o, tl.zeros([BW], dtype=tl.int32) + scratch_block, mask=o < W)
    if tl.program_id(1) == 0:  # the row's tokens and scalars
        o_q = tl.arange(0, QP)
        m_q = o_q < Q
        dst = r * Q + o_q
        if r < B:
            start = tl.load(cu + r)
            n = tl.load(cu + r + 1) - start
            real = o_q < n
            s = start + o_q
            length = tl.load(src_seq + r)
            tl.store(ids + dst, tl.load(src_ids + s, mask=real, other=0), mask=m_q)
            tl.store(slot + dst, tl.load(src_slot + s, mask=real, other=scratch_entry), mask=m_q)
            tl.store(pos + dst, tl.where(real, tl.load(src_pos + s, mask=real, other=0), length - 1), mask=m_q)
            tl.store(at + s, dst.to(tl.int64), mask=real)
            tl.store(state + r, tl.load(src_state + r))
            tl.store(seq + r, length)
        else:
            tl.store(ids + dst, tl.zeros([QP], dtype=tl.int64), mask=m_q)
            tl.store(slot + dst, tl.zeros([QP], dtype=tl.int64) + scratch_entry, mask=m_q)
            tl.store(pos + dst, tl.full([QP], 1, dtype=tl.int32), mask=m_q)
            tl.store(state + r, scratch_slot.to(tl.int64))
            tl.store(seq + r, 2)


@triton.jit(do_not_specialize=["n", "w", "W", "bs", "stride_src", "block_size", "scratch_entry", "scratch_block"])
def fill_chain_kernel(positions, caps, src_table, table, slot, pos, seq, n, w, W, bs, stride_src, block_size,
                      scratch_entry, scratch_block, STEPS: tl.constexpr, SP: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0)
    o = tl.program_id(1) * BW + tl.arange(0, BW)  # this program's table columns
    if r < n:
        tl.store(table + r * W + o, tl.load(src_table + r * stride_src + o, mask=o < w, other=0), mask=o < W)
    else:
        tl.store(table + r * W + o, tl.zeros([BW], dtype=tl.int32) + scratch_block, mask=o < W)
    if tl.program_id(1) == 0:  # the row's chained steps
        o_j = tl.arange(0, SP)
        m_j = o_j < STEPS
        if r < n:
            cap = tl.load(caps + r).to(tl.int64)
            p = tl.minimum(tl.load(positions + r).to(tl.int64) + o_j, cap - 1)
            block = tl.load(src_table + r * stride_src + p // block_size, mask=m_j & (p >= 0), other=0).to(tl.int64)
            # the row's own steps: its next positions while they fit its table
            own = o_j < tl.minimum(tl.maximum(cap - tl.load(positions + r).to(tl.int64), 0), STEPS)
            tl.store(slot + o_j * bs + r, tl.where(own, block * block_size + p % block_size, scratch_entry), mask=m_j)
            tl.store(pos + o_j * bs + r, p.to(tl.int32), mask=m_j)
            tl.store(seq + o_j * bs + r, (p + 1).to(tl.int32), mask=m_j)
        else:
            tl.store(slot + o_j * bs + r, tl.zeros([SP], dtype=tl.int64) + scratch_entry, mask=m_j)
            tl.store(pos + o_j * bs + r, tl.full([SP], 1, dtype=tl.int32), mask=m_j)
            tl.store(seq + o_j * bs + r, tl.full([SP], 2, dtype=tl.int32), mask=m_j)


def _check(src: tuple, dst: tuple, q: int) -> None:
    src_ids, cu, src_slot, src_pos, src_state, src_table, src_seq = src
    ids, slot, pos, state, table, seq, at = dst
    bs, B, T = state.shape[0], cu.shape[0] - 1, src_ids.shape[0]
    if B > bs or T > bs * q or src_table.shape[1] > table.shape[1] or at.shape[0] < T:
        raise ValueError(f"fill_step: a step of {B} rows, {T} tokens and width {src_table.shape[1]} does not fit "
                         f"{bs} rows of {q} tokens and width {table.shape[1]}")
    wanted = ((ids, torch.int64), (slot, torch.int64), (pos, torch.int32), (state, torch.int64), (table, torch.int32),
              (seq, torch.int32), (at, torch.int64), (src_ids, torch.int64), (cu, torch.int32),
              (src_slot, torch.int64), (src_pos, torch.int32), (src_state, torch.int64), (src_table, torch.int32),
              (src_seq, torch.int32))
    if any(t.dtype != dt or not t.is_contiguous() for t, dt in wanted):
        raise ValueError("fill_step: tensors of ForwardBatch's dtypes (int64 ids, slots and state slots; int32 "
                         "cu_seqlens, positions, tables and lengths), contiguous")


def fill_step_launch(src: tuple, dst: tuple, q: int, scratch: tuple[int, int, int]) -> None:
    """``src``: the step's (input ids [T], cu_seqlens [B + 1], slot_mapping [T], positions [T], state slots [B],
    block tables [B, w], sequence lengths [B]); ``dst``: the graph's (input ids [bs q], slot_mapping [bs q],
    positions [bs q], state slots [bs], block tables [bs, W], sequence lengths [bs]) and ``at`` [>= T];
    ``scratch``: (cache entry, state slot, block) of the padding."""
    _check(src, dst, q)
    bs, B = dst[3].shape[0], src[1].shape[0] - 1
    entry, slot, block = scratch
    w, W = src[5].shape[1], dst[4].shape[1]
    fast(fill_step_kernel)[(bs, cdiv(W, BW))](*src, *dst, B, w, W, max(src[5].stride(0), 1), entry, slot, block,
                                  Q=q, QP=next_power_of_2(q), BW=BW, num_warps=1)


def fill_step_ref(src: tuple, dst: tuple, q: int, scratch: tuple[int, int, int]) -> None:
    """``fill_step_launch``'s contract in tensor ops."""
    _check(src, dst, q)
    src_ids, cu, src_slot, src_pos, src_state, src_table, src_seq = src
    ids, slot, pos, state, table, seq, at = dst
    entry, scratch_slot, scratch_block = scratch
    bs, B, T, w = state.shape[0], cu.shape[0] - 1, src_ids.shape[0], src_table.shape[1]
    rows = torch.repeat_interleave(torch.arange(B, device=cu.device), (cu[1:] - cu[:-1]).long(), output_size=T)
    where = rows * q + torch.arange(T, device=cu.device) - cu.long()[rows]
    ids.zero_()
    slot.fill_(entry)
    pos.view(bs, q)[:B] = (src_seq - 1)[:, None]
    pos.view(bs, q)[B:] = 1
    ids[where], slot[where], pos[where] = src_ids, src_slot, src_pos
    at[:T] = where
    state[:B], state[B:] = src_state, scratch_slot
    table[:B, :w], table[:B, w:], table[B:] = src_table, 0, scratch_block
    seq[:B], seq[B:] = src_seq, 2


def fill_step(src: tuple, dst: tuple, q: int, scratch: tuple[int, int, int]) -> None:
    """``fill_step_launch``'s contract, by the kernel where the tensors run one, else by ``fill_step_ref``."""
    if use_triton(dst[0], src[0]):
        fill_step_launch(src, dst, q, scratch)
    else:
        fill_step_ref(src, dst, q, scratch)


def _check_chain(src: tuple, dst: tuple) -> None:
    positions, caps, src_table = src
    table, slot, pos, seq = dst
    n, bs = positions.shape[0], table.shape[0]
    if n > bs or caps.shape[0] != n or src_table.shape[0] < n or src_table.shape[1] > table.shape[1]:
        raise ValueError(f"fill_chain: {n} rows of width {src_table.shape[1]} do not fit {bs} rows of width "
                         f"{table.shape[1]}")
    if (slot.dtype != torch.int64 or any(t.dtype != torch.int32 for t in (caps, src_table, table, pos, seq))
            or slot.shape != pos.shape or pos.shape != seq.shape or slot.shape[-1] != bs
            or not all(t.is_contiguous() for t in (*src, *dst))):
        raise ValueError("fill_chain: int32 caps, tables, positions and lengths, int64 slots, [k - 1, bs], contiguous")


def fill_chain_launch(src: tuple, dst: tuple, block_size: int, scratch: tuple[int, int]) -> None:
    """``src``: each row's next position [n] (any integer dtype), table capacity in tokens [n] and block table
    [>= n, w]; ``dst``: the chain's block tables [bs, W] and per step slots, positions and sequence lengths
    [k - 1, bs]; ``scratch``: (cache entry, block)."""
    _check_chain(src, dst)
    positions, caps, src_table = src
    table, slot, pos, seq = dst
    steps, bs = slot.shape[0], table.shape[0]
    grid = (bs, cdiv(table.shape[1], BW))
    fast(fill_chain_kernel)[grid](positions, caps, src_table, table, slot, pos, seq, positions.shape[0],
                                   src_table.shape[1], table.shape[1], bs, max(src_table.stride(0), 1), block_size,
                                   *scratch, STEPS=steps, SP=max(1, next_power_of_2(steps)), BW=BW, num_warps=1)


def fill_chain_ref(src: tuple, dst: tuple, block_size: int, scratch: tuple[int, int]) -> None:
    """``fill_chain_launch``'s contract in tensor ops."""
    _check_chain(src, dst)
    positions, caps, src_table = src
    table, slot, pos, seq = dst
    (steps, bs), n, w = slot.shape, positions.shape[0], src_table.shape[1]
    entry, block = scratch
    table[:n, :w], table[:n, w:], table[n:] = src_table[:n], 0, block
    slot.fill_(entry)
    pos.fill_(1)
    if n and steps:
        p0, cap = positions.long(), caps.long()
        own = (cap - p0).clamp(min=0, max=steps)
        j = torch.arange(steps, device=slot.device)[:, None]
        p = torch.minimum(p0[None, :] + j, cap[None, :] - 1)
        blocks = src_table[:n].long().gather(1, (p // block_size).T).T
        slot[:, :n] = torch.where(j < own[None, :], blocks * block_size + p % block_size, entry)
        pos[:, :n] = p.int()
    torch.add(pos, 1, out=seq)


def fill_chain(src: tuple, dst: tuple, block_size: int, scratch: tuple[int, int]) -> None:
    """``fill_chain_launch``'s contract, by the kernel where the tensors run one, else by ``fill_chain_ref``."""
    if use_triton(dst[0], src[2]):
        fill_chain_launch(src, dst, block_size, scratch)
    else:
        fill_chain_ref(src, dst, block_size, scratch)

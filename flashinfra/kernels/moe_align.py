"""The sorted dispatch of the fused MoE (``fused_moe.py``): the ``T * k`` (token, expert) pairs grouped by expert
in runs padded to the GEMMs' ``BM``-row blocks, with the expert of each block. A counting sort on the device, with
no host sync, so that it can be captured in a CUDA graph: two launches, one program counting the pairs per expert
(a histogram), laying out the padded runs (a prefix sum), naming each block's expert and setting every row to the
padding sentinel, then one placing each pair in its expert's run (tensor ops would take a dozen launches per MoE
layer: host time in an eager step, a graph node each in a decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import fast


@triton.jit
def moe_place_kernel(ids, starts, fill, sorted_ids, num_pairs, BLOCK: tl.constexpr):
    """Each pair takes the next free row of its expert's run (an atomic counter per expert)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < num_pairs
    e = tl.load(ids + o, mask=m, other=0)
    row = tl.load(starts + e, mask=m, other=0) + tl.atomic_add(fill + e, 1, mask=m)
    tl.store(sorted_ids + row, o.to(tl.int32), mask=m)


@triton.jit
def moe_layout_kernel(ids, sorted_ids, expert_ids, starts, fill, used, num_pairs, num_experts, S,
                      BM: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr):
    """One program: the pairs per expert, each expert's run padded to ``BM`` rows and where it starts (``starts``),
    the rows used (``used``), the expert of each ``BM`` block (the last expert past the used rows), every row of
    ``sorted_ids`` set to the padding sentinel ``num_pairs`` and the place kernel's counters zeroed."""
    o_e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for off in range(0, num_pairs, BLOCK):
        o = off + tl.arange(0, BLOCK)
        e = tl.load(ids + o, mask=o < num_pairs, other=E_P2 - 1)  # masked lanes: the spare last bin, dropped below
        counts += tl.histogram(e, E_P2)
    counts = tl.where(o_e < num_experts, counts, 0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(starts + o_e, ends - padded)
    tl.store(fill + o_e, tl.zeros([E_P2], dtype=tl.int32))
    tl.store(used, tl.sum(padded, 0))
    for off in range(0, S // BM, BB):
        b = off + tl.arange(0, BB)
        ended = (ends[None, :] <= (b * BM)[:, None]) & (o_e[None, :] < num_experts)  # experts whose run ends before
        tl.store(expert_ids + b, tl.minimum(tl.sum(ended.to(tl.int32), 1), num_experts - 1), mask=b < S // BM)
    for off in range(0, S, BLOCK):
        o = off + tl.arange(0, BLOCK)
        tl.store(sorted_ids + o, num_pairs, mask=o < S)


def moe_align(topk_ids: torch.Tensor, num_experts: int, BM: int):
    """-> (sorted pair ids [S] int32 (padding: T*k), expert of each BM block [S / BM] int32, used length [1]).

    The order of pairs inside an expert's run follows the atomics (it varies from run to run), which
    changes no result: each row of a GEMM tile is computed on its own, and ``moe_sum_kernel`` adds a
    token's pair outputs in pair order."""
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    Tk, dev = flat.numel(), flat.device
    S = triton.cdiv(min(Tk + num_experts * (BM - 1), Tk * BM), BM) * BM
    E_P2 = triton.next_power_of_2(num_experts + 1)  # a spare bin for the masked lanes
    sorted_ids = torch.empty(S, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(S // BM, dtype=torch.int32, device=dev)
    scratch = torch.empty(2 * E_P2 + 4, dtype=torch.int32, device=dev)  # starts, counters, used (16-byte aligned)
    starts, fill, used = scratch[:E_P2], scratch[E_P2 : 2 * E_P2], scratch[2 * E_P2 : 2 * E_P2 + 1]
    BLOCK = 256
    fast(moe_layout_kernel)[(1,)](flat, sorted_ids, expert_ids, starts, fill, used, Tk, num_experts, S, BM=BM,
                                  E_P2=E_P2, BLOCK=1024, BB=max(1, 8192 // E_P2), num_warps=8)
    fast(moe_place_kernel)[(triton.cdiv(Tk, BLOCK),)](flat, starts, fill, sorted_ids, Tk, BLOCK=BLOCK, num_warps=4)
    return sorted_ids, expert_ids, used

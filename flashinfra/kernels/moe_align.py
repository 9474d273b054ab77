"""The sorted dispatch of the fused MoE (``fused_moe.py``): the ``T * k`` (token, expert) pairs grouped by expert
in runs padded to the GEMMs' ``BM``-row blocks, with the expert of each block. A counting sort on the device, with
no host sync, so that it can be captured in a CUDA graph, in three launches after zeroing the counters:
``moe_count_kernel`` counts the pairs per expert over many programs (a histogram each, added atomically);
``moe_layout_kernel``, one program, lays out the padded runs (a prefix sum), names each block's expert and writes
the padding sentinel into each run's tail; ``moe_place_kernel`` puts each pair in its expert's run. (Tensor ops would
take a dozen launches per MoE layer: host time in an eager step, a graph node each in a decode step; one program
counting a prompt's tens of thousands of pairs took a few hundred microseconds on one SM.)

The GEMMs stop at the rows used (``used``): what lies past them in ``sorted_ids`` and ``expert_ids`` is never read and
is left unwritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import fast

COUNT_BLOCK = 4096  # pairs per counting program


@triton.jit
def moe_count_kernel(ids, counts, num_pairs, E_P2: tl.constexpr, BLOCK: tl.constexpr):
    """The pairs of one block per expert, added to ``counts`` (zeroed before)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids + o, mask=o < num_pairs, other=E_P2 - 1)  # masked lanes: the spare last bin, never read
    o_e = tl.arange(0, E_P2)
    h = tl.histogram(e, E_P2)
    tl.atomic_add(counts + o_e, h, mask=(h > 0) & (o_e < E_P2 - 1), sem="relaxed")


@triton.jit
def moe_layout_kernel(counts, sorted_ids, expert_ids, starts, used, num_pairs, num_experts, BM: tl.constexpr,
                      E_P2: tl.constexpr):
    """One program: each expert's run padded to ``BM`` rows and where it starts (``starts``), the rows used
    (``used``), the expert of each used ``BM`` block and the sentinel ``num_pairs`` in each run's padding rows."""
    o_e = tl.arange(0, E_P2)
    m_e = o_e < num_experts
    n = tl.load(counts + o_e, mask=m_e, other=0)
    padded = (n + BM - 1) // BM * BM
    start = tl.cumsum(padded, 0) - padded
    tl.store(starts + o_e, start)
    tl.store(used, tl.sum(padded, 0))
    for j in range(0, tl.max(padded, 0) // BM):  # the j-th block of every expert that has one
        tl.store(expert_ids + start // BM + j, o_e, mask=m_e & (j * BM < padded))
    for j in range(0, BM - 1):  # the j-th padding row of every run with one
        tl.store(sorted_ids + start + n + j, tl.zeros([E_P2], dtype=tl.int32) + num_pairs, mask=m_e & (n + j < padded))


@triton.jit
def moe_place_kernel(ids, starts, fill, sorted_ids, num_pairs, BLOCK: tl.constexpr):
    """Each pair takes the next free row of its expert's run (an atomic counter per expert)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < num_pairs
    e = tl.load(ids + o, mask=m, other=0)
    row = tl.load(starts + e, mask=m, other=0) + tl.atomic_add(fill + e, 1, mask=m)
    tl.store(sorted_ids + row, o.to(tl.int32), mask=m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, BM: int):
    """-> (sorted pair ids [S] int32 (padding: T*k), expert of each BM block [S / BM] int32, used length [1]); only
    the first ``used`` rows and ``used / BM`` blocks are written.

    The order of pairs inside an expert's run follows the atomics (it varies from run to run), which
    changes no result: each row of a GEMM tile is computed on its own, and ``moe_sum_kernel`` adds a
    token's pair outputs in pair order."""
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    Tk, dev = flat.numel(), flat.device
    S = triton.cdiv(min(Tk + num_experts * (BM - 1), Tk * BM), BM) * BM
    E_P2 = triton.next_power_of_2(num_experts + 1)  # a spare bin for the masked lanes
    sorted_ids = torch.empty(S, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(S // BM, dtype=torch.int32, device=dev)
    # counts, starts, counters, used; each 16-byte aligned
    scratch = torch.zeros(3 * E_P2 + 4, dtype=torch.int32, device=dev)
    counts, starts = scratch[:E_P2], scratch[E_P2:2 * E_P2]
    fill, used = scratch[2 * E_P2:3 * E_P2], scratch[3 * E_P2:3 * E_P2 + 1]
    if Tk:  # one block size whatever the batch: no compilation per size
        fast(moe_count_kernel)[(triton.cdiv(Tk, COUNT_BLOCK),)](flat, counts, Tk, E_P2=E_P2, BLOCK=COUNT_BLOCK,
                                                                 num_warps=4)
    fast(moe_layout_kernel)[(1,)](counts, sorted_ids, expert_ids, starts, used, Tk, num_experts, BM=BM,
                                  E_P2=E_P2, num_warps=4)
    if Tk:
        fast(moe_place_kernel)[(triton.cdiv(Tk, 256),)](flat, starts, fill, sorted_ids, Tk, BLOCK=256, num_warps=4)
    return sorted_ids, expert_ids, used

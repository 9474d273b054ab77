"""The sorted dispatch of the fused MoE (``fused_moe.py``): each token's ``k`` routed (token, expert) pairs and its
pair with the shared expert, grouped by expert in runs padded to the GEMMs' ``BM``-row blocks, with the expert of each
block. Pair ``p`` is token ``p // (k + 1)``'s routed choice ``p % (k + 1)``, or for the last of each token the shared
expert (id ``E``): the router's ``[T, k]`` ids are read as they are, with no ``[T, k + 1]`` copy.

A counting sort on the device, with no host sync, so that it can be captured in a CUDA graph. Up to ``ONE_PROGRAM``
pairs (decode batches, short prompts) ``moe_align_one_kernel`` does it all in one program: count, lay out, place.
Past that, three launches after zeroing the counters: ``moe_count_kernel`` counts the pairs per expert over many
programs (a histogram each, added atomically); ``moe_layout_kernel``, one program, lays out the padded runs (a prefix
sum), names each block's expert and writes the padding sentinel into each run's tail; ``moe_place_kernel`` puts each
pair in its expert's run. (Tensor ops would take a dozen launches per MoE layer: host time in an eager step, a graph
node each in a decode step; one program counting a prompt's tens of thousands of pairs took a few hundred
microseconds on one SM.)

The GEMMs stop at the rows used (``used``): what lies past them in ``sorted_ids`` and ``expert_ids`` is never read and
is left unwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait

COUNT_BLOCK = 4096  # pairs per counting program
ONE_PROGRAM = 2048  # the most pairs one program aligns on its own
ONE_PROGRAM_SMALL = 256  # its block for up to this many (decode batches up to 28 rows)


@triton.jit
def _pair_expert(ids, o, m, K: tl.constexpr, E, E_P2: tl.constexpr):
    """The expert of pairs ``o``: token ``o // (K + 1)``'s routed ids, then the shared expert ``E``; the spare last
    bin ``E_P2 - 1`` (never read) for the masked lanes."""
    t = o // (K + 1)
    j = o - t * (K + 1)
    e = tl.load(ids + t * K + j, mask=m & (j < K), other=0)
    return tl.where(m, tl.where(j < K, e, E), E_P2 - 1)


@triton.jit
def _layout(counts, sorted_ids, expert_ids, starts, used, num_pairs, E, BM: tl.constexpr, E_P2: tl.constexpr,
            FILL_ALL: tl.constexpr = False):
    """From the pair counts per expert (``counts`` [E_P2], the experts' lanes): each expert's run padded to ``BM``
    rows and where it starts (stored at ``starts``), the rows used, the expert of each used ``BM`` block and the
    sentinel ``num_pairs`` in each run's padding rows. ``FILL_ALL``: the sentinel in every used row instead, which
    the placement then overwrites where a pair goes (a few contiguous stores for a few pairs, where the tails' are
    ``BM - 1`` scattered ones over every expert's lane)."""
    o_e = tl.arange(0, E_P2)
    m_e = o_e <= E
    n = tl.where(m_e, counts, 0)
    padded = (n + BM - 1) // BM * BM
    start = tl.cumsum(padded, 0) - padded
    total = tl.sum(padded, 0)
    tl.store(starts + o_e, start)
    tl.store(used, total)
    for j in range(0, tl.max(padded, 0) // BM):  # the j-th block of every expert that has one
        tl.store(expert_ids + start // BM + j, o_e, mask=m_e & (j * BM < padded))
    sentinel = tl.zeros([E_P2], dtype=tl.int32) + num_pairs
    if FILL_ALL:
        for r0 in range(0, total, E_P2):
            tl.store(sorted_ids + r0 + o_e, sentinel, mask=r0 + o_e < total)
    else:
        for j in range(0, BM - 1):  # the j-th padding row of every run with one
            tl.store(sorted_ids + start + n + j, sentinel, mask=m_e & (n + j < padded))


@triton.jit
def _place(e, o, m, starts, fill, sorted_ids):
    """Pairs ``o`` (of experts ``e``) each take the next free row of their expert's run: its start plus an atomic
    counter per expert (``fill``, zeroed before)."""
    row = tl.load(starts + e, mask=m, other=0) + tl.atomic_add(fill + e, 1, mask=m)
    tl.store(sorted_ids + row, o.to(tl.int32), mask=m)


@triton.jit
def moe_count_kernel(ids, counts, num_pairs, E, K: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """The pairs of one block per expert, added to ``counts`` (zeroed before)."""
    pdl_wait(PDL)
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = _pair_expert(ids, o, o < num_pairs, K, E, E_P2)
    o_e = tl.arange(0, E_P2)
    h = tl.histogram(e, E_P2)
    tl.atomic_add(counts + o_e, h, mask=(h > 0) & (o_e < E_P2 - 1), sem="relaxed")


@triton.jit
def moe_layout_kernel(counts, sorted_ids, expert_ids, starts, used, num_pairs, E, BM: tl.constexpr,
                      E_P2: tl.constexpr):
    """One program: ``_layout`` of the counts the counting programs added up."""
    _layout(tl.load(counts + tl.arange(0, E_P2)), sorted_ids, expert_ids, starts, used, num_pairs, E, BM, E_P2)


@triton.jit
def moe_place_kernel(ids, starts, fill, sorted_ids, num_pairs, E, K: tl.constexpr, E_P2: tl.constexpr,
                     BLOCK: tl.constexpr):
    """A block of pairs placed in their experts' runs (``_place``)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < num_pairs
    _place(_pair_expert(ids, o, m, K, E, E_P2), o, m, starts, fill, sorted_ids)


@triton.jit(do_not_specialize=["num_pairs"])  # the batch's pair count: one compilation for each BLOCK
def moe_align_one_kernel(ids, scratch, sorted_ids, expert_ids, used, num_pairs, E, K: tl.constexpr,
                         E_P2: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program, all ``num_pairs`` (at most ``BLOCK``) pairs: their counts (a histogram in registers), the layout,
    then each pair placed by an atomic counter per expert that this program zeroes first (``scratch``: the starts,
    then the counters)."""
    pdl_wait(PDL)
    align_one(ids, scratch, sorted_ids, expert_ids, used, num_pairs, E, K, E_P2, BM, BLOCK)


@triton.jit
def align_one(ids, scratch, sorted_ids, expert_ids, used, num_pairs, E, K: tl.constexpr, E_P2: tl.constexpr,
              BM: tl.constexpr, BLOCK: tl.constexpr):
    """``moe_align_one_kernel``'s work, in the calling program."""
    o = tl.arange(0, BLOCK)
    m = o < num_pairs
    e = _pair_expert(ids, o, m, K, E, E_P2)
    o_e = tl.arange(0, E_P2)
    tl.store(scratch + E_P2 + o_e, tl.zeros([E_P2], dtype=tl.int32))
    _layout(tl.histogram(e, E_P2), sorted_ids, expert_ids, scratch, used, num_pairs, E, BM, E_P2, FILL_ALL=True)
    tl.debug_barrier()  # the starts, the zeroed counters and the sentinels, seen by every thread of the program
    _place(e, o, m, scratch, scratch + E_P2, sorted_ids)


class Aligned(NamedTuple):
    """``moe_align``'s result, laid out for ``block_rows``-row blocks."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    used: torch.Tensor
    block_rows: int


def bins(num_experts: int) -> int:
    """The counting sort's bins: the routed experts, the shared one, and a spare for the masked lanes."""
    return next_power_of_2(num_experts + 2)


def aligned_buffers(T: int, k: int, num_experts: int, BM: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_ids`` and ``expert_ids`` for ``T`` tokens of ``k`` routed pairs and a shared one, in the longest
    layout their runs can take."""
    n = T * (k + 1)
    S = cdiv(min(n + (num_experts + 1) * (BM - 1), n * BM), BM) * BM
    return (torch.empty(S, dtype=torch.int32, device=device),
            torch.empty(S // BM, dtype=torch.int32, device=device))


def one_program_scratch(num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_one``'s scratch (starts, counters, used; each 16-byte aligned; the counters zeroed by the program)
    and the used length in it."""
    E_P2 = bins(num_experts)
    scratch = torch.empty(2 * E_P2 + 4, dtype=torch.int32, device=device)
    return scratch, scratch[2 * E_P2:2 * E_P2 + 1]


def moe_align(topk_ids: torch.Tensor, num_experts: int, BM: int):
    """topk_ids [T, k] of ``num_experts`` routed experts; every token also pairs with the shared expert
    ``num_experts`` -> (sorted pair ids [S] int32 (padding: ``T (k + 1)``), expert of each BM block [S / BM] int32,
    used length [1]); only the first ``used`` rows and ``used / BM`` blocks are written.

    The order of pairs inside an expert's run follows the atomics (it varies from run to run), which
    changes no result: each row of a GEMM tile is computed on its own, and ``moe_sum_kernel`` adds a
    token's pair outputs in pair order."""
    ids = topk_ids.to(torch.int32).contiguous()
    T, k = ids.shape
    E, n, dev = num_experts, T * (k + 1), ids.device
    E_P2 = bins(E)
    sorted_ids, expert_ids = aligned_buffers(T, k, E, BM, dev)
    if n <= ONE_PROGRAM:
        scratch, used = one_program_scratch(E, dev)
        # two block sizes (decode batches, the rest): two compilations whatever the batch
        fast(moe_align_one_kernel)[(1,)](ids, scratch, sorted_ids, expert_ids, used, n, E, K=k, E_P2=E_P2, BM=BM,
                                         BLOCK=ONE_PROGRAM_SMALL if n <= ONE_PROGRAM_SMALL else ONE_PROGRAM,
                                         num_warps=4)
        return sorted_ids, expert_ids, used
    # counts, starts, counters, used; each 16-byte aligned
    scratch = torch.zeros(3 * E_P2 + 4, dtype=torch.int32, device=dev)
    counts, starts = scratch[:E_P2], scratch[E_P2:2 * E_P2]
    fill, used = scratch[2 * E_P2:3 * E_P2], scratch[3 * E_P2:3 * E_P2 + 1]
    # one block size whatever the batch: no compilation per size
    fast(moe_count_kernel)[(cdiv(n, COUNT_BLOCK),)](ids, counts, n, E, K=k, E_P2=E_P2, BLOCK=COUNT_BLOCK,
                                                    num_warps=4)
    fast(moe_layout_kernel)[(1,)](counts, sorted_ids, expert_ids, starts, used, n, E, BM=BM, E_P2=E_P2, num_warps=4)
    fast(moe_place_kernel)[(cdiv(n, 256),)](ids, starts, fill, sorted_ids, n, E, K=k, E_P2=E_P2, BLOCK=256,
                                            num_warps=4)
    return sorted_ids, expert_ids, used

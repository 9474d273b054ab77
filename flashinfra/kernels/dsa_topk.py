"""Top-k of the DSA indexer's scores per query, by row length (``select``): a sort of the whole row in Triton up to
``SORT_MAX_POOLS`` pools (``sort_launch``), a radix select in Triton up to ``RADIX_MAX_POOLS`` (``topk_launch``),
``torch.topk`` over the int64 sort keys above (``topk_ref``).

Input: ``scores [R, P]`` int32, the order-preserving bits of each (query, pool) float score as
``index_score_kernel`` writes them (``score_bits``: a float's bits, the negative ones' magnitude bits flipped, so
integer order is float order; ±0 is +0). Output: ``[R, k]`` int64 sort keys ``score_bits << 32 | pool``, per row the
``k`` largest in descending order: bit for bit what ``torch.topk`` returns on those keys (``topk_ref``), so ties of
score go to the more recent (larger) pool, and the order is the same. The order matters downstream: the positions
list keeps it, and sparse MLA sums over the positions in that order. Every path gives these bits: the keys are
distinct (the pool in the low word), so the top ``k`` and their descending order are unique.

Sort (``sort_kernel``, rows of at most ``SORT_MAX_POOLS`` pools): one program per row loads the row's ``P`` keys as
one block of ``BN`` (``P`` rounded up to a power of two; the lanes past ``P`` hold the int64 minimum, which no key is
below, so they sort last), sorts it descending (``tl.sort``) and stores the first ``k``. One pass over the scores
and one sort of ``BN`` keys, whatever ``k``.

Radix select (``topk_kernel``): one program selects the top ``kk = min(k, n)`` of a sequence of ``n`` keys,
streamed in blocks of ``BN``:

1. three histogram passes over the score bits (as unsigned: bits 31-21, 20-10, 9-0; 2048 bins), each over the
   keys that share the prefix found so far, find the ``kk``-th largest score ``thr`` and how many keys equal to it
   are taken (``need``);
2. a compaction pass writes the keys above ``thr`` and, of those equal to it, the ``need`` of the largest pools
   (the ones ``torch.topk`` keeps), in the program's order;
3. the ``kk`` keys, read back, are sorted (``tl.sort``, descending) and written in place.

A row of ``P <= max(CHUNK, 4k)`` pools is one program, which reads the pools in order and keeps the last ``need``
equal ones. A longer row goes in two launches, no host sync between: (a) per chunk of ``C`` pools its top ``k``
into a candidate buffer ``[R, nc, k]``, each list sorted; (b) per row the top ``k`` of the candidates, read from
the last chunk's list down, so that equal scores come largest pool first (a list is sorted, and every pool of a
chunk is larger than every pool of the chunks before), and the first ``need`` equal ones are kept. Each row's top
``k`` lies in the union of its chunks' top ``k``.

The passes read a chunk four times; a chunk (64 KB) stays in L1/L2 between passes, so the scores cross HBM once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import fast

# pools per program of the first launch when a row is split; at 1M context (262,144 pools) 16 programs per row
CHUNK = 16384
# keys per block of a program's passes
BLOCK = 2048
NB = 2048  # histogram bins: 11 bits a pass


@triton.jit
def _keys(src, i_t, i_c, j, n, P, k, C, FROM_SCORES: tl.constexpr):
    """Keys at positions ``j`` of program (i_t, i_c)'s sequence -> (unsigned score bits, int64 key, valid)."""
    m = j < n
    if FROM_SCORES:  # pools of chunk i_c, in order
        pool = i_c * C + j
        hi = tl.load(src + i_t.to(tl.int64) * P + pool, mask=m, other=0)
        key = (hi.to(tl.int64) << 32) | pool.to(tl.int64)
    else:  # the chunks' candidate lists, the last chunk's first
        nc = n // k
        c = nc - 1 - j // k
        m = m & (j % k < tl.minimum(P - c * C, k))
        key = tl.load(src + (i_t.to(tl.int64) * nc + c) * k + j % k, mask=m, other=0)
        hi = (key >> 32).to(tl.int32)
    return (hi ^ -2147483648).to(tl.uint32, bitcast=True), key, m


@triton.jit
def _digit_pass(src, i_t, i_c, n, P, k, C, pre, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, FIRST: tl.constexpr,
                FROM_SCORES: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    """One radix digit: among the keys whose bits above ``SHIFT + WIDTH`` equal ``pre``, the digit value holding
    the ``need``-th largest -> (prefix extended by it, how many keys with that prefix are still needed, how many
    keys have it)."""
    hist = tl.zeros([NB], dtype=tl.int32)
    for j0 in range(0, n, BN):
        u, key, m = _keys(src, i_t, i_c, j0 + tl.arange(0, BN), n, P, k, C, FROM_SCORES)
        if not FIRST:
            m = m & ((u >> (SHIFT + WIDTH)) == pre)
        hist += tl.histogram(((u >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32), NB, mask=m)
    at_least = tl.cumsum(hist, 0, reverse=True)  # [NB] keys with this digit or a larger one
    b = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    o_b = tl.arange(0, NB)
    above = tl.sum(tl.where(o_b > b, hist, 0), 0)
    return (pre << WIDTH) | b.to(tl.uint32), need - above, tl.sum(tl.where(o_b == b, hist, 0), 0)


@triton.jit(do_not_specialize=["P", "k", "C"])  # sizes that vary with the context: one compilation for all
def topk_kernel(src, out, P, k, C, FROM_SCORES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                NB: tl.constexpr):
    """Program (row, chunk): the chunk's top ``min(k, n)`` keys, sorted descending, at ``out`` row ``row * nc +
    chunk`` (``nc`` programs per row). ``FROM_SCORES``: the chunk is pools ``[chunk * C, chunk * C + C)`` of
    ``src [R, P]`` int32; else ``src [R, nc', k]`` holds a row's chunk lists and the program reads them all."""
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    if FROM_SCORES:
        n = tl.minimum(C, P - i_c * C)
    else:
        n = tl.cdiv(P, C) * k
    kk = tl.minimum(k, n)
    pre = tl.zeros([], dtype=tl.uint32)
    pre, need, _ = _digit_pass(src, i_t, i_c, n, P, k, C, pre, kk, 21, 11, True, FROM_SCORES, BN, NB)
    pre, need, _ = _digit_pass(src, i_t, i_c, n, P, k, C, pre, need, 10, 11, False, FROM_SCORES, BN, NB)
    thr, need, equal = _digit_pass(src, i_t, i_c, n, P, k, C, pre, need, 0, 10, False, FROM_SCORES, BN, NB)
    # the keys equal to thr that torch.topk keeps are those of the largest pools: the last ``need`` of a chunk's
    # pools, the first ``need`` of the candidate lists
    skip = equal - need if FROM_SCORES else 0
    p_out = out + (i_t.to(tl.int64) * tl.num_programs(1) + i_c) * k
    taken = 0
    ties = 0
    for j0 in range(0, n, BN):
        u, key, m = _keys(src, i_t, i_c, j0 + tl.arange(0, BN), n, P, k, C, FROM_SCORES)
        eq = m & (u == thr)
        rank = ties + tl.cumsum(eq.to(tl.int32), 0) - skip  # 1-based among the kept equal keys
        sel = (m & (u > thr)) | (eq & (rank > 0) & (rank <= need))
        tl.store(p_out + taken + tl.cumsum(sel.to(tl.int32), 0) - 1, key, mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()  # the keys written above are read back by other threads of the program
    o_k = tl.arange(0, BK)
    b_top = tl.load(p_out + o_k, mask=o_k < kk, other=-9223372036854775808)
    b_top = tl.sort(b_top, 0, descending=True)
    tl.debug_barrier()
    tl.store(p_out + o_k, b_top, mask=o_k < kk)


@triton.jit(do_not_specialize=["P", "k"])  # sizes that vary with the context: one compilation per BN
def sort_kernel(scores, out, P, k, BN: tl.constexpr):
    """Program ``row``: the top ``k`` keys of row ``row`` of ``scores [R, P]`` (``P <= BN``), sorted descending, at
    ``out [R, k]`` row ``row``."""
    i_t = tl.program_id(0)
    o = tl.arange(0, BN)
    _, key, m = _keys(scores, i_t, 0, o, P, P, k, P, True)  # chunk 0 of P pools: the whole row
    key = tl.sort(tl.where(m, key, -9223372036854775808), 0, descending=True)
    tl.store(out + i_t.to(tl.int64) * k + o, key, mask=o < k)


def _launch(src, out, grid, P: int, k: int, C: int, n: int, from_scores: bool) -> None:
    BN = min(BLOCK, triton.next_power_of_2(n))
    fast(topk_kernel)[grid](src, out, P, k, C, FROM_SCORES=from_scores, BN=BN, BK=triton.next_power_of_2(k), NB=NB,
                            num_warps=8 if BN >= 1024 else 4)


def _output(name: str, scores: torch.Tensor, k: int, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a new ``[R, k]`` int64 tensor, once ``scores`` and ``k`` are checked for a launch."""
    R, P = scores.shape
    if not 1 <= k <= P or scores.dtype != torch.int32 or scores.stride() != (P, 1):
        raise ValueError(f"{name}: k={k} of {tuple(scores.shape)} {scores.dtype} strides {scores.stride()}")
    return torch.empty(R, k, dtype=torch.int64, device=scores.device) if out is None else out


def sort_launch(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, P] int32 (rows contiguous), 1 <= k <= P -> [R, k] int64: ``topk_ref``'s values, bit for bit, by
    one program per row that holds all ``P`` keys at once (short rows: ``select`` takes it up to
    ``SORT_MAX_POOLS``)."""
    out = _output("sort_launch", scores, k, out)
    R, P = scores.shape
    if R == 0:
        return out
    BN = triton.next_power_of_2(P)
    # num_warps: a guess, not measured
    fast(sort_kernel)[(R,)](scores, out, P, k, BN=BN, num_warps=4 if BN <= 256 else 8)
    return out


def topk_launch(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, P] int32 (rows contiguous), 1 <= k <= P -> [R, k] int64: ``topk_ref``'s values, bit for bit, by
    the radix select."""
    out = _output("topk_launch", scores, k, out)
    R, P = scores.shape
    if R == 0:
        return out
    C = max(CHUNK, 4 * k)
    if P <= C:
        _launch(scores, out, (R, 1), P, k, P, P, True)
        return out
    nc = triton.cdiv(P, C)
    cand = torch.empty(R, nc, k, dtype=torch.int64, device=scores.device)
    _launch(scores, cand, (R, nc), P, k, C, C, True)
    _launch(cand, out, (R, 1), P, k, C, nc * k, False)
    return out


def topk_bytes(R: int, P: int, k: int) -> int:
    """Bytes ``topk_launch`` moves through HBM: the scores read once, the candidates written and read, the keys
    written."""
    C = max(CHUNK, 4 * k)
    cand = 0 if P <= C else 2 * R * triton.cdiv(P, C) * k * 8
    return 4 * R * P + cand + 8 * R * k


def score_bits(score: torch.Tensor) -> torch.Tensor:
    """float32 scores -> the int32 ``index_score_kernel`` writes: integer order is float order, -0 is +0."""
    bits = torch.where(score == 0, torch.zeros_like(score), score).float().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def topk_ref(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``torch.topk`` over the int64 keys ``score_bits << 32 | pool`` (distinct, so one answer)."""
    pools = torch.arange(scores.shape[1], device=scores.device)
    top = torch.topk((scores.long() << 32) | pools, k, dim=1).values
    return top if out is None else out.copy_(top)


# Rows of at most SORT_MAX_POOLS pools take the sort, those of at most RADIX_MAX_POOLS the radix select, longer ones
# ``torch.topk`` over the keys (bench/notes/dsa_indexer.md: the radix select measured faster than ``torch.topk`` at
# 1,024 pools, slower from 2,048; SORT_MAX_POOLS is a guess until the sort is measured there against both). While
# the two are equal, no row of ``select`` takes the radix select.
SORT_MAX_POOLS = 1024
RADIX_MAX_POOLS = 1024


def select(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``topk_ref``'s keys into ``out``, by whichever of the three is faster at this row length."""
    P = scores.shape[1]
    if P <= SORT_MAX_POOLS:
        return sort_launch(scores, k, out=out)
    if P <= RADIX_MAX_POOLS:
        return topk_launch(scores, k, out=out)
    return topk_ref(scores, k, out=out)

"""Top-k of the DSA indexer's scores per query, by row length (``select``): a sort of the whole row in Triton up to
``SORT_MAX_POOLS`` pools (``sort_launch``), a sampled threshold from ``THRESHOLD_MIN_POOLS`` (``threshold_launch``),
``torch.topk`` over the int64 sort keys between (``topk_ref``).

Input: ``scores [R, P]`` int32, the order-preserving bits of each (query, pool) float score as
``index_score_kernel`` writes them (``score_bits``: a float's bits, the negative ones' magnitude bits flipped, so
integer order is float order; ±0 is +0). Output: ``[R, k]`` int64 sort keys ``score_bits << 32 | pool``, per row the
``k`` largest in descending order: bit for bit what ``torch.topk`` returns on those keys (``topk_ref``), so ties of
score go to the more recent (larger) pool, and the order is the same. The order matters downstream: the positions
list keeps it, and sparse MLA sums over the positions in that order. Both paths give these bits: the keys are
distinct (the pool in the low word), so the top ``k`` and their descending order are unique.

Sort (``sort_kernel``): one program per row loads the row's ``P`` keys as one block of ``BN`` (``P`` rounded up to a
power of two; the lanes past ``P`` hold the int64 minimum, which no key is below, so they sort last), sorts it
descending (``tl.sort``) and stores the first ``k``. One pass over the scores and one sort of ``BN`` keys, whatever
``k``.

Rank select (``rank_launch``), for a few rows: each key ranked by comparison with all of its row's (the keys are
distinct, so a rank is a position in the sorted order) over many programs, each key of rank below ``k`` stored at
it: one launch that spreads a decode row's work over the GPU instead of one program's sort. With the rows' query
positions a row reads only the pools its query can see.

Threshold select (``dsa_threshold.threshold_launch``), for long rows: a sampled threshold per row, the keys above it
gathered and sorted, an exact path in chunks for a row whose candidates overflow; the same bits again.
"""

from __future__ import annotations

import bisect

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.dsa_threshold import (MIN_KEY, RANK_BLOCK, RANK_KEYS, RANK_MAX_ROWS, THRESHOLD_SAMPLES,
                                            _chunk_keys, _row_length, _visible, sample_size, threshold_launch)


# sizes that vary with the context, and views of a step's buffers at offsets that vary with it: one compilation per BN
@triton.jit(do_not_specialize=["P", "k"], do_not_specialize_on_alignment=["scores", "out"])
def sort_kernel(scores, out, P, k, BN: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``row``: the top ``k`` keys of row ``row`` of ``scores [R, P]`` (``P <= BN``), sorted descending, at
    ``out [R, k]`` row ``row``."""
    pdl_wait(PDL)
    i_t = tl.program_id(0)
    o = tl.arange(0, BN)
    hi = tl.load(scores + i_t.to(tl.int64) * P + o, mask=o < P, other=0)
    key = tl.where(o < P, (hi.to(tl.int64) << 32) | o.to(tl.int64), -9223372036854775808)
    key = tl.sort(key, 0, descending=True)
    tl.store(out + i_t.to(tl.int64) * k + o, key, mask=o < k)


def sort_launch(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, P] int32 (rows contiguous), 1 <= k <= P -> [R, k] int64: ``topk_ref``'s values, bit for bit, by
    one program per row that holds all ``P`` keys at once (short rows: ``select`` takes it up to
    ``SORT_MAX_POOLS``)."""
    R, P = scores.shape
    if not 1 <= k <= P or scores.dtype != torch.int32 or scores.stride() != (P, 1):
        raise ValueError(f"sort_launch: k={k} of {tuple(scores.shape)} {scores.dtype} strides {scores.stride()}")
    out = torch.empty(R, k, dtype=torch.int64, device=scores.device) if out is None else out
    if R == 0:
        return out
    BN = next_power_of_2(P)
    # num_warps: a guess, not measured
    fast(sort_kernel)[(R,)](scores, out, P, k, BN=BN, num_warps=4 if BN <= 256 else 8)
    return out

@triton.jit(do_not_specialize=["P", "k"])
def rank_select_kernel(scores, positions, out, P, k, KP: tl.constexpr, B: tl.constexpr, KEYS: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (row, block): its ``B`` keys of row ``row`` ranked by comparison with all of the row's first ``L``
    (``_row_length``; distinct keys, so how many lie above is the rank), each of rank below ``k`` stored there."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    L = _row_length(positions, row, P, k, KP)
    if tl.program_id(1) * B < L:
        key, m = _chunk_keys(scores, row, P, L, B)
        rank = tl.zeros([B], dtype=tl.int32)
        for c in range(0, L, KEYS):
            o = c + tl.arange(0, KEYS)
            hi = tl.load(scores + row * P + o, mask=o < L, other=0)
            other = tl.where(o < L, (hi.to(tl.int64) << 32) | o.to(tl.int64), MIN_KEY)
            rank += tl.sum((other[None, :] > key[:, None]).to(tl.int32), 1)
        tl.store(out + row * k + rank, key, mask=m & (rank < k))


def rank_launch(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                kpool: int = 0) -> torch.Tensor:
    """scores [R, P] int32 (rows contiguous), 1 <= k <= P -> [R, k] int64: ``topk_ref``'s values, bit for bit, in one
    launch of ``P / RANK_BLOCK`` programs a row that compare each key with the row's (a few rows: ``select`` takes it
    while rows x pools x pools stays within ``RANK_SELECT_COMPARES``). With the rows' query ``positions`` and
    ``kpool``, as ``threshold_launch``: a row reads only the pools its query can see where there are at least ``k``."""
    R, P = scores.shape
    if not 1 <= k <= P or scores.dtype != torch.int32 or scores.stride() != (P, 1):
        raise ValueError(f"rank_launch: k={k} of {tuple(scores.shape)} {scores.dtype} strides {scores.stride()}")
    out = torch.empty(R, k, dtype=torch.int64, device=scores.device) if out is None else out
    if R == 0:
        return out
    pos, KP = _visible(scores, positions, kpool)
    fast(rank_select_kernel)[(R, cdiv(P, RANK_BLOCK))](scores, pos, out, P, k, KP=KP, B=RANK_BLOCK,
                                                       KEYS=RANK_KEYS, num_warps=4)
    return out


def score_bits(score: torch.Tensor) -> torch.Tensor:
    """float32 scores -> the int32 ``index_score_kernel`` writes: integer order is float order, -0 is +0."""
    bits = torch.where(score == 0, torch.zeros_like(score), score).float().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def topk_ref(scores: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: ``torch.topk`` over the int64 keys ``score_bits << 32 | pool`` (distinct, so one answer)."""
    pools = torch.arange(scores.shape[1], device=scores.device)
    top = torch.topk((scores.long() << 32) | pools, k, dim=1).values
    return top if out is None else out.copy_(top)


# Rows of at least THRESHOLD_MIN_POOLS pools take the threshold select. Shorter ones take the rank select while its
# compares (rows x pools x pools) stay within RANK_SELECT_COMPARES: the first bound where the sort is the other choice
# (rows of at most SORT_MAX_POOLS), the second where it is ``torch.topk`` (bench/notes/dsa_indexer.md: the rank select
# 17-19 us up to 16M compares, 58-61 us at 134M; the sort 21-26 us at 1,024 pools whatever the rows, 55 us at 2,048;
# ``torch.topk`` 67-79 us; at 32,768 and 262,144 pools the threshold select 1.6-2.6x faster than ``torch.topk``,
# except a single decode row at 262,144, 0.93x; 16,384 lies between the two measured lengths).
SORT_MAX_POOLS = 1024
THRESHOLD_MIN_POOLS = 16384
RANK_SELECT_COMPARES = (1 << 24, 1 << 27)


def route(R: int, P: int) -> str:
    """Which select takes ``R`` rows of ``P`` pools: "threshold", "rank", "sort" or "torch"."""
    if P >= THRESHOLD_MIN_POOLS:
        return "threshold"
    short = P <= SORT_MAX_POOLS
    if R * P * P <= RANK_SELECT_COMPARES[0 if short else 1]:
        return "rank"
    return "sort" if short else "torch"


def select(scores: torch.Tensor, k: int, out: torch.Tensor, positions: torch.Tensor | None = None,
           kpool: int = 0) -> torch.Tensor:
    """``topk_ref``'s keys into ``out``, by whichever select is fastest at this many rows of this length
    (``route``); the threshold and rank selects read only the pools the rows' queries can see, given their
    ``positions`` and ``kpool``."""
    route_ = route(*scores.shape)
    if route_ in ("threshold", "rank"):
        launch = threshold_launch if route_ == "threshold" else rank_launch
        return launch(scores, k, out=out, positions=positions, kpool=kpool)
    return (sort_launch if route_ == "sort" else topk_ref)(scores, k, out=out)


def warm_up_sort(max_rows: int, k: int, device) -> int:
    """Run the sort once per block width a step of at most ``max_rows`` query rows can take it at (``route``: wide
    enough rows only past ``RANK_SELECT_COMPARES[0]`` compares; 32 prompts of 250 tokens sort 64 pools, which no
    warm-up prompt of its own does), on random scores, so that a server's first bursts compile none
    (``engine/warmup.py``). Rows shorter than ``k`` keep all their pools (``dsa_indexer.dsa_select``). -> the runs."""
    runs, BN = 0, 16
    gen = torch.Generator(device=device).manual_seed(0)
    while BN <= SORT_MAX_POOLS:
        R = RANK_SELECT_COMPARES[0] // (BN * BN) + 1  # the fewest rows of BN pools that the sort takes
        if R <= max_rows and route(R, BN) == "sort":
            scores = torch.randint(-2**31, 2**31 - 1, (R, BN), dtype=torch.int32, device=device, generator=gen)
            sort_launch(scores, min(k, BN))
            runs += 1
        BN *= 2
    return runs


def warm_up_threshold(max_pools: int, k: int, kpool: int, device) -> int:
    """Run the threshold select once per kernel variant rows of up to ``max_pools`` pools can meet (its sample size
    grows with the row, Triton specialises the pool count on its divisibility by 16, and one row takes the ranking
    kernels, more the sampling ones), on random scores, so that a long prompt compiles none of them midway
    (``engine/warmup.py``). -> how many runs."""
    lengths, P = [], THRESHOLD_MIN_POOLS
    while P <= max_pools:  # the shortest row of each sample size (which grows with the row)
        lengths.append(P)
        S = sample_size(P, k)
        if S == THRESHOLD_SAMPLES[1]:
            break
        P += bisect.bisect_right(range(P, max_pools + 1), S, key=lambda n: sample_size(n, k))
    runs = 0
    gen = torch.Generator(device=device).manual_seed(0)
    for first in lengths:
        whole = -(-first // 16) * 16  # a count 16 divides, and one it does not
        other = -(-first // 4) * 4
        other += 4 if other % 16 == 0 else 0
        for P in (whole, other):
            if P > max_pools or k > P:
                continue
            for R in (RANK_MAX_ROWS, RANK_MAX_ROWS + 1):
                scores = torch.randint(-2**31, 2**31 - 1, (R, P), dtype=torch.int32, device=device, generator=gen)
                positions = torch.full((R,), P * max(kpool, 1) - 1, dtype=torch.int32, device=device)
                threshold_launch(scores, k, positions=positions if kpool else None, kpool=kpool)
                runs += 1
    return runs

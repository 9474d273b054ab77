"""Top-k of the DSA indexer's scores per query, by row length (``select``): a sort of the whole row in Triton up to
``SORT_MAX_POOLS`` pools (``sort_launch``), ``torch.topk`` over the int64 sort keys above (``topk_ref``).

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import fast


@triton.jit(do_not_specialize=["P", "k"])  # sizes that vary with the context: one compilation per BN
def sort_kernel(scores, out, P, k, BN: tl.constexpr):
    """Program ``row``: the top ``k`` keys of row ``row`` of ``scores [R, P]`` (``P <= BN``), sorted descending, at
    ``out [R, k]`` row ``row``."""
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
    BN = triton.next_power_of_2(P)
    # num_warps: a guess, not measured
    fast(sort_kernel)[(R,)](scores, out, P, k, BN=BN, num_warps=4 if BN <= 256 else 8)
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


# Rows of at most SORT_MAX_POOLS pools take the sort, longer ones ``torch.topk`` over the keys
# (bench/notes/dsa_indexer.md: the sort measured fastest up to 1,024 pools; longer rows not yet measured against
# ``torch.topk``).
SORT_MAX_POOLS = 1024


def select(scores: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """``topk_ref``'s keys into ``out``, by whichever of the two is faster at this row length."""
    if scores.shape[1] <= SORT_MAX_POOLS:
        return sort_launch(scores, k, out=out)
    return topk_ref(scores, k, out=out)

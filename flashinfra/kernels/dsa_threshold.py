"""The DSA indexer's top-k for long rows (``dsa_topk.select`` routes rows of at least ``THRESHOLD_MIN_POOLS`` pools
here): a sampled threshold per row, the keys above it gathered and sorted, an exact path in chunks for a row whose
candidates overflow; bit for bit ``dsa_topk.topk_ref``'s keys (``dsa_topk``'s docstring has the format).

Per row: ``M`` thresholds from a sample of ``S`` keys (``threshold_sample_kernel``: sorted in one program; for a
single row ranked by comparison over many, ``threshold_rank_kernel``); how many keys lie above each
(``threshold_count_kernel``, programs of ``THRESHOLD_CHUNK`` keys); the keys above the highest threshold with at
least ``k`` above it appended to a candidate buffer (``threshold_gather_kernel``); the candidates sorted
(``threshold_finish_kernel``, or ranked for a single row, ``threshold_place_kernel``). With the rows' query
positions every pass reads only the pools a query can see (``_row_length``). The helpers that read a row's keys
(``_row_length``, ``_chunk_keys``, ``_visible``) serve ``dsa_topk``'s rank select too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import cdiv, fast, next_power_of_2


THRESHOLD_SAMPLES = (1024, 4096)  # keys sampled per row (S): at least, at most; enough that about 8 samples lie in
# the top k (k S / P >= 8), for a candidate count close to k; a row shorter than S samples the power of two below P
THRESHOLD_CHUNK = 4096  # keys per program of the count and gather passes
THRESHOLDS = 8  # candidate thresholds per row (M): sample ranks k S / P x 2 ** (j / 2), and the minimum key; the
# highest one chosen is at most 8x the top k's count, past the candidate buffer (4 KB) anyway, and each threshold is a
# compare per key in the count pass (notes/dsa_indexer.md: 16 took that pass 1.3x longer)
# Up to RANK_MAX_ROWS rows (decode), the sample's and the candidates' sorts, one program a row, become ranks by
# comparison (each key against all of its row's) in programs of RANK_BLOCK keys, RANK_KEYS compared at a time
# (notes/dsa_indexer.md: 1 row of 262,144 pools 203 -> 149 us; 16 rows 221 -> 552 us, 64 programs a row)
RANK_MAX_ROWS = 1
RANK_BLOCK, RANK_KEYS = 8, 512  # few steps: each waits on a gather's latency
MIN_KEY = tl.constexpr(-9223372036854775808)

@triton.jit
def _row_length(positions, row, P, k, KP: tl.constexpr):
    """The pools of row ``row`` the select reads: with ``positions`` (``KP`` > 0), those its query can see (the
    scoring kernel writes its least score past them) when there are at least ``k``, else the whole row."""
    if KP > 0:
        n = (tl.load(positions + row) + 1) // KP
        return tl.where(n >= k, tl.minimum(n, P), P)
    else:
        return P


@triton.jit
def _samples(L, S: tl.constexpr):
    """How many keys a row of ``L`` pools samples: ``S``, or the largest power of two within ``L`` (distinct pools);
    and its log2, so that a sample's pool is a shift rather than a 64-bit division."""
    n = 1 + 0 * L
    shift = 0 * L
    while (n * 2 <= S) & (n * 2 <= L):
        n = n * 2
        shift += 1
    return n, shift


@triton.jit
def _sample_key(scores, row, P, L, n, shift, o):
    """Row ``row``'s sample keys ``o`` (of ``n`` = ``2 ** shift``, at a stride of ``L / n``), the minimum key for
    ``o >= n``."""
    m = o < n
    pos = (o.to(tl.int64) * L) >> shift
    hi = tl.load(scores + row * P + pos, mask=m, other=0)
    return tl.where(m, (hi.to(tl.int64) << 32) | pos, MIN_KEY)


@triton.jit
def _store_thresholds(thresholds, row, k, L, n, rank, key, M: tl.constexpr, first):
    """Of keys ``key`` at sample ranks ``rank``, the ones at ranks ``k n / L x 2 ** (j / 2)`` (at most ``n - 1``) as
    row ``row``'s first ``M - 1`` thresholds (about ``k x 2 ** (j / 2)`` keys of the row lie above each), the minimum
    key as the last (where ``first`` is 1)."""
    j = tl.arange(0, M)
    want = tl.minimum((k.to(tl.float32) * n / L.to(tl.float32) * tl.exp2(j.to(tl.float32) * 0.5)).to(tl.int32), n - 1)
    hit = rank[:, None] == want[None, :]
    last = j == M - 1
    tl.store(thresholds + row * M + j, tl.where(last, MIN_KEY, tl.sum(tl.where(hit, key[:, None], 0), 0)),
             mask=((tl.max(hit.to(tl.int32), 0) > 0) & (j < M - 1)) | (last & (j * 0 + first > 0)))


@triton.jit(do_not_specialize=["P", "k"])
def threshold_sample_kernel(scores, positions, thresholds, P, k, S: tl.constexpr, M: tl.constexpr,
                            KP: tl.constexpr):
    """Program ``row``: ``M`` decreasing thresholds for row ``row`` of ``scores [R, P]`` from ``S`` keys of its
    first ``L`` pools (``_row_length``) at a stride of ``L / S``, sorted descending."""
    row = tl.program_id(0).to(tl.int64)
    L = _row_length(positions, row, P, k, KP)
    n, shift = _samples(L, S)
    o = tl.arange(0, S)
    key = tl.sort(_sample_key(scores, row, P, L, n, shift, o), 0, descending=True)
    _store_thresholds(thresholds, row, k, L, n, o, key, M, 1)


@triton.jit(do_not_specialize=["P", "k"])
def threshold_rank_kernel(scores, positions, thresholds, P, k, S: tl.constexpr, M: tl.constexpr, KP: tl.constexpr,
                          B: tl.constexpr, KEYS: tl.constexpr):
    """``threshold_sample_kernel``'s thresholds without its sort, for a few rows: program (row, block) ranks its
    ``B`` samples by comparison with all of them (how many lie above, a tie going to the lower index: the padding
    past the samples equals the minimum key) and writes those at a threshold's rank."""
    row = tl.program_id(0).to(tl.int64)
    L = _row_length(positions, row, P, k, KP)
    n, shift = _samples(L, S)
    idx = tl.program_id(1) * B + tl.arange(0, B)
    key = _sample_key(scores, row, P, L, n, shift, idx)
    rank = tl.zeros([B], dtype=tl.int32)
    for c in range(0, S, KEYS):
        o = c + tl.arange(0, KEYS)
        other = _sample_key(scores, row, P, L, n, shift, o)
        above = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (o[None, :] < idx[:, None]))
        rank += tl.sum(above.to(tl.int32), 1)
    _store_thresholds(thresholds, row, k, L, n, rank, key, M, (tl.program_id(1) == 0).to(tl.int32))


@triton.jit
def _chunk_keys(scores, row, P, L, C: tl.constexpr):
    """Program (row, chunk)'s ``C`` keys of row ``row`` (the minimum key past ``L``), their pools and mask."""
    o = tl.program_id(1) * C + tl.arange(0, C)
    m = o < L
    hi = tl.load(scores + row * P + o, mask=m, other=0)
    return tl.where(m, (hi.to(tl.int64) << 32) | o.to(tl.int64), MIN_KEY), m


@triton.jit(do_not_specialize=["P", "k"])
def threshold_count_kernel(scores, positions, thresholds, counts, P, k, C: tl.constexpr, M: tl.constexpr,
                           KP: tl.constexpr):
    """Program (row, chunk): adds to ``counts [R, M]`` how many keys of its chunk lie above each threshold, one sum
    per threshold (no histogram of the keys' threshold counts: 960 against 1,272 instructions a thread on sm_90)."""
    row = tl.program_id(0).to(tl.int64)
    L = _row_length(positions, row, P, k, KP)
    if tl.program_id(1) * C < L:
        key, _ = _chunk_keys(scores, row, P, L, C)
        for j in tl.static_range(M):  # relaxed: the counts are read by the next launch
            above = tl.sum((key > tl.load(thresholds + row * M + j)).to(tl.int32), 0)
            tl.atomic_add(counts + row * M + j, above, sem="relaxed")


@triton.jit
def _chosen(counts, row, k, M: tl.constexpr, CAP: tl.constexpr):
    """Row ``row``'s threshold: the highest with at least ``k`` keys above it; its index, its count, and whether
    they fit the candidate buffer (else the row takes the exact fallback)."""
    j = tl.arange(0, M)
    cnt = tl.load(counts + row * M + j)
    n_ge = tl.sum((cnt >= k).to(tl.int32), 0)
    chosen = M - n_ge
    total = tl.sum(tl.where(j == chosen, cnt, 0), 0)
    return chosen, total, (n_ge > 0) & (total <= CAP)


@triton.jit(do_not_specialize=["P", "k"])
def threshold_gather_kernel(scores, positions, thresholds, counts, cursor, cand, P, k, C: tl.constexpr,
                            M: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr):
    """Program (row, chunk): appends its keys above the row's threshold to ``cand [R, CAP]`` at the row's cursor, a
    relaxed atomic add per key taken (the compiler aggregates a warp's into one), not a prefix sum over the chunk for
    the few it takes: the candidates' order varies, their set does not."""
    row = tl.program_id(0).to(tl.int64)
    L = _row_length(positions, row, P, k, KP)
    chosen, total, fits = _chosen(counts, row, k, M, CAP)
    if fits & (tl.program_id(1) * C < L):
        j = tl.arange(0, M)
        t = tl.sum(tl.where(j == chosen, tl.load(thresholds + row * M + j), 0), 0)
        key, m = _chunk_keys(scores, row, P, L, C)
        take = m & (key > t)
        slot = tl.atomic_add(cursor + row + tl.zeros([C], dtype=tl.int64), 1, mask=take, sem="relaxed")
        tl.store(cand + row * CAP + slot, key, mask=take)


@triton.jit(do_not_specialize=["k"])
def threshold_place_kernel(counts, cand, out, k, M: tl.constexpr, CAP: tl.constexpr, B: tl.constexpr,
                           KEYS: tl.constexpr):
    """``threshold_finish_kernel``'s sort for a few rows: program (row, block) ranks its ``B`` candidates by
    comparison with all the row's (distinct keys) and stores those ranked below ``k`` at their rank. A row whose
    candidates did not fit is left to ``threshold_finish_kernel`` (``EXACT_ONLY``)."""
    row = tl.program_id(0).to(tl.int64)
    _, total, fits = _chosen(counts, row, k, M, CAP)
    if fits:
        o = tl.program_id(1) * B + tl.arange(0, B)
        key = tl.load(cand + row * CAP + o, mask=o < total, other=MIN_KEY)
        rank = tl.zeros([B], dtype=tl.int32)
        for c in range(0, total, KEYS):
            o_c = c + tl.arange(0, KEYS)
            other = tl.load(cand + row * CAP + o_c, mask=o_c < total, other=MIN_KEY)
            rank += tl.sum((other[None, :] > key[:, None]).to(tl.int32), 1)
        tl.store(out + row * k + rank, key, mask=(o < total) & (rank < k))


@triton.jit(do_not_specialize=["P", "k"])
def threshold_finish_kernel(scores, positions, counts, cand, out, P, k, M: tl.constexpr, CAP: tl.constexpr,
                            KB: tl.constexpr, KP: tl.constexpr, EXACT_ONLY: tl.constexpr):
    """Program ``row``: the row's top ``k`` keys into ``out [R, k]``, sorted descending: a sort of its candidates
    (unless ``EXACT_ONLY``: ``threshold_place_kernel`` placed them); or, where they did not fit (or the minimum key
    was needed), exact over the row's ``L`` pools: chunks of ``CAP - KB`` keys each sorted beside the running top
    ``k``."""
    row = tl.program_id(0).to(tl.int64)
    _, total, fits = _chosen(counts, row, k, M, CAP)
    o = tl.arange(0, CAP)
    if fits:
        if not EXACT_ONLY:
            key = tl.sort(tl.load(cand + row * CAP + o, mask=o < total, other=MIN_KEY), 0, descending=True)
            tl.store(out + row * k + o, key, mask=o < k)
    else:
        L = _row_length(positions, row, P, k, KP)
        for start in range(0, L, CAP - KB):
            run = tl.load(out + row * k + o, mask=(o < k) & (start > 0), other=MIN_KEY)
            pos = start + o - KB
            m = (o >= KB) & (pos < L)
            hi = tl.load(scores + row * P + pos, mask=m, other=0)
            key = tl.where(o < KB, run, tl.where(m, (hi.to(tl.int64) << 32) | pos.to(tl.int64), MIN_KEY))
            key = tl.sort(key, 0, descending=True)
            tl.debug_barrier()  # every lane has read the running keys before any is overwritten
            tl.store(out + row * k + o, key, mask=o < k)
            tl.debug_barrier()

def _visible(scores: torch.Tensor, positions: torch.Tensor | None, kpool: int) -> tuple[torch.Tensor, int]:
    """The kernels' ``positions`` and ``KP`` arguments: a row's query positions bound the pools it reads, or (None,
    0) the whole row."""
    if positions is None:
        return scores, 0  # unread
    if positions.shape != scores.shape[:1] or positions.dtype != torch.int32 or kpool < 1:
        raise ValueError(f"threshold select: positions {tuple(positions.shape)} {positions.dtype}, kpool {kpool} for "
                         f"{scores.shape[0]} rows")
    return positions, kpool


def threshold_counts(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None,
                     kpool: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two launches of ``threshold_launch``: per row of ``scores [R, P]`` its ``M`` decreasing thresholds
    ``[R, M]`` int64 (from a sample of ``S`` keys, ``THRESHOLD_SAMPLES``) and how many keys lie above each ``[R, M]``
    int32."""
    return _counts(scores, k, *_visible(scores, positions, kpool))


def sample_size(P: int, k: int) -> int:
    """Keys sampled per row of ``P`` pools (``S``, a constexpr of the sample kernels): about 8 in the top ``k``."""
    lo, hi = THRESHOLD_SAMPLES
    return min(max(lo, next_power_of_2(cdiv(8 * P, k))), hi, 1 << (P.bit_length() - 1))

def _counts(scores: torch.Tensor, k: int, pos: torch.Tensor, KP: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, P = scores.shape
    S = sample_size(P, k)
    M, C = THRESHOLDS, THRESHOLD_CHUNK
    thresholds = torch.empty(R, M, dtype=torch.int64, device=scores.device)
    counts = torch.zeros(R, M, dtype=torch.int32, device=scores.device)
    # num_warps: guesses, not measured
    if R <= RANK_MAX_ROWS:
        fast(threshold_rank_kernel)[(R, cdiv(S, RANK_BLOCK))](
            scores, pos, thresholds, P, k, S=S, M=M, KP=KP, B=RANK_BLOCK, KEYS=RANK_KEYS, num_warps=4)
    else:
        fast(threshold_sample_kernel)[(R,)](scores, pos, thresholds, P, k, S=S, M=M, KP=KP, num_warps=8)
    fast(threshold_count_kernel)[(R, cdiv(P, C))](scores, pos, thresholds, counts, P, k, C=C, M=M, KP=KP,
                                                  num_warps=8)
    return thresholds, counts


def threshold_launch(scores: torch.Tensor, k: int, out: torch.Tensor | None = None, cap: int | None = None,
                     positions: torch.Tensor | None = None, kpool: int = 0) -> torch.Tensor:
    """scores [R, P] int32 (rows contiguous), 1 <= k <= P -> [R, k] int64: ``topk_ref``'s values, bit for bit, in
    four launches that read the row about twice: the thresholds and their counts (``threshold_counts``); one pass
    appending the keys above the highest threshold with at least ``k`` above it to a buffer of ``cap`` keys a row
    (default ``4 KB``, ``KB`` = ``k`` rounded up to a power of two); a sort of each row's candidates (up to
    ``RANK_MAX_ROWS`` rows: ranks by comparison). A row whose candidates overflow ``cap`` (or that needs the minimum
    key) is done exactly in chunks by its finishing program, slower; the thresholds' spacing makes that rare.

    With the rows' query ``positions`` [R] int32 and ``kpool``, a row reads only the pools its query can see where
    there are at least ``k`` (a decode row of a CUDA graph whose block table is wider than its sequence): the same
    keys as over the whole row whenever its ``k`` best visible pools score above the float32 minimum, which the
    scoring kernel writes for the pools a query cannot see."""
    R, P = scores.shape
    M, C = THRESHOLDS, THRESHOLD_CHUNK
    KB = next_power_of_2(k)
    cap = cap or 4 * KB
    if (not 1 <= k <= P or scores.dtype != torch.int32 or scores.stride() != (P, 1)
            or cap != next_power_of_2(cap) or cap < 2 * KB):
        raise ValueError(f"threshold_launch: k={k}, cap={cap} of {tuple(scores.shape)} {scores.dtype} strides "
                         f"{scores.stride()}")
    out = torch.empty(R, k, dtype=torch.int64, device=scores.device) if out is None else out
    if R == 0:
        return out
    pos, KP = _visible(scores, positions, kpool)
    thresholds, counts = _counts(scores, k, pos, KP)
    cursor = torch.zeros(R, dtype=torch.int32, device=scores.device)
    cand = torch.empty(R, cap, dtype=torch.int64, device=scores.device)
    fast(threshold_gather_kernel)[(R, cdiv(P, C))](scores, pos, thresholds, counts, cursor, cand, P, k, C=C,
                                                   M=M, CAP=cap, KP=KP, num_warps=8)
    few = R <= RANK_MAX_ROWS
    if few:
        fast(threshold_place_kernel)[(R, cdiv(cap, RANK_BLOCK))](counts, cand, out, k, M=M, CAP=cap,
                                                                 B=RANK_BLOCK, KEYS=RANK_KEYS, num_warps=4)
    fast(threshold_finish_kernel)[(R,)](scores, pos, counts, cand, out, P, k, M=M, CAP=cap, KB=KB, KP=KP,
                                        EXACT_ONLY=few, num_warps=8)
    return out

"""Prefix checkpoints inside a context-parallel prefill: which rank computes the KDA states at each checkpoint
position, and how they reach every rank.

A split step's checkpoint ``(p, slot)`` (``p`` among the step's new tokens, ``0 < p < T``) lies in one segment,
``bounds[i] < p <= bounds[i + 1]``; only that segment's owner has the tokens before ``p`` from the segment's
corrected initial state, so only it computes the states there, in the same passes that compute the segment:

- conv: the last ``W - 1`` conv inputs before ``p``, from the rank's tokens and, where ``p`` is closer than
  that to the segment's start, from the segment's halo (``causal_conv1d_save_windows`` over a pool whose first
  rows are the halos);
- recurrent: the chunked prefill's own checkpoint path (``kernels/kda/checkpoints.py``) from the segment's
  initial state, into spare rows of the pool of initial states.

Every rank keeps every state slot (the prefix cache hands a checkpoint to whichever request hits it, and any
later step may run replicated), so the states then go to every rank: the owners write their rows, the other
ranks zeros, and one all-reduce per kind and layer sums them (adding zeros is exact). It moves
``C x (H K V + C_conv (W - 1))`` values per KDA layer for ``C`` checkpoints, a few of a step's maps.
"""

from __future__ import annotations

import torch

from flashinfra.parallel.collectives import Comm


def local_checkpoints(split, rank: int, checkpoints) -> list[tuple[int, int, int]]:
    """The checkpoints ``[(p, slot), ...]`` of the step that ``rank`` computes, as ``(local segment, position in
    that segment, index j into checkpoints)``: the pools' row ``n + j`` receives checkpoint ``j`` (``n``: the
    rank's segments)."""
    mine = split.segments(rank)
    out = []
    for j, (p, _) in enumerate(checkpoints):
        if not 0 < p < split.num_tokens:
            raise ValueError(f"a context-parallel step's checkpoint must lie inside its {split.num_tokens} new "
                             f"tokens, got position {p}")
        i = next(i for i in range(len(split.owners)) if split.bounds[i] < p <= split.bounds[i + 1])
        if split.owners[i] == rank:
            out.append((mine.index(i), p - split.bounds[i], j))
    return out


def with_spare_rows(pool: torch.Tensor, count: int) -> torch.Tensor:
    """``pool`` [n, ...] followed by ``count`` zero rows, for the checkpoints' states."""
    return torch.cat([pool, pool.new_zeros(count, *pool.shape[1:])]) if count else pool


def pool_checkpoints(local: list[tuple[int, int, int]], n: int) -> list[tuple[int, int, int]]:
    """``local_checkpoints`` as the kernels' ``(sequence, p, slot)`` over a pool of ``n`` segment rows."""
    return [(seg, p, n + j) for seg, p, j in local]


def deliver(comm: Comm, pool: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """Rows ``n ..`` of ``pool`` (this rank's checkpoints filled, the others zero) -> every checkpoint's state
    on every rank, ``[count, ...]``."""
    if not count:  # the same plan on every rank: all skip the collective
        return pool[:0]
    return comm.all_reduce(pool[n : n + count].contiguous())

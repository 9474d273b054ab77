"""Prefix checkpoints inside a KDA prefill: the recurrent state after ``p`` of a sequence's tokens, written into a
spare state slot while the sequence runs on.

A checkpoint is ``(seq, p, slot)``: sequence ``seq`` of the packed batch, ``0 < p <= its length``, and the slot
that receives the state after its first ``p`` tokens (distinct from every sequence's own slot and from each
other). The chunked kernels carry the state from chunk to chunk, ``BT`` tokens each counted from the sequence's
start, so a checkpoint at a chunk boundary (or at the sequence's end) is a store of the state they already hold.
Any other position ``p`` lies inside a chunk: the state at that chunk's start goes to the slot the same way, and
a second, short pass over the ``p mod BT`` tokens after it (all such checkpoints of the batch in one pass, each
from its own slot) carries it to ``p``. This module makes that plan on the host; prefill.py runs it and ref.py
cuts its sequences at the checkpoints instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPlan:
    chunk_saves: list[int]  # per chunk of the batch: the slot that stores the state after it, or -1
    before: list[tuple[int, int]]  # (src, dst) state copies before the pass: initial states of short tails
    after: list[tuple[int, int]]  # (src, dst) copies after the pass: a second slot at one chunk boundary
    tail_rows: list[tuple[int, int]]  # (first packed row, length) of each short tail pass
    tail_slots: list[int]
    tail_init: list[bool]

    @property
    def saves(self) -> bool:
        return any(s >= 0 for s in self.chunk_saves)


def check_checkpoints(checkpoints, cu: list[int], slots: list[int], num_slots: int) -> list[tuple[int, int, int]]:
    """``checkpoints`` as a list of int triples, validated against the batch."""
    out = [(int(b), int(p), int(s)) for b, p, s in checkpoints]
    dsts = [s for _, _, s in out]
    if len(set(dsts)) != len(dsts) or set(dsts) & set(slots) or any(not 0 <= s < num_slots for s in dsts):
        raise ValueError(f"kda_prefill: checkpoint slots must be distinct, in [0, {num_slots}) and not a "
                         f"sequence's own slot, got {dsts}")
    for b, p, _ in out:
        if not 0 <= b < len(cu) - 1 or not 0 < p <= cu[b + 1] - cu[b]:
            raise ValueError(f"kda_prefill: checkpoint ({b}, {p}) is not inside a sequence of {cu}")
    return out


def plan_checkpoints(cu: list[int], slots: list[int], init: list[bool], checkpoints: list[tuple[int, int, int]],
                     BT: int) -> CheckpointPlan:
    """Where each checkpoint's state comes from, for kernels whose chunks are ``BT`` tokens from each sequence's
    start."""
    offsets, nch = [], 0
    for b in range(len(cu) - 1):
        offsets.append(nch)
        nch += -(-(cu[b + 1] - cu[b]) // BT)
    saves = [-1] * nch
    before, after, rows, tail_slots, tail_init = [], [], [], [], []

    def at_boundary(b: int, end: int, dst: int) -> None:  # the state after the sequence's first ``end`` tokens
        i = offsets[b] + -(-end // BT) - 1
        if saves[i] >= 0:
            after.append((saves[i], dst))
        else:
            saves[i] = dst

    for b, p, dst in checkpoints:
        if p % BT == 0 or p == cu[b + 1] - cu[b]:
            at_boundary(b, p, dst)
            continue
        base = p - p % BT
        if base:
            at_boundary(b, base, dst)
        elif init[b]:
            before.append((slots[b], dst))
        rows.append((cu[b] + base, p - base))
        tail_slots.append(dst)
        tail_init.append(bool(base) or bool(init[b]))
    return CheckpointPlan(saves, before, after, rows, tail_slots, tail_init)

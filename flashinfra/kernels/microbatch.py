"""Micro-batches on two streams: a batch's rows cut into consecutive ranges, each range's launches issued in
order on one stream, the ranges alternating between the caller's stream and a side stream. One range's short
launches, bound by their latency (a KDA decode layer's prep and norm launches), then run beside another range's
long one, bound by memory bandwidth (its state launch), instead of leaving the bandwidth idle before and after it.

The side stream waits for the caller's stream before its first launch, and the caller's stream waits for the side
stream after the last, so the caller sees one ordered operation; inside CUDA graph capture the fork and join are
captured with it. Off CUDA the ranges run one after another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def micro_ranges(B: int, n: int, align: int = 4) -> list[tuple[int, int]]:
    """At most ``n`` consecutive, non-empty row ranges covering ``B`` rows, as even as cuts at multiples of ``align``
    rows allow (fewer where ``B`` is small). At 4 rows a range's per-row pointers (int32 slots and wider) keep the
    16-byte alignment that Triton specialises a kernel on, so the ranges' launches run the kernels compiled for the
    whole batch, also when only the whole batch ran before a CUDA graph's capture."""
    cuts = sorted({0, B, *(min(B, align * round(B * i / (n * align))) for i in range(1, n))})
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def side_stream(device: torch.device, avoid: torch.cuda.Stream) -> torch.cuda.Stream:
    """One side stream per device, kept for the process, other than ``avoid`` (the caller's stream). It comes from
    torch's stream pool, which a capture has set up before it starts (its own stream comes from there), so taking
    one inside a capture makes no CUDA call. The pool hands its streams out in turn, so the kept one can be the
    caller's own: then another is taken."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(index)
    if side is None or side == avoid:
        side = _SIDE[index] = torch.cuda.Stream(device=index)
    return side


def on_two_streams(ranges: list[tuple[int, int]], launch: Callable[[int, int], None], device: torch.device) -> None:
    """``launch(lo, hi)`` for each range, the first on the current stream, the next on the side stream, and so on."""
    if len(ranges) == 1 or device.type != "cuda":
        for lo, hi in ranges:
            launch(lo, hi)
        return
    main = torch.cuda.current_stream(device)
    side = side_stream(device, main)
    side.wait_stream(main)
    for i, (lo, hi) in enumerate(ranges):
        with torch.cuda.stream(side if i % 2 else main):
            launch(lo, hi)
    main.wait_stream(side)

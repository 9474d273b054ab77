"""The per-batch index tensors of the variable-length kernels (causal conv, KDA prefill): built on the host
from the batch's ``cu_seqlens``, state slots and flags, copied to the device without synchronising the
stream, and kept for the next call with the same batch, so that the KDA layers of one forward (34 in
GLM-5.3-Flash, the same batch each) build them once.

Why not ``torch.tensor(values, device="cuda")``: a copy from pageable host memory waits for every kernel
queued before it on the stream, so each such copy stalls the host until the GPU has drained, and the GPU then
idles while the host prepares the next launches. Here the values go through pinned host memory and the
copy is queued on the current stream like a kernel (the caching host allocator keeps the pinned buffer until
the copy has run). The cache is keyed by the values, the device and the current stream (a tensor made on one
stream is only known to be ready on that stream); the tensors it returns are read-only by contract.

Not while a CUDA graph is being captured: a captured copy would read the pinned buffer at each replay, after the
host allocator may have reused it, and a cached tensor made then would hold data only once that graph replays.
The calls raise instead, so that a capture falls back to eager execution.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
import triton
from triton.runtime.driver import driver

from flashinfra.kernels.launch import cdiv, POINTER_ALIGN_BYTES


def device_ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, copied asynchronously to a CUDA device."""
    t = torch.tensor(list(values), dtype=torch.int32)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    _refuse_capture()
    return t.pin_memory().to(device, non_blocking=True)


def _refuse_capture() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kernels.varlen: a variable-length op's index tensors are built on the host and cannot be "
                           "made inside a CUDA graph capture; run the op eagerly")


def _stream_key(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    _refuse_capture()  # a hit too: an entry is known ready only on the stream that made it
    # the raw stream handle, as Triton reads it for its launches (a few microseconds less than a Stream object)
    return driver.active.get_current_stream(torch.cuda.current_device() if device.index is None else device.index)


# Every tensor made here starts at a multiple of ``POINTER_ALIGN_BYTES`` of its copy (``launch.py``): views at offsets
# that depend on the batch's sizes would compile other variants of a kernel for other batches, in the middle of serving.
_ALIGN = POINTER_ALIGN_BYTES // 4  # int32 values


def _padded(values: list[int]) -> list[int]:
    return values + [0] * (-len(values) % _ALIGN)


@functools.lru_cache(maxsize=64)
def _chunk_tables(cu: tuple, chunk: int, device: torch.device, stream: int):
    pairs, offsets = [], []
    for n in range(len(cu) - 1):
        offsets.append(len(pairs) // 2)
        for i in range(cdiv(cu[n + 1] - cu[n], chunk)):
            pairs += (n, i)
    start = len(_padded(pairs))
    both = device_ints(_padded(pairs) + offsets, device)  # one copy
    return both[: len(pairs)], both[start : start + len(offsets)], len(pairs) // 2


@functools.lru_cache(maxsize=64)
def _ints_split(sizes: tuple, values: tuple, device: torch.device, stream: int) -> tuple[torch.Tensor, ...]:
    bounds = [0, *itertools.accumulate(sizes)]
    lists = [_padded(list(values[a:b])) for a, b in zip(bounds, bounds[1:])]
    t = device_ints([v for x in lists for v in x], device)
    starts = [0, *itertools.accumulate(len(x) for x in lists)]
    return tuple(t[a : a + n] for a, n in zip(starts, sizes))


def cached_int_lists(lists: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """``device_ints`` of several lists at once, made once per distinct lists (and device and stream): one copy,
    one tensor per list (views of it, cached with it, so a later call makes no tensor at all); read-only."""
    device = torch.device(device)
    return _ints_split(tuple(map(len, lists)), tuple(map(int, itertools.chain.from_iterable(lists))), device,
                       _stream_key(device))


def cached_ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``cached_int_lists`` of one list."""
    return cached_int_lists((values,), device)[0]


def chunk_tables(cu_seqlens: Sequence[int], chunk: int, device: torch.device | str):
    """``(chunk_indices, chunk_offsets, num_chunks)`` on ``device``: ``chunk_indices`` int32 [2 * num_chunks],
    the ``(sequence, chunk)`` pair of every chunk of ``chunk`` tokens of every sequence, in order, flattened;
    ``chunk_offsets`` int32 [sequences], each sequence's first chunk. One copy, cached like ``cached_ints``;
    read-only."""
    device = torch.device(device)
    return _chunk_tables(tuple(map(int, cu_seqlens)), chunk, device, _stream_key(device))

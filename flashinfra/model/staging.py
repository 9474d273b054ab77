"""``HostStaging``: a step's small integer inputs reach the device in one packed copy.

A step needs a dozen tiny integer arrays on the device (token ids, ``cu_seqlens``, slot mapping, block tables,
the rows to sample...). One ``torch.tensor(..., device=cuda)`` each is one host-to-device copy each, and from
pageable memory each copy also waits for the host. Here every array is written into one host buffer (pinned when
the device is a GPU), copied with one ``non_blocking`` copy into one device buffer, and handed out as views.

Layout: the buffers are int32 words; an int64 array takes two words per value, an int32 or float32 array (sampling
parameters) one. Every array starts at a multiple of ``ALIGN_WORDS`` words (16 bytes), whatever the lengths before
it: Triton specialises a kernel on whether each pointer argument is 16-byte aligned, so views whose alignment
followed the batch's composition compiled a new variant of every kernel reading them at the first batch of a new
make-up (seconds, in the middle of serving). Arrays are given as ``(name, dtype, values, shape)`` with flat
``values``.

Both buffers persist between steps and grow on demand. The device buffer is only written by the copy, which
the stream orders after the previous step's kernels; the host buffer is rewritten only after the previous copy
out of it has completed (an event), since the device may not have read it yet when the host prepares the next
step. ``StagingBuffers`` is that pair of buffers alone; the grammar's bitmask travels in one too
(``engine/grammar.py``). What it leaves out: deciding what the arrays mean (``ForwardBatch``, the runner).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flashinfra.kernels.launch import POINTER_ALIGN_BYTES

_WORDS = {torch.int32: 1, torch.int64: 2, torch.float32: 1}
_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}

Array = tuple[str, torch.dtype, Sequence[int] | np.ndarray, tuple[int, ...]]  # flat values: a list or an array
ALIGN_WORDS = POINTER_ALIGN_BYTES // 4  # each array's start, in int32 words


class StagingBuffers:
    """A host buffer (pinned when the device is a GPU) and a device buffer of int32 words, both grown on demand.
    ``reserve`` hands the host buffer out for writing only after the device has read the last copy out of it (an
    event); ``upload`` copies its first words over (asynchronously from pinned memory). ``share_on_cpu``: on a CPU
    device the two are one buffer and ``upload`` copies nothing (for a caller that consumes the words before it
    reserves again)."""

    def __init__(self, device: torch.device | str, share_on_cpu: bool = False) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self.shared = share_on_cpu and self.device.type == "cpu"
        self.host = torch.empty(0, dtype=torch.int32)
        self.dev = self.host if self.shared else torch.empty(0, dtype=torch.int32, device=self.device)
        self._copied: torch.cuda.Event | None = None  # the last copy out of ``host``

    def reserve(self, words: int) -> torch.Tensor:
        """The host buffer, free to write, of at least ``words`` words."""
        if self._copied is not None:
            self._copied.synchronize()  # the device has read the previous copy
            self._copied = None
        if words > self.host.numel():
            size = max(1024, 1 << (words - 1).bit_length())
            self.host = torch.empty(size, dtype=torch.int32, pin_memory=self.pinned)
            self.dev = self.host if self.shared else torch.empty(size, dtype=torch.int32, device=self.device)
        return self.host

    def upload(self, words: int) -> torch.Tensor:
        """The device buffer, its first ``words`` words copied from the host buffer."""
        if not self.shared:
            self.dev[:words].copy_(self.host[:words], non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        return self.dev


class HostStaging:
    def __init__(self, device: torch.device | str) -> None:
        self.buffers = StagingBuffers(device)
        self.num_copies = 0
        self._layout: tuple | None = None  # the last upload's layout and device buffer, and its views
        self._views: dict[str, torch.Tensor] = {}

    def upload(self, arrays: list[Array]) -> dict[str, torch.Tensor]:
        """Device views of ``arrays``, by name, after one host-to-device copy (one mapping, reused while the layout
        repeats: read-only)."""
        offsets, words = [], 0
        for _, dtype, values, _ in arrays:
            w = _WORDS[dtype]
            words = -(-words // ALIGN_WORDS) * ALIGN_WORDS
            offsets.append(words)
            words += w * len(values)
        host = self.buffers.reserve(words).numpy()
        for (_, dtype, values, _), off in zip(arrays, offsets):
            if len(values):
                host[off : off + _WORDS[dtype] * len(values)].view(_NUMPY[dtype])[:] = values
        dev = self.buffers.upload(words)
        self.num_copies += 1
        # steady decode steps repeat one layout step after step: their views are made once (read-only mapping)
        layout = (dev.data_ptr(), tuple((name, dtype, len(values), shape) for name, dtype, values, shape in arrays))
        if layout != self._layout:
            self._layout = layout
            self._views = {name: dev[off : off + _WORDS[dtype] * len(values)].view(dtype).view(shape)
                           for (name, dtype, values, shape), off in zip(arrays, offsets)}
        return self._views

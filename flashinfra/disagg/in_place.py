"""Transports whose bytes never leave the caches: the prefill engine leaves each request's state where it
lies, the decode engine copies it from there straight into its own cache, with no staging buffer on either
side. Two data planes share this: the Mooncake transfer engine (``disagg.mooncake``: RDMA or TCP, across
hosts) and mapped memory (``disagg.ipc``: CUDA IPC or shared memory, on one host).

The control plane stays ZeroMQ (``disagg.transport``: handshake, headers, acks). The sender's header names,
per layout tensor, where the tensor lies and its bytes per block (or slot), and the request's block ids and
slot there; the pages stay put, held by the prefill scheduler until the ack. The sender has no thread: the
prefill engine's loop sends the header and polls the ack between its steps, since a Python thread that woke
during a step (a launch-bound prefill takes and releases the GIL at every torch call) would stall it. Once the
decode engine has taken blocks and a slot for the request (``read``; the request joins the batch only when the
copy is over), the receiver's reader thread copies every run of pages consecutive on both sides, of every
tensor, and reports it through ``poll_reads``; no Python thread holds the GIL while the bytes move or while it
waits.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

from flashinfra.disagg.layout import (PAGED, CacheLayout, Caches, LayoutMismatch, RequestPages, RequestState,
                                      cache_tensors, page_runs, row_bytes)
from flashinfra.disagg.transport import Arrival, StateReceiver, StateSender, TransferError, _enc, _Transfer


def copy_runs(msg: _Transfer, caches: Caches, block_ids: list[int], slot: int | None):
    """Per layout tensor with bytes, ``(index, local tensor, row bytes, runs)``: runs ``(sender row, local
    row, count)`` of the request's pages (consecutive on both sides: one copy each) or of its slot. A header
    that does not describe ``caches`` raises ``LayoutMismatch``."""
    items = list(cache_tensors(caches))
    if len(msg.remote) != len(items) or len(msg.blocks) != len(block_ids):
        raise LayoutMismatch(f"{len(msg.remote)} tensors and {len(msg.blocks)} blocks sent, {len(items)} "
                             f"tensors and {len(block_ids)} blocks here")
    out = []
    for i, ((kind, layer, t), (_, row)) in enumerate(zip(items, msg.remote)):
        if row != row_bytes(t):
            raise LayoutMismatch(f"{kind}[{layer}]: {row} bytes per row sent, {row_bytes(t)} here")
        if not row:
            continue
        if kind in PAGED:
            runs = page_runs(msg.blocks, block_ids)
        else:
            runs = [] if slot is None or msg.slot is None else [(msg.slot, slot, 1)]
        out.append((i, t, row, runs))
    return out


class InPlaceSender(StateSender):
    """Leaves each request's state in ``caches`` and sends where it lies; ``session`` and ``_address``
    (a tensor's address as the receiver's data plane names it) come from the data plane."""

    session = ""

    def __init__(self, layout: CacheLayout, caches: Caches, **kw):
        self.tensors = [t for _, _, t in cache_tensors(caches)]
        super().__init__(layout, **kw)

    def _address(self, t) -> int:
        return t.data_ptr()

    def _message(self, state: RequestState, pages: RequestPages) -> tuple[list, None]:
        """The header alone, ready at once: nothing is copied on this side."""
        if not isinstance(pages, RequestPages):
            raise TransferError(f"--transfer-backend {self.backend} sends a request's pages from the cache "
                                f"(RequestPages), not packed buffers")
        remote = [(self._address(t), row_bytes(t)) for t in self.tensors]
        return [_enc.encode(_Transfer(state, remote=remote, blocks=list(pages.block_ids), slot=pages.slot,
                                      session=self.session))], None


class InPlaceReceiver(StateReceiver):
    """Copies each arrived state from the sender's cache into ``caches`` on a reader thread of its own:
    ``read`` queues a request's copy, ``poll_reads`` gives (transfer id, error or None) once it is over. The
    data plane turns a header into a job (``_plan``, on the engine's thread) and runs it (``_copy``, on the
    reader thread: the error, or None)."""

    reads_in_place = True

    def __init__(self, layout: CacheLayout, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None):
        self.num_reads = 0  # copies run (one per imported request)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._read_results: collections.deque[tuple[str, str | None]] = collections.deque()
        self._reader = threading.Thread(target=self._read_loop, name=f"disagg-{self.backend}-reader", daemon=True)
        self._reader.start()
        super().__init__(layout, address, wake)

    def read(self, arrival: Arrival, caches: Caches, block_ids: list[int], slot: int | None) -> None:
        """Queue the copy of a state left in the sender's cache into ``caches`` at ``block_ids`` and ``slot``
        (which must stay this request's until ``poll_reads`` reports it); returns at once."""
        tid = arrival.state.request_id
        try:
            job = self._plan(arrival, copy_runs(arrival.source, caches, block_ids, slot))
        except LayoutMismatch as e:
            self._read_done(tid, str(e))
            return
        self._jobs.put((tid, job))

    def poll_reads(self) -> list[tuple[str, str | None]]:
        out = []
        while self._read_results:
            out.append(self._read_results.popleft())
        return out

    def _plan(self, arrival: Arrival, runs: list) -> object:
        raise NotImplementedError

    def _copy(self, job) -> str | None:
        raise NotImplementedError

    def _read_loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            tid, job = item
            self.num_reads += 1
            try:
                error = self._copy(job)
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                error = f"{type(e).__name__}: {e}"
            self._read_done(tid, error)

    def _read_done(self, tid: str, error: str | None) -> None:
        self._read_results.append((tid, error))
        if self._wake_owner is not None:
            self._wake_owner()

    def close(self) -> None:
        self._jobs.put(None)
        self._reader.join(timeout=5)
        super().close()

"""The Mooncake transfer engine as the data plane of ``disagg.transport`` (``--transfer-backend mooncake``).

The control plane stays ZeroMQ (handshake with layouts, headers, acks). The bytes move through Mooncake
(``mooncake-transfer-engine``, or ``mooncake-transfer-engine-non-cuda`` on machines without CUDA) straight
from the prefill engine's cache into the decode engine's, with no staging buffer on either side: both
engines register every cache tensor of their layout (MLA latent pages, indexer pages and their scales, KDA
recurrent state and conv window slots, the MTP layer's pages) with their transfer engine once, at start.
The sender's header names, per layout tensor, the tensor's base address and bytes per block (or slot), and
the request's block ids and slot there; the pages stay where they are, held by the prefill scheduler until
the ack. Once the decode engine has taken blocks and a slot for the request (``read``; the request joins
the batch only when the read is over), its reader thread reads every run of pages consecutive on both
sides, of every tensor, in one ``batch_transfer_sync_read`` (RDMA where present, TCP otherwise; the binding
releases the GIL while it waits, so the engine loop runs on). Both engines start a transfer engine on
``host`` with peer-to-peer handshakes (no metadata server).
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

from flashinfra.disagg.layout import (PAGED, CacheLayout, Caches, LayoutMismatch, RequestPages, RequestState,
                                      cache_tensors, page_runs, row_bytes)
from flashinfra.disagg.transport import Arrival, StateReceiver, StateSender, TransferError, _enc, _Transfer

PROTOCOL = "tcp"  # "rdma" where the machines have RDMA NICs


class _Registered:
    """A transfer engine on ``host`` with ``caches``' tensors registered, unregistered by ``close``."""

    def __init__(self, caches: Caches, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError(f"--transfer-backend mooncake needs the mooncake-transfer-engine package ({e})") from e
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise TransferError(f"the Mooncake transfer engine did not start on {host} ({PROTOCOL})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.tensors = [t for _, _, t in cache_tensors(caches)]
        if not all(t.is_contiguous() for t in self.tensors):
            raise TransferError("Mooncake reads cache tensors in place: they must be contiguous")
        self._addrs = [t.data_ptr() for t in self.tensors if t.numel()]
        sizes = [t.numel() * t.element_size() for t in self.tensors if t.numel()]
        if self._addrs and self.engine.batch_register_memory(self._addrs, sizes) != 0:
            raise TransferError(f"Mooncake could not register the cache ({sum(sizes)} bytes)")

    def close(self) -> None:
        if self._addrs:
            self.engine.batch_unregister_memory(self._addrs)
            self._addrs = []


class MooncakeSender(StateSender):
    """Leaves each request's state in the registered cache and sends where it lies."""

    def __init__(self, layout: CacheLayout, caches: Caches, host: str = "127.0.0.1", **kw):
        self._mem = _Registered(caches, host)
        self.session = self._mem.session
        super().__init__(layout, **kw)

    def _message(self, state: RequestState, pages: RequestPages) -> list:
        if not isinstance(pages, RequestPages):
            raise TransferError("Mooncake sends a request's pages from the registered cache (RequestPages), "
                                "not packed buffers")
        remote = [(t.data_ptr(), row_bytes(t)) for t in self._mem.tensors]
        return [_enc.encode(_Transfer(state, remote=remote, blocks=list(pages.block_ids), slot=pages.slot,
                                      session=self.session))]

    def close(self) -> None:
        super().close()
        self._mem.close()


class MooncakeReceiver(StateReceiver):
    """Reads each arrived state from the sender's cache straight into the registered ``caches``, on a reader
    thread of its own: ``read`` queues a request's read, ``poll_reads`` gives (transfer id, error or None)
    once it is over."""

    reads_in_place = True

    def __init__(self, layout: CacheLayout, caches: Caches, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None, host: str = "127.0.0.1"):
        self._mem = _Registered(caches, host)
        self.session = self._mem.session
        self.num_reads = 0  # batch reads issued (one per imported request)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._read_results: collections.deque[tuple[str, str | None]] = collections.deque()
        self._reader = threading.Thread(target=self._read_loop, name="disagg-mooncake-reader", daemon=True)
        self._reader.start()
        super().__init__(layout, address, wake)

    def read(self, arrival: Arrival, caches: Caches, block_ids: list[int], slot: int | None) -> None:
        """Queue the read of a state left in the sender's cache into ``caches`` at ``block_ids`` and ``slot``
        (which must stay this request's until ``poll_reads`` reports it); returns at once."""
        tid = arrival.state.request_id
        try:
            batch = self._batch(arrival.source, caches, block_ids, slot)
        except LayoutMismatch as e:
            self._read_done(tid, str(e))
            return
        self._jobs.put((tid, arrival.source.session, batch))

    def poll_reads(self) -> list[tuple[str, str | None]]:
        out = []
        while self._read_results:
            out.append(self._read_results.popleft())
        return out

    def _batch(self, msg: _Transfer, caches: Caches, block_ids: list[int], slot: int | None) -> tuple:
        """(local addresses, peer addresses, lengths): every run of rows consecutive on both sides."""
        items = list(cache_tensors(caches))
        if len(msg.remote) != len(items) or len(msg.blocks) != len(block_ids):
            raise LayoutMismatch(f"{len(msg.remote)} tensors and {len(msg.blocks)} blocks sent, {len(items)} "
                                 f"tensors and {len(block_ids)} blocks here")
        local, peer, lengths = [], [], []
        for (kind, layer, t), (base, row) in zip(items, msg.remote):
            if row != row_bytes(t):
                raise LayoutMismatch(f"{kind}[{layer}]: {row} bytes per row sent, {row_bytes(t)} here")
            if not row:
                continue
            if kind in PAGED:
                runs = page_runs(msg.blocks, block_ids)
            else:
                runs = [] if slot is None or msg.slot is None else [(msg.slot, slot, 1)]
            for src, dst, n in runs:
                local.append(t.data_ptr() + dst * row)
                peer.append(base + src * row)
                lengths.append(n * row)
        return local, peer, lengths

    def _read_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            tid, session, (local, peer, lengths) = job
            self.num_reads += 1
            ok = not local or self._mem.engine.batch_transfer_sync_read(session, local, peer, lengths) == 0
            self._read_done(tid, None if ok else f"Mooncake could not read {sum(lengths)} bytes from {session}")

    def _read_done(self, tid: str, error: str | None) -> None:
        self._read_results.append((tid, error))
        if self._wake_owner is not None:
            self._wake_owner()

    def close(self) -> None:
        self._jobs.put(None)
        self._reader.join(timeout=5)
        super().close()
        self._mem.close()

"""The Mooncake transfer engine as the data plane of ``disagg.in_place`` (``--transfer-backend mooncake``).

The bytes move through Mooncake (``mooncake-transfer-engine``, or ``mooncake-transfer-engine-non-cuda`` on
machines without CUDA) straight from the prefill engine's cache into the decode engine's: both engines
register every cache tensor of their layout (MLA latent pages, indexer pages and their scales, KDA recurrent
state and conv window slots, the MTP layer's pages) with their transfer engine once, at start. A header names
each tensor by its base address in the sender; the reader thread reads every run of a request in one
``batch_transfer_sync_read`` (RDMA where present, TCP otherwise; the binding releases the GIL while it waits,
so the engine loop runs on). Both engines start a transfer engine on ``host`` with peer-to-peer handshakes
(no metadata server).
"""

from __future__ import annotations

from typing import Callable

from flashinfra.disagg.in_place import InPlaceReceiver, InPlaceSender
from flashinfra.disagg.layout import CacheLayout, Caches, cache_tensors
from flashinfra.disagg.transport import Arrival, TransferError

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
        tensors = [t for _, _, t in cache_tensors(caches)]
        if not all(t.is_contiguous() for t in tensors):
            raise TransferError("Mooncake reads cache tensors in place: they must be contiguous")
        self._addrs = [t.data_ptr() for t in tensors if t.numel()]
        sizes = [t.numel() * t.element_size() for t in tensors if t.numel()]
        if self._addrs and self.engine.batch_register_memory(self._addrs, sizes) != 0:
            raise TransferError(f"Mooncake could not register the cache ({sum(sizes)} bytes)")

    def close(self) -> None:
        if self._addrs:
            self.engine.batch_unregister_memory(self._addrs)
            self._addrs = []


class MooncakeSender(InPlaceSender):
    """Registers the cache with a transfer engine; headers name tensors by their addresses."""

    backend = "mooncake"

    def __init__(self, layout: CacheLayout, caches: Caches, host: str = "127.0.0.1", **kw):
        self._mem = _Registered(caches, host)
        self.session = self._mem.session
        super().__init__(layout, caches, **kw)

    def close(self) -> None:
        super().close()
        self._mem.close()


class MooncakeReceiver(InPlaceReceiver):
    """Reads each request's runs from the sender's session in one batch read into the registered cache."""

    backend = "mooncake"

    def __init__(self, layout: CacheLayout, caches: Caches, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None, host: str = "127.0.0.1"):
        self._mem = _Registered(caches, host)
        self.session = self._mem.session
        super().__init__(layout, address, wake)

    def _plan(self, arrival: Arrival, runs: list) -> tuple:
        """(peer session, local addresses, peer addresses, lengths)."""
        local, peer, lengths = [], [], []
        for i, t, row, tensor_runs in runs:
            base = arrival.source.remote[i][0]
            for src, dst, n in tensor_runs:
                local.append(t.data_ptr() + dst * row)
                peer.append(base + src * row)
                lengths.append(n * row)
        return arrival.source.session, local, peer, lengths

    def _copy(self, job: tuple) -> str | None:
        session, local, peer, lengths = job
        if local and self._mem.engine.batch_transfer_sync_read(session, local, peer, lengths) != 0:
            return f"Mooncake could not read {sum(lengths)} bytes from {session}"
        return None

    def close(self) -> None:
        super().close()
        self._mem.close()

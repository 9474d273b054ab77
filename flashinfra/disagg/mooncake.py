"""The Mooncake transfer engine as the data plane of ``disagg.transport`` (``--transfer-backend mooncake``).

The control plane stays ZeroMQ (handshake with layouts, headers, acks). The bytes move through Mooncake
(``mooncake-transfer-engine``, or ``mooncake-transfer-engine-non-cuda`` on machines without CUDA): the
sender registers the packed buffers with its transfer engine and sends only their addresses; the
receiver's thread reads them into buffers it registered (``transfer_sync_read``: RDMA where present, TCP
otherwise), then hands them to the engine like frames. The sender unregisters its buffers once the
transfer is over. Both engines start a transfer engine on ``host`` with peer-to-peer handshakes (no
metadata server).
"""

from __future__ import annotations

from typing import Callable

import torch

from flashinfra.disagg.layout import CacheLayout, RequestState
from flashinfra.disagg.transport import StateReceiver, StateSender, TransferError, _enc, _Transfer

PROTOCOL = "tcp"  # "rdma" where the machines have RDMA NICs


def _engine(host: str):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransferError(f"--transfer-backend mooncake needs the mooncake-transfer-engine package ({e})") from e
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
        raise TransferError(f"the Mooncake transfer engine did not start on {host} ({PROTOCOL})")
    return engine, f"{host}:{engine.get_rpc_port()}"


class MooncakeSender(StateSender):
    def __init__(self, layout: CacheLayout, host: str = "127.0.0.1", **kw):
        self._engine, self.session = _engine(host)
        self._registered: dict[str, list[torch.Tensor]] = {}  # request id -> its buffers, until released
        super().__init__(layout, **kw)

    def _message(self, state: RequestState, buffers: list) -> list:
        bufs = [b.contiguous() for b in buffers]
        remote = []
        for b in bufs:
            if b.numel() and self._engine.register_memory(b.data_ptr(), b.numel()) != 0:
                raise TransferError(f"Mooncake could not register {b.numel()} bytes")
            remote.append((b.data_ptr(), b.numel()))
        self._registered[state.request_id] = bufs
        return [_enc.encode(_Transfer(state, remote=remote, session=self.session))]

    def _release(self, request_id: str) -> None:
        for b in self._registered.pop(request_id, []):
            if b.numel():
                self._engine.unregister_memory(b.data_ptr())


class MooncakeReceiver(StateReceiver):
    def __init__(self, layout: CacheLayout, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None, host: str = "127.0.0.1"):
        self._engine, self.session = _engine(host)
        super().__init__(layout, address, wake)

    def _buffers(self, msg: _Transfer, frames: list) -> list:
        if not msg.remote:
            return super()._buffers(msg, frames)
        out = []
        for addr, size in msg.remote:
            buf = torch.empty(size, dtype=torch.uint8)
            if size:
                ptr = buf.data_ptr()
                if self._engine.register_memory(ptr, size) != 0:
                    raise TransferError(f"Mooncake could not register {size} bytes")
                try:
                    if self._engine.transfer_sync_read(msg.session, ptr, addr, size) != 0:
                        raise TransferError(f"Mooncake could not read {size} bytes from {msg.session}")
                finally:
                    self._engine.unregister_memory(ptr)
            out.append(buf)
        return out

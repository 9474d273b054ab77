"""Moving request states between engines over ZeroMQ/TCP, behind a layout handshake.

``StateReceiver`` (decode side) binds a ROUTER socket (``channel.HandshakeServer``); ``StateSender`` (prefill side)
connects one DEALER per decode engine. Every socket belongs to one background thread per object, woken through an
inproc socket, so the engine loop only puts work on a queue and takes results off another: it never waits on the
network, and no Python thread holds the GIL while bytes move or while waiting (pyzmq's blocking calls release it;
libzmq's I/O threads move the bytes).

Handshake: the first message on a connection carries the sender's ``CacheLayout``; the receiver compares it
with its own and answers ``ok`` or the mismatch message naming both sides, which fails the transfer (and
every later one to that engine) with ``LayoutMismatch``'s text.

Transfer: one multipart message ``[header, *buffers]`` sent with ``copy=False`` (libzmq reads the buffers
in place). The receiver acknowledges once the state is in its cache, or answers an error. The sender keeps
at most ``max_inflight`` transfers queued or unacknowledged (``send`` raises ``TransferError`` beyond) and
fails any transfer unacknowledged after ``timeout_s``. A receiver that dies fails its transfers at once, not
at the timeout: the sender watches each connection through a ZeroMQ socket monitor, and libzmq's
heartbeats (``HEARTBEAT_IVL_MS``, answered by the receiver's I/O thread even while its engine is busy)
turn a silent peer (a host gone without closing its sockets) into the same disconnect. Results (request id,
error or None) are taken with ``poll``; ``wake`` (when given) is called from the background thread whenever
one is ready.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable

import msgspec
import zmq

from flashinfra.disagg.channel import (HandshakeServer, Hello, Reply, Waker, close_peer, connect_peer,
                                       disconnected)
from flashinfra.disagg.layout import Caches, CacheLayout, LayoutMismatch, RequestState, unpack_request_state


class TransferError(RuntimeError):
    pass


class _Transfer(msgspec.Struct, tag="transfer"):
    state: RequestState
    # the state left in the sender's cache for the receiver to read in place (``disagg.in_place``): per layout
    # tensor (its address in the sender's memory, or 0 where the receiver maps the sender's tensors; bytes per
    # block or slot), the request's blocks and slot there, and the sender's session (its transfer engine, or
    # its shared cache); empty: the buffers follow as frames
    remote: list[tuple[int, int]] = []
    blocks: list[int] = []
    slot: int | None = None
    session: str = ""


class _Ack(msgspec.Struct, tag="ack"):
    request_id: str
    error: str = ""  # empty: the state is in the receiver's cache


_enc = msgspec.msgpack.Encoder()
_to_receiver = msgspec.msgpack.Decoder(Hello | _Transfer)
_to_sender = msgspec.msgpack.Decoder(Reply | _Ack)


def _frame(buf) -> memoryview | bytes:
    if hasattr(buf, "numpy"):  # a CPU torch tensor
        return memoryview(buf.numpy())
    return buf


class Arrival(msgspec.Struct):
    """A request state received by a ``StateReceiver``: put it in the cache with ``StateReceiver.write``, then
    answer it with ``StateReceiver.ack``."""

    peer: bytes
    state: RequestState
    buffers: list  # the packed buffers (frames); empty when the bytes are still in the sender's cache
    time: float
    source: _Transfer | None = None  # the header, which says where the sender's cache holds the state


class StateReceiver(HandshakeServer):
    """Accepts senders whose layout matches ``layout``; arrivals are taken with ``poll``."""

    reads_in_place = False  # whether states stay in the sender's cache, read by ``read`` (``disagg.in_place``)

    def __init__(self, layout: CacheLayout, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None):
        self._wake_owner = wake
        self._arrivals: collections.deque[Arrival] = collections.deque()
        self._acks: collections.deque[tuple[bytes, _Ack]] = collections.deque()
        super().__init__(layout, address, _to_receiver.decode, "disagg-receiver")

    def poll(self) -> list[Arrival]:
        out = []
        while self._arrivals:
            out.append(self._arrivals.popleft())
        return out

    def ack(self, peer: bytes, request_id: str, error: str = "") -> None:
        """Tell the sender the state is in this engine's cache (or why it is not); returns at once."""
        self._acks.append((peer, _Ack(request_id, error)))
        self._waker.wake()

    def write(self, arrival: Arrival, caches: Caches, block_ids: list[int], slot: int | None) -> None:
        """Put an arrived state into ``caches`` at ``block_ids`` and ``slot`` (on the engine's thread)."""
        unpack_request_state(caches, block_ids, slot, arrival.buffers)

    def _on_wake(self) -> None:
        while self._acks:
            peer, ack = self._acks.popleft()
            self._sock.send_multipart([peer, _enc.encode(ack)])

    def _refuse(self, msg: _Transfer) -> list:
        return [_enc.encode(_Ack(msg.state.request_id, "no layout handshake on this connection (the decode engine "
                                                       "restarted?)"))]

    def _handle(self, peer: bytes, msg: _Transfer, frames: list) -> None:
        self._arrivals.append(Arrival(peer, msg.state, [f.buffer for f in frames], time.monotonic(), msg))
        if self._wake_owner is not None:
            self._wake_owner()


class StateSender:
    """Sends request states to decode engines from its own thread; ``poll`` gives (request id, error)."""

    backend = "zmq"  # the receivers' ``backend`` this sender pairs with

    def __init__(self, layout: CacheLayout, timeout_s: float = 30.0, max_inflight: int = 256,
                 wake: Callable[[], None] | None = None):
        self.layout = layout
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self._ctx = zmq.Context.instance()
        self._wake_owner = wake
        self._waker = Waker(self._ctx)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque[tuple[str, str | None]] = collections.deque()
        self._outstanding = 0  # touched only by the owner's thread (send / poll)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="disagg-sender", daemon=True)
        self._thread.start()

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    def send(self, peer: str, state: RequestState, buffers: list | Callable[[], list]) -> None:
        """Queue a transfer to the receiver at ``peer``; returns at once. ``buffers`` (or the callable that
        packs them, called on the sender's thread: ``layout.RequestPages``) must stay valid until the result is
        polled."""
        if self._outstanding >= self.max_inflight:
            raise TransferError(f"{self._outstanding} transfers are already queued or unacknowledged "
                                f"(at most {self.max_inflight})")
        self._outstanding += 1
        self._queue.put((peer, state, buffers))
        self._waker.wake()

    def poll(self) -> list[tuple[str, str | None]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        self._outstanding -= len(out)
        return out

    def _message(self, state: RequestState, buffers: list | Callable[[], list]) -> list:
        """The multipart message of one transfer (on the sender's thread): here, the buffers as frames."""
        bufs = buffers() if callable(buffers) else buffers
        return [_enc.encode(_Transfer(state))] + [_frame(b) for b in bufs]

    def _finish(self, request_id: str, error: str | None) -> None:
        self._done.append((request_id, error))
        if self._wake_owner is not None:
            self._wake_owner()

    def _hello_extra(self) -> bytes:
        """What this sender's backend adds to the handshake."""
        return b""

    def _connect(self, peer: str, poller: zmq.Poller) -> tuple[zmq.Socket, zmq.Socket]:
        hello = Hello(self.layout, self.backend, self._hello_extra())
        return connect_peer(self._ctx, peer, _enc.encode(hello), _to_sender.decode, Reply,
                            "the decode engine", poller, TransferError)

    def _loop(self) -> None:
        peers: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # peer -> (DEALER, its monitor)
        refused: dict[str, str] = {}  # peers whose layout does not match: every transfer fails at once
        inflight: dict[str, tuple[float, str]] = {}  # request id -> (deadline, peer)
        poller = zmq.Poller()
        poller.register(self._waker.pull, zmq.POLLIN)
        while not self._stop:
            wait = min((d for d, _ in inflight.values()), default=None)
            events = dict(poller.poll(None if wait is None else max(0, int((wait - time.monotonic()) * 1000) + 1)))
            if self._waker.pull in events:
                self._waker.drain()
            while True:
                try:
                    peer, state, buffers = self._queue.get_nowait()
                except queue.Empty:
                    break
                rid = state.request_id
                try:
                    if peer in refused:
                        raise LayoutMismatch(refused[peer])
                    if peer not in peers:
                        peers[peer] = self._connect(peer, poller)
                    sock = peers[peer][0]
                    sock.send_multipart(self._message(state, buffers), flags=zmq.NOBLOCK, copy=False)
                    inflight[rid] = (time.monotonic() + self.timeout_s, peer)
                except LayoutMismatch as e:
                    refused[peer] = str(e)
                    self._finish(rid, f"refused by the decode engine at {peer}: {e}")
                except zmq.Again:
                    self._finish(rid, f"the decode engine at {peer} is not taking transfers")
                except Exception as e:  # noqa: BLE001 - the transfer fails, the engine goes on
                    self._finish(rid, f"transfer to {peer} failed: {type(e).__name__}: {e}")
            for peer, (sock, monitor) in list(peers.items()):
                lost = monitor in events and disconnected(monitor)
                if sock in events or lost:
                    while True:
                        try:
                            msg = _to_sender.decode(sock.recv(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                        if isinstance(msg, _Ack) and inflight.pop(msg.request_id, None) is not None:
                            self._finish(msg.request_id, msg.error or None)
                            lost = lost or msg.error.startswith("no layout handshake")  # reconnect next time
                if lost:
                    for poll_sock in (sock, monitor):
                        poller.unregister(poll_sock)
                    close_peer(sock, monitor)
                    del peers[peer]
                    for rid, (_, to) in list(inflight.items()):
                        if to == peer:
                            del inflight[rid]
                            self._finish(rid, f"the decode engine at {peer} went away during the transfer "
                                              f"(connection lost)")
            now = time.monotonic()
            for rid, (deadline, peer) in list(inflight.items()):
                if deadline <= now:
                    del inflight[rid]
                    self._finish(rid, f"the decode engine at {peer} did not acknowledge the transfer within "
                                      f"{self.timeout_s:g} s")
        for sock, monitor in peers.values():
            close_peer(sock, monitor)

    def close(self) -> None:
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()

"""Moving request states between engines over ZeroMQ/TCP, behind a layout handshake.

``StateReceiver`` (decode side) binds a ROUTER socket; ``StateSender`` (prefill side) connects a DEALER.
The first message is a handshake carrying the sender's ``CacheLayout``; the receiver compares it with its
own and answers ``ok`` or the mismatch message (naming both sides), which the sender raises.

Each transfer is one multipart message ``[RequestState, *buffers]`` with ``copy=False``: pyzmq hands the
buffers to libzmq's I/O thread without copying, and its blocking send/recv release the GIL, so no Python
thread holds the GIL while bytes move or while waiting. Sending runs on a dedicated thread fed by a
queue, so the engine loop never waits on the network; ``on_ack`` fires when the receiver has imported the
state (that is when the prefill side frees its blocks).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import msgspec
import zmq

from flashinfra.disagg.layout import CacheLayout, LayoutMismatch, RequestState, check_compatible


class _Hello(msgspec.Struct, tag="hello"):
    layout: CacheLayout


class _Reply(msgspec.Struct, tag="reply"):
    ok: bool
    error: str = ""


_enc = msgspec.msgpack.Encoder()


class StateReceiver:
    """Accepts senders whose layout matches ``layout``; ``recv`` returns (state, buffers)."""

    def __init__(self, layout: CacheLayout, address: str = "tcp://127.0.0.1:*"):
        self.layout = layout
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.accepted: set[bytes] = set()

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes, RequestState, list[memoryview]] | None:
        """Serve handshakes until a state arrives; None on timeout. The caller acks with ``ack``."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            peer, head, *bufs = self.sock.recv_multipart(copy=False)
            peer = bytes(peer)
            if peer not in self.accepted:
                hello = msgspec.msgpack.decode(head.buffer, type=_Hello)
                try:
                    check_compatible(self.layout, hello.layout)
                except LayoutMismatch as e:
                    self.sock.send_multipart([peer, _enc.encode(_Reply(False, str(e)))])
                    continue
                self.accepted.add(peer)
                self.sock.send_multipart([peer, _enc.encode(_Reply(True))])
                continue
            return peer, msgspec.msgpack.decode(head.buffer, type=RequestState), [b.buffer for b in bufs]

    def ack(self, peer: bytes, request_id: str) -> None:
        self.sock.send_multipart([peer, request_id.encode()])

    def close(self) -> None:
        self.sock.close(linger=0)


class StateSender:
    """Handshakes on construction (raises ``LayoutMismatch``), then sends from its own thread."""

    def __init__(self, layout: CacheLayout, address: str, on_ack: Callable[[str], None] | None = None,
                 timeout_s: float = 10.0):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sock.send(_enc.encode(_Hello(layout)))
        if not self.sock.poll(int(timeout_s * 1000)):
            self.sock.close()
            raise TimeoutError(f"no handshake answer from {address} within {timeout_s}s")
        reply = msgspec.msgpack.decode(self.sock.recv(), type=_Reply)
        if not reply.ok:
            self.sock.close()
            raise LayoutMismatch(reply.error)
        self.on_ack = on_ack
        self.inflight: set[str] = set()
        self.errors: list[BaseException] = []
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="disagg-sender", daemon=True)
        self._thread.start()

    def send(self, state: RequestState, buffers: list) -> None:
        """Queue a transfer; returns at once. Buffers must stay alive and unchanged until the ack."""
        self.inflight.add(state.request_id)
        self._q.put((state, buffers))

    def _loop(self) -> None:
        # Only this thread touches the socket after the handshake.
        while True:
            try:
                item = self._q.get(timeout=0.01)
            except queue.Empty:
                item = None
            if item is False:
                return
            try:
                if item is not None:
                    state, bufs = item
                    frames = [_enc.encode(state)] + [memoryview(b.numpy()) if hasattr(b, "numpy") else b for b in bufs]
                    self.sock.send_multipart(frames, copy=False)  # copy=False: libzmq reads the buffers
                while self.sock.poll(0):
                    rid = self.sock.recv().decode()
                    self.inflight.discard(rid)
                    if self.on_ack is not None:
                        self.on_ack(rid)
            except Exception as e:  # noqa: BLE001 - reported through .errors
                self.errors.append(e)

    def close(self) -> None:
        self._q.put(False)
        self._thread.join(timeout=5)
        self.sock.close(linger=0)

"""The ZeroMQ plumbing the disaggregated transports share (request states in ``disagg.transport``, image
embeddings in ``disagg.encode``).

A ROUTER side (``HandshakeServer``) binds where peers connect; a peer's DEALER (``open_peer``) opens with a
``Hello`` that carries its layout, answered by a ``Reply``: ok, or the mismatch naming both sides
(``refusal``). The servers and the encode client own their sockets on one background thread each, woken
through an inproc socket (``Waker``), and wait for a handshake's answer there (``connect_peer``); the state
sender has no thread (``disagg.transport``, where the GIL says why): the engine loop takes the answer with its
next poll. libzmq's heartbeats (``HEARTBEAT_IVL_MS``, answered by the I/O threads even while an engine is busy)
turn a silent peer (a host gone without closing its sockets) into a disconnect, which a socket monitor reports
(``disconnected``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

import msgspec
import zmq

from flashinfra.disagg.layout import CacheLayout, LayoutMismatch, check_compatible

HANDSHAKE_TIMEOUT_S = 5.0
HEARTBEAT_IVL_MS = 1000  # a connection with no traffic for HEARTBEAT_TIMEOUT_MS counts as lost
HEARTBEAT_TIMEOUT_MS = 5000


class Hello(msgspec.Struct, tag="hello"):
    layout: CacheLayout
    backend: str = "zmq"  # how the peer moves bytes (``--transfer-backend``): both sides must use the same
    extra: bytes = b""  # what the backend adds to the handshake (``disagg.ipc``: the sender's shared cache)


class Reply(msgspec.Struct, tag="reply"):
    ok: bool
    error: str = ""


_enc = msgspec.msgpack.Encoder()
_names = itertools.count()


class Waker:
    """An inproc PUSH/PULL pair: ``wake()`` from the owner's thread interrupts the background thread's poll."""

    def __init__(self, ctx: zmq.Context) -> None:
        addr = f"inproc://flashinfra-disagg-{next(_names)}"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 1)
        self.push.connect(addr)

    def wake(self) -> None:
        try:
            self.push.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending

    def drain(self) -> None:
        while True:
            try:
                self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


class HandshakeServer:
    """A ROUTER socket that peers connect to, served by one background thread: a peer's first message is a
    ``Hello`` with its layout, answered ``Reply`` (ok, or the mismatch naming both sides); later messages
    from accepted peers go to ``_handle``, those from a peer without a handshake (this side restarted) get
    ``_refuse``'s answer. Subclasses set their state up, then call ``__init__`` (which starts the thread)."""

    backend = "zmq"  # the ``Hello.backend`` this side accepts

    def __init__(self, layout: CacheLayout, address: str, decode: Callable[[bytes], object], name: str) -> None:
        self.layout = layout
        self._ctx = zmq.Context.instance()
        self._sock, self.address = bind_router(self._ctx, address)
        self._decode = decode
        self._waker = Waker(self._ctx)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _on_wake(self) -> None:
        """Runs on the thread whenever it wakes, before the messages are read."""

    def _accept(self, peer: bytes, hello: Hello) -> None:
        """Runs on the thread for a peer whose layout matches, before it is answered; ``LayoutMismatch``
        refuses it with its message."""

    def _refuse(self, msg) -> list:
        raise NotImplementedError

    def _handle(self, peer: bytes, msg, frames: list) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        accepted: set[bytes] = set()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.pull, zmq.POLLIN)
        while not self._stop:
            events = dict(poller.poll())
            if self._waker.pull in events:
                self._waker.drain()
            self._on_wake()
            if self._sock not in events:
                continue
            while True:
                try:
                    peer, head, *frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                peer = bytes(peer)
                msg = self._decode(head.buffer)
                if isinstance(msg, Hello):
                    try:
                        if msg.backend != self.backend:
                            raise LayoutMismatch(f"{msg.layout.name} moves bytes with --transfer-backend "
                                                 f"{msg.backend}, {self.layout.name} with {self.backend}")
                        check_compatible(self.layout, msg.layout)
                        self._accept(peer, msg)
                    except LayoutMismatch as e:
                        self._sock.send_multipart([peer, _enc.encode(Reply(False, str(e)))])
                        continue
                    accepted.add(peer)
                    self._sock.send_multipart([peer, _enc.encode(Reply(True))])
                elif peer not in accepted:
                    self._sock.send_multipart([peer, *self._refuse(msg)])
                else:
                    self._handle(peer, msg, frames)

    def close(self) -> None:
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()
        self._sock.close(linger=0)


def disconnected(monitor: zmq.Socket) -> bool:
    """Drain a connection monitor; whether it reported the connection lost."""
    from zmq.utils.monitor import recv_monitor_message

    lost = False
    while True:
        try:
            lost = recv_monitor_message(monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED or lost
        except zmq.Again:
            return lost


def close_peer(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


def bind_router(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, str]:
    """The ROUTER that peers connect to (heartbeats on, so a silent peer counts as lost) and its address."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.bind(address)
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def open_peer(ctx: zmq.Context, peer: str, hello: bytes) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER to ``peer`` that has queued ``hello`` (returns at once: its answer is the first message the
    socket receives, ``refusal`` tells it), and the monitor socket that reports its disconnection. Heartbeats
    make a silent peer count as lost."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(peer)
    sock.send(hello, zmq.NOBLOCK)  # queued on the pipe connect made: never blocks
    return sock, monitor


def refusal(reply: object, reply_type: type) -> str | None:
    """None when ``reply`` accepts the handshake, else why not (the mismatch naming both sides)."""
    if isinstance(reply, reply_type) and reply.ok:
        return None
    return getattr(reply, "error", "") or "unexpected handshake answer"


def no_answer(what: str, peer: str) -> str:
    return f"no answer from {what} at {peer} within {HANDSHAKE_TIMEOUT_S:.0f} s"


def connect_peer(ctx: zmq.Context, peer: str, hello: bytes, read_reply: Callable[[bytes], object], reply_type: type,
                 what: str, poller: zmq.Poller, error: type[Exception]) -> tuple[zmq.Socket, zmq.Socket]:
    """``open_peer``, waiting for the answer: a ``reply_type`` with ``ok`` (else ``LayoutMismatch``; no answer:
    ``error``, ``what`` naming the peer); the socket and its monitor are registered with ``poller``."""
    sock, monitor = open_peer(ctx, peer, hello)
    if not sock.poll(int(HANDSHAKE_TIMEOUT_S * 1000)):
        close_peer(sock, monitor)
        raise error(no_answer(what, peer))
    problem = refusal(read_reply(sock.recv()), reply_type)
    if problem is not None:
        close_peer(sock, monitor)
        raise LayoutMismatch(problem)
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    return sock, monitor

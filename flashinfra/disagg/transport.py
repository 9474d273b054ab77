"""Moving request states between engines over ZeroMQ/TCP, behind a layout handshake.

``StateReceiver`` (decode side) binds a ROUTER socket (``channel.HandshakeServer``), served by a background
thread; ``StateSender`` (prefill side) connects one DEALER per decode engine and has no thread: the engine
loop calls ``send`` and ``poll``, neither of which blocks, and sleeps on the sender's sockets
(``wait_sockets``) until ``next_deadline``. Why no thread: a prefill step is thousands of kernel launches,
each torch call releasing and retaking the GIL, so every wake-up of another Python thread (on each send, each
ack) made the loop wait for the GIL at its next call; libzmq's I/O threads (C++) move the frames without it.

Handshake: the first message on a connection carries the sender's ``CacheLayout``; the receiver compares it
with its own and answers ``ok`` or the mismatch message naming both sides, which fails the transfer (and
every later one to that engine) with ``LayoutMismatch``'s text. Transfers to an engine whose answer is
awaited wait for it (``HANDSHAKE_TIMEOUT_S`` at most).

Transfer: one multipart message ``[header, *buffers]`` sent with ``copy=False`` (libzmq reads the buffers
in place). A request's pages in a GPU cache are packed into pinned memory by a copy on a side stream, and
sent by the first ``poll`` that finds the copy over. The receiver acknowledges once the state is in its
cache, or answers an error. The sender keeps at most ``max_inflight`` transfers unsent, unacknowledged or not
polled (``send`` raises ``TransferError`` beyond) and fails any transfer unacknowledged after ``timeout_s``.
A receiver that dies fails its transfers at once, not at the timeout: the sender watches each connection
through a ZeroMQ socket monitor, and libzmq's heartbeats (``HEARTBEAT_IVL_MS``, answered by the receiver's
I/O thread even while its engine is busy) turn a silent peer (a host gone without closing its sockets) into
the same disconnect. Results (request id, error or None) are taken with ``poll``.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch
import zmq

from flashinfra.disagg.channel import (HANDSHAKE_TIMEOUT_S, HandshakeServer, Hello, Reply, close_peer,
                                       disconnected, no_answer, open_peer, refusal)
from flashinfra.disagg.layout import (Caches, CacheLayout, LayoutMismatch, RequestPages, RequestState,
                                      unpack_request_state)

COPY_CHECK_S = 0.001  # how often an idle owner checks a packing copy still running on the device


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


@dataclass
class _Peer:
    sock: zmq.Socket  # the DEALER to the decode engine
    monitor: zmq.Socket  # reports its disconnection
    handshake_deadline: float | None  # while its answer to the handshake is awaited; None once accepted


@dataclass
class _Unsent:
    request_id: str
    peer: str
    message: list  # the frames
    copied: torch.cuda.Event | None  # the packing copy into the frames, still running when not None


class StateSender:
    """Sends request states to decode engines from its owner's thread; ``poll`` gives (request id, error)."""

    backend = "zmq"  # the receivers' ``backend`` this sender pairs with

    def __init__(self, layout: CacheLayout, timeout_s: float = 30.0, max_inflight: int = 256):
        self.layout = layout
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self._ctx = zmq.Context.instance()
        self._peers: dict[str, _Peer] = {}
        self._refused: dict[str, str] = {}  # peers whose layout does not match: every transfer fails at once
        self._unsent: list[_Unsent] = []  # waiting for their peer's handshake or their packing copy
        # request id -> (deadline, peer), in the order sent: deadlines in order too (one timeout for all)
        self._inflight: dict[str, tuple[float, str]] = {}
        self._done: list[tuple[str, str | None]] = []
        self._outstanding = 0  # sent (or to be) and not polled
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # per GPU: where packing copies run

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    def send(self, peer: str, state: RequestState, buffers: list | RequestPages) -> None:
        """Start a transfer to the receiver at ``peer``; returns at once (the result comes from ``poll``).
        ``buffers`` (or the request's pages, packed here: on a GPU by a copy on a side stream) must stay valid
        until the result is polled."""
        if self._outstanding >= self.max_inflight:
            raise TransferError(f"{self._outstanding} transfers are already queued or unacknowledged "
                                f"(at most {self.max_inflight})")
        self._outstanding += 1
        rid = state.request_id
        try:
            if peer in self._refused:
                raise LayoutMismatch(self._refused[peer])
            self._unsent.append(_Unsent(rid, peer, *self._message(state, buffers)))
        except LayoutMismatch as e:
            self._done.append((rid, f"refused by the decode engine at {peer}: {e}"))
        except Exception as e:  # noqa: BLE001 - the transfer fails, the engine goes on
            self._done.append((rid, f"transfer to {peer} failed: {type(e).__name__}: {e}"))
        self._flush()

    def poll(self) -> list[tuple[str, str | None]]:
        """Read answers, acks and disconnections, send what became ready, time out what waited too long; the
        transfers finished since the last call. Never blocks."""
        now = time.monotonic()
        for peer in list(self._peers):
            self._read(peer, now)
        for rid, (deadline, peer) in list(self._inflight.items()):
            if deadline > now:
                break
            del self._inflight[rid]
            self._done.append((rid, f"the decode engine at {peer} did not acknowledge the transfer within "
                                    f"{self.timeout_s:g} s"))
        self._flush()
        out, self._done = self._done, []
        self._outstanding -= len(out)
        return out

    def has_events(self) -> bool:
        """Whether ``poll`` has something to do: a result, an answer, an ack or a disconnection to read, a
        packing copy over, a deadline passed."""
        if self._done or any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self.wait_sockets()):
            return True
        if any(t.copied is not None and self._peers[t.peer].handshake_deadline is None and t.copied.query()
               for t in self._unsent):
            return True
        deadline = self._deadline()
        return deadline is not None and deadline <= time.monotonic()

    def wait_sockets(self) -> list[zmq.Socket]:
        """The sockets whose readability means ``poll`` has something to read (for the owner's poller)."""
        return [s for p in self._peers.values() for s in (p.sock, p.monitor)]

    def next_deadline(self) -> float | None:
        """When (``time.monotonic()``) ``poll`` has something to do even if no socket is readable: a handshake or
        an ack times out, or a packing copy is to be checked again; None: only when a socket is readable."""
        deadline = self._deadline()
        if any(t.copied is not None and self._peers[t.peer].handshake_deadline is None for t in self._unsent):
            check = time.monotonic() + COPY_CHECK_S
            deadline = check if deadline is None else min(deadline, check)
        return deadline

    def _deadline(self) -> float | None:
        """The earliest handshake or ack deadline."""
        deadlines = [p.handshake_deadline for p in self._peers.values() if p.handshake_deadline is not None]
        if self._inflight:
            deadlines.append(next(iter(self._inflight.values()))[0])  # sent first, times out first
        return min(deadlines, default=None)

    def _message(self, state: RequestState, buffers: list | RequestPages) -> tuple[list, torch.cuda.Event | None]:
        """The multipart message of one transfer, and the copy that fills it (None: filled): here, the buffers
        as frames."""
        copied = None
        if isinstance(buffers, RequestPages):
            device = buffers.device
            if device is None:
                buffers = buffers()
            else:
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device)
                buffers = buffers(self._streams[device])
                copied = torch.cuda.Event()
                copied.record(self._streams[device])
        return [_enc.encode(_Transfer(state))] + [_frame(b) for b in buffers], copied

    def _hello_extra(self) -> bytes:
        """What this sender's backend adds to the handshake."""
        return b""

    def _flush(self) -> None:
        """Open a connection for every transfer to a new peer; send those whose peer accepted the handshake and
        whose packing copy is over."""
        waiting = []
        for t in self._unsent:
            try:
                p = self._peers.get(t.peer)
                if p is None:
                    hello = _enc.encode(Hello(self.layout, self.backend, self._hello_extra()))
                    p = self._peers[t.peer] = _Peer(*open_peer(self._ctx, t.peer, hello),
                                                    time.monotonic() + HANDSHAKE_TIMEOUT_S)
                if p.handshake_deadline is not None or (t.copied is not None and not t.copied.query()):
                    waiting.append(t)
                    continue
                p.sock.send_multipart(t.message, flags=zmq.NOBLOCK, copy=False)
                self._inflight[t.request_id] = (time.monotonic() + self.timeout_s, t.peer)
            except zmq.Again:
                self._done.append((t.request_id, f"the decode engine at {t.peer} is not taking transfers"))
            except Exception as e:  # noqa: BLE001 - the transfer fails, the engine goes on
                self._done.append((t.request_id, f"transfer to {t.peer} failed: {type(e).__name__}: {e}"))
        self._unsent = waiting

    def _read(self, peer: str, now: float) -> None:
        """Take what ``peer``'s connection received: the handshake's answer, acks, its loss."""
        p = self._peers[peer]
        lost = disconnected(p.monitor)
        while True:
            try:
                raw = p.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = _to_sender.decode(raw)
            except msgspec.DecodeError:
                msg = None
            if p.handshake_deadline is not None:
                problem = refusal(msg, Reply)
                if problem is not None:
                    self._refused[peer] = problem
                    self._drop(peer, f"refused by the decode engine at {peer}: {problem}")
                    return
                p.handshake_deadline = None
            elif isinstance(msg, _Ack) and self._inflight.pop(msg.request_id, None) is not None:
                self._done.append((msg.request_id, msg.error or None))
                lost = lost or msg.error.startswith("no layout handshake")  # reconnect next time
        if p.handshake_deadline is not None and p.handshake_deadline <= now:
            self._drop(peer, no_answer("the decode engine", peer))
        elif lost:
            self._drop(peer, f"the decode engine at {peer} went away during the transfer (connection lost)")

    def _drop(self, peer: str, error: str) -> None:
        """Close the connection to ``peer`` (the next transfer opens a new one); fail its transfers with ``error``."""
        p = self._peers.pop(peer)
        close_peer(p.sock, p.monitor)
        for rid in [rid for rid, (_, to) in self._inflight.items() if to == peer]:
            del self._inflight[rid]
            self._done.append((rid, error))
        self._done.extend((t.request_id, error) for t in self._unsent if t.peer == peer)
        self._unsent = [t for t in self._unsent if t.peer != peer]

    def close(self) -> None:
        for p in self._peers.values():
            close_peer(p.sock, p.monitor)
        self._peers.clear()

"""How the engine loop waits for what disaggregated serving needs of it: ``Wake``, a pipe the threads behind it
(a state receiver's, an encode client's) write to, and ``LoopPoller``, the loop's wait on that pipe, on a state
sender's sockets (which no thread of its own serves) and until the sender's next deadline."""

from __future__ import annotations

import math
import os
import select
import time
from typing import Any

import zmq


class Wake:
    """A non-blocking pipe: background threads write a byte, the engine loop polls the read end (``fd``)."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def __call__(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake anyway

    def pending(self) -> bool:
        return bool(select.select([self.fd], [], [], 0)[0])

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)


class LoopPoller:
    """A ``zmq.Poller`` over ``sockets`` (the loop's own input), the engine's ``wake_fd`` and its
    ``wake_sockets`` (registered again before each wait, as connections come and go); a wait ends by the
    engine's ``wake_deadline`` at the latest."""

    def __init__(self, core: Any, *sockets: zmq.Socket) -> None:
        self.core = core
        self._poller = zmq.Poller()
        for sock in sockets:
            self._poller.register(sock, zmq.POLLIN)
        if core.wake_fd is not None:
            self._poller.register(core.wake_fd, zmq.POLLIN)
        self._engine_sockets: set[zmq.Socket] = set()

    def poll(self, timeout_ms: int) -> dict:
        """What became readable within ``timeout_ms`` (or by the engine's deadline, when sooner)."""
        current = set(self.core.wake_sockets())
        for sock in self._engine_sockets - current:
            self._poller.unregister(sock)
        for sock in current - self._engine_sockets:
            self._poller.register(sock, zmq.POLLIN)
        self._engine_sockets = current
        if timeout_ms and (deadline := self.core.wake_deadline()) is not None:
            timeout_ms = min(timeout_ms, max(0, math.ceil((deadline - time.monotonic()) * 1000)))
        return dict(self._poller.poll(timeout_ms))

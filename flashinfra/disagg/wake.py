"""``Wake``: how the threads behind disaggregated serving wake the engine loop (a pipe it polls beside its input
socket)."""

from __future__ import annotations

import os
import select


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

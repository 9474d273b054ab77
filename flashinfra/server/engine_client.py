"""The server's handle on the engine process: start it, talk to it over ZeroMQ, route its outputs.

The server binds two ipc:// sockets in a private temp dir (PUSH for requests, PULL for outputs) and starts
the engine process with their addresses; the engine connects, loads the model and answers ``EngineReady``.
One asyncio task receives ``EngineOutputs`` and puts each ``RequestOutput`` on the queue its request was
submitted with; another watches the process, so that if it dies every waiting request fails with an
error instead of hanging. Owns: process lifetime, the request-id -> queue table, the in-flight limit
(429), aborts, the latest ``EngineStats``. Messages are msgspec/msgpack (``flashinfra.engine.sched.messages``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from flashinfra.engine.sched import messages as m

logger = logging.getLogger("flashinfra.server")

# (input address, output address) -> a started process that connects to both.
EngineLauncher = Callable[[str, str], Any]


class EngineDeadError(RuntimeError):
    """The engine process is gone (it crashed or was shut down)."""


class QueueFullError(RuntimeError):
    """The server already holds as many in-flight requests as it accepts."""


class EngineClient:
    """Owns the engine process and the routing of its outputs to per-request asyncio queues."""

    def __init__(self, launcher: EngineLauncher, max_pending: int = 1024,
                 on_stats: Callable[[m.EngineStats], None] | None = None):
        self._launcher = launcher
        self.max_pending = max_pending
        self._on_stats = on_stats
        self._tmpdir = tempfile.mkdtemp(prefix="flashinfra-ipc-")
        self.input_addr = f"ipc://{self._tmpdir}/input"
        self.output_addr = f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 1000)
        self._send.bind(self.input_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(self.output_addr)
        self._routes: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.process = None
        self.info: m.EngineReady | None = None
        self.stats: m.EngineStats | None = None
        self.dead_reason: str | None = None
        self._closing = False

    @property
    def num_pending(self) -> int:
        return len(self._routes)

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.dead_reason is None and not self._closing

    async def start(self, timeout_s: float = 900.0) -> m.EngineReady:
        """Start the engine process and wait until it has loaded the model."""
        self.process = self._launcher(self.input_addr, self.output_addr)
        deadline = time.monotonic() + timeout_s
        while self.info is None:
            if not self._process_alive():
                raise EngineDeadError(f"engine process exited with code {self._exitcode()} before it was ready")
            if time.monotonic() > deadline:
                self._kill()
                raise EngineDeadError(f"engine process was not ready after {timeout_s:.0f} s")
            if await self._recv.poll(200):
                message = m.decode_engine_message(await self._recv.recv())
                if isinstance(message, m.EngineError):
                    self._kill()
                    raise EngineDeadError(f"engine process failed to start: {message.message}")
                if isinstance(message, m.EngineReady):
                    self.info = message
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watch_process(), name="engine-watchdog")]
        return self.info

    async def submit(self, request_id: str, prompt_token_ids: list[int], sampling: m.SamplingParams,
                     queue: asyncio.Queue, mm_items: list | None = None) -> None:
        """Send one request to the engine; its ``RequestOutput``s will be put on ``queue``."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if request_id in self._routes:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._routes[request_id] = queue
        request = m.EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                  sampling=sampling, arrival_time=time.time(), mm_items=mm_items or [])
        await self._send.send(m.encode(request))

    def reserve(self, count: int) -> None:
        """Refuse (429) a request whose ``count`` sub-requests would exceed the in-flight limit."""
        if len(self._routes) + count > self.max_pending:
            raise QueueFullError(f"the server is at its limit of {self.max_pending} in-flight requests; "
                                 "retry later")

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine now (frees their cache); their queues get nothing more."""
        ids = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if ids and self.dead_reason is None and not self._send.closed:
            await self._send.send(m.encode(m.AbortRequest(request_ids=ids)))

    def abort_soon(self, request_ids: list[str]) -> None:
        """``abort`` from code that must not await (a cancelled stream's cleanup): the routes go now, the
        message is sent by a task of its own."""
        ids = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if ids and self.dead_reason is None and not self._send.closed:
            task = asyncio.ensure_future(self._send.send(m.encode(m.AbortRequest(request_ids=ids))))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to exit, wait for it, and release the sockets (kills it if it hangs)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.process is not None and self._process_alive():
            try:
                await self._send.send(m.encode(m.Shutdown()))
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout_s
            while self._process_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self._kill()
        self._fail_all("the server is shutting down")
        self._send.close(linger=0)
        self._recv.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def _output_loop(self) -> None:
        try:
            await self._route_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a message we cannot read: fail every request rather than hang them
            self._mark_dead(f"cannot read the engine's outputs: {type(exc).__name__}: {exc}")

    async def _route_outputs(self) -> None:
        while True:
            message = m.decode_engine_message(await self._recv.recv())
            if isinstance(message, m.EngineError):
                self._mark_dead(f"engine failed: {message.message}")
                return
            if not isinstance(message, m.EngineOutputs):
                continue
            for output in message.outputs:
                queue = self._routes.get(output.request_id)
                if queue is None:
                    continue  # aborted by the server already; late outputs are dropped
                if output.finished:
                    del self._routes[output.request_id]
                queue.put_nowait(output)
            if message.stats is not None:
                self.stats = message.stats
                if self._on_stats is not None:
                    self._on_stats(message.stats)

    async def _watch_process(self) -> None:
        while self._process_alive():
            await asyncio.sleep(0.5)
        if not self._closing:
            self._mark_dead(f"engine process exited unexpectedly with code {self._exitcode()}")

    def _mark_dead(self, reason: str) -> None:
        logger.error(reason)
        self.dead_reason = reason
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        routes, self._routes = self._routes, {}
        for request_id, queue in routes.items():
            queue.put_nowait(m.RequestOutput(request_id=request_id, new_token_ids=[], logprobs=None,
                                             finished=True, finish_reason="error", error=reason))

    def _process_alive(self) -> bool:
        proc = self.process
        if proc is None:
            return False
        if hasattr(proc, "is_alive"):
            return proc.is_alive()
        return proc.poll() is None

    def _exitcode(self) -> int | None:
        proc = self.process
        return getattr(proc, "exitcode", None) if hasattr(proc, "is_alive") else proc.returncode

    def _kill(self) -> None:
        proc = self.process
        if proc is None or not self._process_alive():
            return
        proc.kill()
        if hasattr(proc, "join"):
            proc.join(timeout=10)
        else:
            proc.wait(timeout=10)

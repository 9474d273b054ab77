"""The server's handle on the engine process: start it, talk to it over ZeroMQ, route its outputs.

The server binds two ipc:// sockets in a private temp dir (PUSH for requests, PULL for outputs) and starts
the engine process with their addresses; the engine connects, loads the model and answers ``EngineReady``.
One asyncio task receives ``EngineOutputs`` and puts each ``RequestOutput`` on the queue its request was
submitted with; one sends what ``submit``/``abort`` put on a bounded outbox (so no request handler ever
awaits a ZeroMQ send that has no receiver); and the process's sentinel fd is watched by the event loop, so
that the moment the engine dies every waiting request fails with an ``ENGINE_UNAVAILABLE`` error instead
of hanging. ``restart`` starts a new engine on fresh sockets (the server's failure policy decides whether
to call it; see ``server/supervisor.py``). Owns: process lifetime, the request-id -> queue table, the in-flight limit
(429), aborts, the latest ``EngineStats``. Messages are msgspec/msgpack (``flashinfra.engine.sched.messages``).
"""

from __future__ import annotations

import asyncio
import logging
import os
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

# Prefix of the error of every request failed because the engine went away (the server answers 503).
ENGINE_UNAVAILABLE = "the engine is not available: "
IPC_PREFIX = "flashinfra-ipc-"


def clean_stale_ipc_dirs(tmp: str | None = None) -> list[str]:
    """Remove ``flashinfra-ipc-<pid>-*`` dirs left by servers that died without cleaning up (kill -9)."""
    removed = []
    tmp = tmp or tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(IPC_PREFIX):
            continue
        pid_text = name[len(IPC_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        try:
            os.kill(pid, 0)
            continue  # its server is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        removed.append(name)
    return removed


class EngineDeadError(RuntimeError):
    """The engine process is gone (it crashed or was shut down)."""


class QueueFullError(RuntimeError):
    """The server already holds as many in-flight requests as it accepts."""


class NeverFitsError(ValueError):
    """A request asks for more in-flight sub-requests than the server ever accepts (400, not 429)."""


class EngineClient:
    """Owns the engine process and the routing of its outputs to per-request asyncio queues."""

    def __init__(self, launcher: EngineLauncher, max_pending: int = 1024,
                 on_stats: Callable[[m.EngineStats], None] | None = None,
                 on_death: Callable[[str], None] | None = None):
        self._launcher = launcher
        self.max_pending = max_pending
        self._on_stats = on_stats
        self._on_death = on_death
        clean_stale_ipc_dirs()
        self._tmpdir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        self._generation = 0
        self._ctx = zmq.asyncio.Context()
        self._send = self._recv = None
        self._open_sockets()
        self._routes: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._outbox: asyncio.Queue | None = None
        self._sentinel: int | None = None
        self.process = None
        self.info: m.EngineReady | None = None
        self.stats: m.EngineStats | None = None
        self.dead_reason: str | None = None
        self.restarts = 0
        self._closing = False

    def _open_sockets(self) -> None:
        """Bind a fresh PUSH/PULL pair (a restarted engine never sees what was queued for the dead one)."""
        for sock in (self._send, self._recv):
            if sock is not None:
                sock.close(linger=0)
        self._generation += 1
        self.input_addr = f"ipc://{self._tmpdir}/input-{self._generation}"
        self.output_addr = f"ipc://{self._tmpdir}/output-{self._generation}"
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.bind(self.input_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(self.output_addr)

    @property
    def num_pending(self) -> int:
        return len(self._routes)

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.dead_reason is None and not self._closing

    async def start(self, timeout_s: float = 900.0) -> m.EngineReady:
        """Start the engine process and wait until it has loaded the model."""
        self.info = None
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
        self.dead_reason = None
        # Room for every in-flight request plus its abort: a full outbox means the engine is not reading.
        self._outbox = asyncio.Queue(maxsize=2 * self.max_pending + 64)
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._send_loop(), name="engine-sender")]
        self._watch_process()
        return self.info

    async def restart(self, timeout_s: float = 900.0) -> m.EngineReady:
        """Start a new engine after the old one died (its requests were failed already)."""
        await self._stop_tasks()
        self._kill()
        self._open_sockets()
        self.restarts += 1
        return await self.start(timeout_s)

    async def submit(self, requests: list[tuple[str, list[int], m.SamplingParams, list, m.TransferParams | None]],
                     queue: asyncio.Queue) -> None:
        """Send (request id, prompt token ids, sampling, images/videos, disaggregated transfer or None) requests
        to the engine in one message, so the images and videos they share travel once; their
        ``RequestOutput``s will be put on ``queue``."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        ids = [request_id for request_id, *_ in requests]
        if len(set(ids)) != len(ids) or any(rid in self._routes for rid in ids):
            raise ValueError(f"duplicate request id among {ids}")
        now = time.time()
        message = m.EngineRequests.shared_media([
            m.EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, arrival_time=now,
                            mm_items=mm_items or [], transfer=transfer)
            for rid, prompt, sampling, mm_items, transfer in requests])
        try:
            self._outbox.put_nowait(m.encode(message))
        except asyncio.QueueFull:
            raise EngineDeadError("the engine is not reading its requests") from None
        for rid in ids:
            self._routes[rid] = queue

    def reserve(self, count: int) -> None:
        """Refuse (429) a request whose ``count`` sub-requests would exceed the in-flight limit."""
        if count > self.max_pending:
            raise NeverFitsError(f"the request has {count} sub-requests (prompts x n), more than the "
                                 f"{self.max_pending} in-flight sub-requests this server ever accepts")
        if len(self._routes) + count > self.max_pending:
            raise QueueFullError(f"the server is at its limit of {self.max_pending} in-flight requests; "
                                 "retry later")

    async def abort(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine now (frees their cache); their queues get nothing more."""
        self.abort_soon(request_ids)

    def abort_soon(self, request_ids: list[str]) -> None:
        """Drop the routes now and queue the abort for the sender (never blocks)."""
        ids = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if ids and self.healthy and self._outbox is not None:
            try:
                self._outbox.put_nowait(m.encode(m.AbortRequest(request_ids=ids)))
            except asyncio.QueueFull:
                pass  # the engine is not reading; its death will be noticed by the sentinel

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the engine to exit, wait for it, and release the sockets (kills it if it hangs)."""
        self._closing = True
        await self._stop_tasks()
        if self.process is not None and self._process_alive():
            try:  # bounded: an engine that reads nothing any more is killed below
                await asyncio.wait_for(self._send.send(m.encode(m.Shutdown())), timeout=2.0)
            except (zmq.ZMQError, asyncio.TimeoutError):
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

    def cleanup_files(self) -> None:
        """Remove the IPC dir (also called at interpreter exit, whatever path the server took)."""
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def _stop_tasks(self) -> None:
        self._unwatch_process()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _send_loop(self) -> None:
        outbox = self._outbox
        while True:
            data = await outbox.get()
            await self._send.send(data)

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

    def _watch_process(self) -> None:
        """Notice the engine's exit the moment it happens: the event loop watches the process sentinel (a
        multiprocessing.Process) or a pidfd (a Popen); polling only where neither exists."""
        loop = asyncio.get_running_loop()
        proc = self.process
        fd = getattr(proc, "sentinel", None)
        if fd is None and hasattr(os, "pidfd_open") and getattr(proc, "pid", None):
            try:
                fd = os.pidfd_open(proc.pid)
                self._own_fd = fd
            except OSError:
                fd = None
        if fd is not None:
            self._sentinel = fd
            loop.add_reader(fd, self._on_process_exit)
        else:
            self._tasks.append(asyncio.create_task(self._poll_process(), name="engine-watchdog"))
        if not self._process_alive():
            self._on_process_exit()

    def _unwatch_process(self) -> None:
        if self._sentinel is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._sentinel)
            except (RuntimeError, ValueError):
                pass
            self._sentinel = None
        own = getattr(self, "_own_fd", None)
        if own is not None:
            os.close(own)
            self._own_fd = None

    def _on_process_exit(self) -> None:
        if self._sentinel is not None:
            asyncio.get_running_loop().remove_reader(self._sentinel)
            self._sentinel = None
        if not self._closing and self.dead_reason is None:
            if hasattr(self.process, "join"):
                self.process.join(timeout=1)
            elif hasattr(self.process, "wait"):
                self.process.wait(timeout=1)
            self._mark_dead(f"engine process exited unexpectedly with code {self._exitcode()}")

    async def _poll_process(self) -> None:
        while self._process_alive():
            await asyncio.sleep(0.05)
        self._on_process_exit()

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error(reason)
        self.dead_reason = reason
        # The sender may be stuck in a send nobody receives: stop it, drop what it held.
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self._outbox is not None:
            while not self._outbox.empty():
                self._outbox.get_nowait()
        self._fail_all(ENGINE_UNAVAILABLE + reason)
        if self._on_death is not None and not self._closing:
            self._on_death(reason)

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

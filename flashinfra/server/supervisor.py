"""What the server does when its engine process dies: the ``--engine-failure`` policy.

``restart`` (the default): every in-flight request has already been failed with 503 ``engine_unavailable``
by the engine client, new requests are refused with 503 while a new engine starts, up to
``--engine-restart-attempts`` tries with exponential backoff (1 s, 2 s, 4 s, ...); when every try fails the
server exits non-zero. ``exit``: the server shuts down at once and exits with ``EXIT_ENGINE_FAILED`` so that
a supervisor (systemd, Kubernetes) restarts the whole server. ``/health``, ``/v1/models`` and ``/metrics``
all read the same ``EngineClient.healthy``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from flashinfra.server.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger("flashinfra.server")

POLICIES = ("restart", "exit")
EXIT_ENGINE_FAILED = 3


@dataclass
class ServerOutcome:
    """Filled while the server runs; ``serve`` exits with ``exit_code``."""

    exit_code: int = 0
    error: str | None = None  # why the server could not start, when it could not
    request_exit: Callable[[], None] | None = None  # how to stop the HTTP server (set by serve)


def request_server_exit() -> None:
    """Make uvicorn shut down as on SIGTERM (it drains, then runs the lifespan exit)."""
    os.kill(os.getpid(), signal.SIGTERM)


class EngineSupervisor:
    def __init__(self, client: EngineClient, policy: str, outcome: ServerOutcome, max_attempts: int = 3,
                 backoff_s: float = 1.0, start_timeout_s: float = 900.0,
                 request_exit: Callable[[], None] = request_server_exit):
        if policy not in POLICIES:
            raise ValueError(f"engine failure policy must be one of {POLICIES}, got {policy!r}")
        self.client = client
        self.policy = policy
        self.outcome = outcome
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.start_timeout_s = start_timeout_s
        self._request_exit = request_exit
        self._task: asyncio.Task | None = None

    def on_death(self, reason: str) -> None:
        if self._task is not None and not self._task.done():
            return
        self._task = asyncio.get_running_loop().create_task(self._handle(reason), name="engine-supervisor")

    async def _handle(self, reason: str) -> None:
        if self.policy == "exit":
            logger.error("engine failed (%s); exiting (--engine-failure exit)", reason)
            self._exit()
            return
        for attempt in range(self.max_attempts):
            delay = self.backoff_s * 2 ** attempt
            logger.warning("engine failed (%s); restarting it in %.1f s (attempt %d of %d)", reason, delay,
                           attempt + 1, self.max_attempts)
            await asyncio.sleep(delay)
            try:
                await self.client.restart(self.start_timeout_s)
            except (EngineDeadError, OSError) as exc:
                reason = str(exc)
                continue
            logger.warning("engine restarted (%d restarts so far)", self.client.restarts)
            return
        logger.error("the engine could not be restarted after %d attempts (%s); exiting", self.max_attempts,
                     reason)
        self._exit()

    def _exit(self) -> None:
        self.outcome.exit_code = EXIT_ENGINE_FAILED
        (self.outcome.request_exit or self._request_exit)()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

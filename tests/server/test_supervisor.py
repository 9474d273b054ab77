"""The --engine-failure policy, on a stand-in engine client (no processes)."""

from __future__ import annotations

import asyncio

import pytest

from flashinfra.server.engine_client import EngineDeadError
from flashinfra.server.supervisor import EXIT_ENGINE_FAILED, EngineSupervisor, ServerOutcome


class FakeClient:
    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0
        self.restarts = 0

    async def restart(self, timeout_s: float):
        self.calls += 1
        if self.calls <= self.failures:
            raise EngineDeadError("engine process exited with code 1 before it was ready")
        self.restarts += 1


def _run(policy: str, failures: int, attempts: int = 3):
    async def main():
        client = FakeClient(failures)
        exits = []
        outcome = ServerOutcome()
        sup = EngineSupervisor(client, policy, outcome, attempts, backoff_s=0.001,
                               request_exit=lambda: exits.append(True))
        sup.on_death("killed")
        sup.on_death("killed again")  # one handler at a time
        await sup._task
        return client, outcome, exits

    return asyncio.run(main())


def test_restart_retries_with_backoff_then_serves():
    client, outcome, exits = _run("restart", failures=2)
    assert client.calls == 3 and client.restarts == 1 and not exits and outcome.exit_code == 0


def test_restart_gives_up_and_exits_nonzero():
    client, outcome, exits = _run("restart", failures=10, attempts=3)
    assert client.calls == 3 and exits and outcome.exit_code == EXIT_ENGINE_FAILED


def test_exit_policy_exits_at_once():
    client, outcome, exits = _run("exit", failures=0)
    assert client.calls == 0 and exits and outcome.exit_code == EXIT_ENGINE_FAILED


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        EngineSupervisor(FakeClient(0), "pray", ServerOutcome())

"""How the ranks of one engine start and meet, and how rank 0 notices a rank lost while they do.

Two ways to start, one rendezvous:

- the engine starts its ranks: rank 0 lives where the engine lives (the ``LLM`` object's process or the
  server's engine process) and starts the other ranks of its host as fresh interpreters; hosts other than
  0 start theirs with ``--node-rank k``. They meet at ``tcp://master_addr:master_port``.
- a launcher starts them (``torchrun``, or Slurm/Kubernetes wrappers that set the same variables): every
  process is one rank, ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` say which, and they meet at ``env://``.

Joining is bounded: every process group is created with the engine's ``dist_timeout_s``, and rank 0 joins
on a helper thread while it watches the processes of the ranks it started, so a rank that dies while
the world forms fails rank 0 at once (``RankLost``, with its exit code) instead of after the timeout.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

import msgspec

from flashinfra.engine.config import EngineConfig
from flashinfra.env import TorchrunEnv
from flashinfra.parallel.layout import world_size

WATCH_INTERVAL_S = 0.05
_T = TypeVar("_T")


class RankLost(RuntimeError):
    """A rank of the engine exited or stopped answering; the message names it."""


@dataclass(frozen=True)
class Launch:
    """This process's part: its rank, device, where the ranks meet, and the ranks it starts itself."""

    rank: int
    world: int
    device: str
    init_method: str
    spawn: tuple[int, ...]


def config_world(config: EngineConfig) -> int:
    """Ranks of the engine: max(tp, ep) for tensor/expert parallelism, times the context-parallel size (which
    combines with tensor parallelism; ``check_layout`` refuses it with expert parallelism)."""
    return world_size(config.tensor_parallel_size, config.expert_parallel_size) * config.context_parallel_size


def resolve_world(config: EngineConfig, torchrun: TorchrunEnv | None) -> EngineConfig:
    """``config`` under a launcher's ``WORLD_SIZE``: tensor parallel over all of it when no size is given;
    ``ValueError`` with both numbers when the sizes given need another world."""
    if torchrun is None or torchrun.world_size == 1:
        return config
    world = config_world(config)
    if world == 1:
        return dataclasses.replace(config, tensor_parallel_size=torchrun.world_size)
    if world != torchrun.world_size:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} and expert_parallel_size "
                         f"{config.expert_parallel_size} need max(tp, ep) = {world} ranks, but the launcher "
                         f"started WORLD_SIZE={torchrun.world_size}")
    return config


def ranks_per_node(config: EngineConfig) -> int:
    world, n = config_world(config), config.nnodes
    if world % n:
        raise ValueError(f"the world of {world} ranks (max of tensor_parallel_size and expert_parallel_size) "
                         f"is not divisible by nnodes {n}")
    return world // n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _device(config: EngineConfig, local_rank: int) -> str:
    return f"cuda:{local_rank}" if config.device.startswith("cuda") else config.device


def launch_of(config: EngineConfig, torchrun: TorchrunEnv | None) -> Launch:
    """This process's part in the world of ``config`` (resolved by ``resolve_world``)."""
    world = config_world(config)
    if torchrun is not None and torchrun.world_size > 1:
        return Launch(torchrun.rank, world, _device(config, torchrun.local_rank), "env://", ())
    per = ranks_per_node(config)
    if config.node_rank == 0:
        if config.nnodes > 1 and config.master_port == 0:
            raise ValueError("several hosts (--nnodes > 1) need an explicit --master-port that every host uses")
        init = f"tcp://{config.master_addr}:{config.master_port or _free_port()}"
        return Launch(0, world, _device(config, 0), init, tuple(range(1, per)))
    if config.master_port == 0:
        raise ValueError("--node-rank >= 1 needs the explicit --master-port of host 0")
    first = config.node_rank * per
    return Launch(first, world, _device(config, 0), f"tcp://{config.master_addr}:{config.master_port}",
                  tuple(range(first, first + per)))


def start_workers(config: EngineConfig, launch: Launch) -> dict[int, subprocess.Popen]:
    """The ranks ``launch.spawn`` as fresh interpreters (``python -m flashinfra.parallel.engine RANK INIT
    DEVICE``, config on stdin): the engine process that starts them is itself a daemon process, which
    multiprocessing forbids to have children, and a fresh interpreter shares no CUDA state with its parent."""
    payload = msgspec.msgpack.encode(config)
    per = ranks_per_node(config)
    procs = {}
    for rank in launch.spawn:
        p = subprocess.Popen([sys.executable, "-m", "flashinfra.parallel.engine", str(rank), launch.init_method,
                              _device(config, rank % per)], stdin=subprocess.PIPE)
        p.stdin.write(payload)
        p.stdin.close()
        procs[rank] = p
    return procs


def exited(workers: dict[int, subprocess.Popen]) -> list[str]:
    return [f"rank {r} (pid {p.pid}) exited with code {p.returncode}" for r, p in workers.items()
            if p.poll() is not None]


def watched(fn: Callable[[], _T], workers: dict[int, subprocess.Popen], what: str) -> _T:
    """``fn()``, run on a helper thread while ``workers`` are watched: ``RankLost`` as soon as one exits
    before ``fn`` returns. ``fn`` must be bounded itself (timeouts): the thread it runs on cannot be
    stopped, only left to fail, so the process should not join another world after ``RankLost``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=run, name="flashinfra-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WATCH_INTERVAL_S)
        dead = exited(workers)
        if dead and thread.is_alive():
            raise RankLost(f"{what}: " + "; ".join(dead))
    if "error" in box:
        raise box["error"]
    return box["value"]


def stop_workers(workers: dict[int, subprocess.Popen], timeout_s: float = 10) -> None:
    for p in workers.values():
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def kill_workers(workers: dict[int, subprocess.Popen]) -> None:
    for p in workers.values():
        if p.poll() is None:
            p.kill()
    for p in workers.values():
        p.wait()

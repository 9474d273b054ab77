"""Process groups: ``init_distributed`` joins (or creates) the world over torch.distributed.

gloo on the CPU, NCCL on CUDA. Rendezvous is torchrun's ``env://`` (``MASTER_ADDR``/``MASTER_PORT``,
read by torch itself) unless an explicit ``tcp://host:port`` is given. Every collective carries
``timeout_s``: a rank that dies or hangs makes its peers' next collective raise instead of waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    backend: str


def default_backend(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_distributed(rank: int, world_size: int, device: str = "cpu", init_method: str = "env://",
                     backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the default process group (a no-op when it already exists with this rank and size)."""
    backend = backend or default_backend(device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"torch.distributed already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, asked for rank {rank} of {world_size}")
        return DistInfo(rank, world_size, dist.get_backend())
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, backend)


CONTROL_TIMEOUT = timedelta(days=365)


def control_group():
    """A gloo group over every rank for plans (see ``collectives.Comm.broadcast_bytes``); collective."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

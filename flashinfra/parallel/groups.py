"""Process groups: ``init_distributed`` joins (or creates) the world over torch.distributed, ``make_comms``
creates a rank's tensor-parallel and MoE groups, ``make_context_comms`` its tensor- and context-parallel groups
when both are on, ``control_channel`` the plans' group.

gloo on the CPU, NCCL on CUDA. Rendezvous is torchrun's ``env://`` (``MASTER_ADDR``/``MASTER_PORT``,
read by torch itself) unless an explicit ``tcp://host:port`` is given. Every group carries ``timeout_s``:
creating it, and every collective on it, fails after that long instead of waiting forever for a rank
that died or hung.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flashinfra.parallel.collectives import Comm, ControlChannel, ParallelComms
from flashinfra.parallel.layout import ParallelLayout

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


def make_comms(layout: ParallelLayout, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelComms:
    """This rank's ``Comm`` per group of ``layout``; collective: every rank of the world calls it, and
    every rank creates every group (torch.distributed requires it), in the same order."""
    made: dict[tuple[int, ...], Comm] = {}
    for size, mine in ((layout.tp, layout.tp_ranks), (layout.moe_size, layout.moe_ranks)):
        if mine in made or size == 1:
            continue
        if size == layout.world:
            made[mine] = Comm(size)  # the default group
            continue
        for ranks in layout.groups(size):
            group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if ranks == mine:
                made[mine] = Comm(size, group)
    tp = made.get(layout.tp_ranks, Comm(1))
    return ParallelComms(tp, made.get(layout.moe_ranks, Comm(1)))


def make_context_comms(tp: int, cp: int, rank: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[ParallelComms, Comm]:
    """Tensor parallelism inside context parallelism, world ``tp x cp``: rank ``r`` is tensor-parallel rank
    ``r % tp`` of the consecutive ranks ``[r // tp * tp, +tp)`` (one replica of the model, split by heads; its
    MoE group the same) and context-parallel rank ``r // tp`` of the ranks ``r % tp + i tp`` (the same shard in
    every replica) -> (its tensor-parallel comms, its context-parallel ``Comm``); collective: every rank
    creates every group, in the same order."""
    timeout = timedelta(seconds=timeout_s)
    tp_comm, cp_comm = Comm(1), Comm(cp)
    if tp > 1:
        for c in range(cp):
            ranks = list(range(c * tp, (c + 1) * tp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                tp_comm = Comm(tp, group)
        for t in range(tp):
            ranks = list(range(t, tp * cp, tp))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                cp_comm = Comm(cp, group)
    return ParallelComms(tp_comm, tp_comm), cp_comm


def control_channel(timeout_s: float = DEFAULT_TIMEOUT_S) -> ControlChannel:
    """A gloo group over every rank for plans (see ``ControlChannel``); collective."""
    return ControlChannel(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

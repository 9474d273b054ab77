"""The collectives of a sharded model (``Comm``, one per process group) and rank 0's control channel.

- ``Comm.all_reduce``: sum of partial outputs (attention o_proj, MLP down_proj, MoE combine, vocab-split
  embedding). In place, so it can sit inside a captured CUDA graph with NCCL.
- ``Comm.all_gather_last``: the vocab-split lm_head's logits, concatenated along the last dimension.
- ``Comm.all_gather``: one tensor per rank, stacked (context parallelism: KDA transition maps, conv halos,
  the prompt's MLA latent and indexer keys).
- ``Comm.all_to_all``: rows of uneven counts from every rank to every rank (context parallelism: the latent rows
  that each rank's top-k selects from the others' tokens, under Layer Split).
- ``Comm.broadcast`` / ``broadcast_async``: a tensor from one rank (Layer Split: a layer's cache from its
  owner, issued one layer ahead and waited for before use).
- ``ControlChannel``: a step's plan (msgspec bytes) from rank 0 to every rank, as a length then a uint8
  tensor over a CPU (gloo) group, so the scheduler stays torch-free and runs once. The group's timeout
  bounds every message: a rank 0 that hangs makes its workers fail instead of waiting forever. Rank 0
  therefore sends a keepalive whenever it has been idle for a quarter of that timeout, so an engine
  without requests keeps its workers. A peer that dies closes its connections, which fails a pending
  message at once.

A group of one rank has no process group: its ``Comm`` returns its input and counts nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

STOP, KEEPALIVE = 0, -1  # message lengths that carry no bytes


class Comm:
    def __init__(self, world: int, group=None):
        self.world, self.group = world, group
        self.calls = 0  # collectives issued, for counting per step in tests and benchmarks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        self.calls += 1
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        self.calls += 1
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of every rank (same shape on each) -> ``[world, *x.shape]``."""
        if self.world == 1:
            return x[None]
        self.calls += 1
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of ``x`` to each rank: the first ``send[0]`` to rank 0, the next ``send[1]`` to rank 1...; ->
        the rows every rank sent this one, ``recv[r]`` from rank ``r``, in rank order."""
        if self.world == 1:
            return x
        self.calls += 1
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``x`` into ``x`` of every rank (``src`` counted within the group)."""
        if self.world == 1:
            return x
        self.calls += 1
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast(x, root, group=self.group)
        return x

    def broadcast_async(self, x: torch.Tensor, src: int):
        """``broadcast`` without waiting: the returned handle's ``wait()`` must run before ``x`` is read on a
        receiving rank (or written on ``src``)."""
        if self.world == 1:
            return _DONE
        self.calls += 1
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        return dist.broadcast(x, root, group=self.group, async_op=True)


@dataclass(frozen=True)
class ParallelComms:
    """The groups one rank reduces over: ``tp`` (attention, dense MLPs, vocabulary) and ``moe`` (the MoE
    group of ``layout.py``; the same object as ``tp`` when the groups coincide)."""

    tp: Comm
    moe: Comm

    @classmethod
    def local(cls) -> ParallelComms:
        """No collectives: for slicing weights without a world (tests, sizing)."""
        one = Comm(1)
        return cls(one, one)

    @property
    def calls(self) -> int:
        return self.tp.calls + (self.moe.calls if self.moe is not self.tp else 0)


class ControlChannel:
    """Rank ``src``'s messages to every rank of ``group`` (a gloo group whose timeout bounds each one)."""

    def __init__(self, group, src: int = 0):
        self.group, self.src = group, src
        self.lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.busy = False  # rank 0 is running a step: its workers are too, and read the next message after it
        self._stop = threading.Event()

    def _send_length(self, n: int) -> None:
        dist.broadcast(torch.tensor([n], dtype=torch.long), self.src, group=self.group)

    def send(self, data: bytes) -> None:
        """Rank ``src``: ``data`` to every rank, which then works on it until ``done()``; ``b""`` tells them
        to stop."""
        with self.lock:
            self._send_length(len(data))
            if data:
                dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.src, group=self.group)
            self.busy = bool(data)

    def done(self) -> None:
        """Rank ``src``: the work on the last message is over; idle time counts from now."""
        with self.lock:
            self.busy = False
            self.last_sent = time.monotonic()

    def recv(self) -> bytes:
        """Any other rank: the next message (keepalives skipped); ``b""`` when rank ``src`` stops."""
        while True:
            n = torch.empty(1, dtype=torch.long)
            dist.broadcast(n, self.src, group=self.group)
            if int(n) != KEEPALIVE:
                break
        if int(n) == STOP:
            return b""
        buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, self.src, group=self.group)
        return buf.numpy().tobytes()

    def start_keepalive(self, interval_s: float, on_error) -> None:
        """Rank ``src``: a daemon thread that sends a keepalive after ``interval_s`` without a message while
        no step runs; ``on_error(exc)`` once if one fails (a rank is gone)."""
        self.done()

        def loop():
            while not self._stop.wait(interval_s / 4):
                with self.lock:
                    if self.busy or time.monotonic() - self.last_sent < interval_s:
                        continue
                    try:
                        self._send_length(KEEPALIVE)
                    except Exception as e:  # noqa: BLE001 - reported to the engine, which fails its requests
                        on_error(e)
                        return
                    self.last_sent = time.monotonic()

        threading.Thread(target=loop, name="flashinfra-keepalive", daemon=True).start()

    def stop_keepalive(self) -> None:
        self._stop.set()

class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> None:
        return None


_DONE = _Done()

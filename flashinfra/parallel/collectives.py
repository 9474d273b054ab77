"""The collectives the sharded model uses, over one group; every one is a no-op on a world of one.

- ``all_reduce``: sum of partial outputs (attention o_proj, MLP down_proj, MoE combine, vocab-split
  embedding). In place, so it can sit inside a captured CUDA graph with NCCL.
- ``all_gather_last``: the vocab-split lm_head's logits, concatenated along the last dimension.
- ``all_gather``: one tensor per rank, stacked (context parallelism: KDA transition maps, conv halos, the
  prompt's MLA latent and indexer keys).
- ``broadcast`` / ``broadcast_async``: a tensor from one rank (Layer Split: a layer's cache from its owner,
  issued one layer ahead and waited for before use).
- ``broadcast_bytes``: a step's plan (msgspec bytes) from rank 0 to every rank, as a length then a
  uint8 tensor, so the scheduler stays torch-free and runs once. It goes over ``control_group``, a CPU
  (gloo) group without a practical timeout: a worker may wait for the next plan as long as the engine
  stays idle, while the compute collectives keep the short timeout that catches a hung rank. A peer
  that dies closes its connections, which fails a pending broadcast at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, world: int, group=None, device: str | torch.device = "cpu", control_group=None):
        self.world, self.group, self.device = world, group, torch.device(device)
        self.control_group = control_group
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

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src`` passes ``data``; every rank gets it back."""
        if self.world == 1:
            return data
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
        dist.broadcast(n, src, group=self.control_group)
        if n.item() == 0:
            return b""
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
               else torch.empty(int(n.item()), dtype=torch.uint8))
        dist.broadcast(buf, src, group=self.control_group)
        return buf.numpy().tobytes()


class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> None:
        return None


_DONE = _Done()

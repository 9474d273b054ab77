"""The collectives the sharded model uses, over one group; every one is a no-op on a world of one.

- ``all_reduce``: sum of partial outputs (attention o_proj, MLP down_proj, MoE combine, vocab-split
  embedding). In place, so it can sit inside a captured CUDA graph with NCCL.
- ``all_gather_last``: the vocab-split lm_head's logits, concatenated along the last dimension.
- ``broadcast_bytes``: a step's plan (msgspec bytes) from rank 0 to every rank, as a length then a
  uint8 tensor, so the scheduler stays torch-free and runs once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, world: int, group=None, device: str | torch.device = "cpu"):
        self.world, self.group, self.device = world, group, torch.device(device)
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

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src`` passes ``data``; every rank gets it back."""
        if self.world == 1:
            return data
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.long, device=self.device)
        dist.broadcast(n, src, group=self.group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data is not None
               else torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        dist.broadcast(buf, src, group=self.group)
        return bytes(buf.cpu().numpy())

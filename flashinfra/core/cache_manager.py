"""Hybrid cache manager: who owns which paged block and which KDA state slot.

GLM-5.3-Flash keeps two kinds of per-request cache. MLA latents and indexer keys grow with the sequence
and live in fixed-size paged blocks (``block_size`` tokens each); KDA conv and recurrent states are
constant-size and live in one state slot per running request. A request can run only when it holds a slot
and enough blocks for every token it has computed plus the ones scheduled now, so admission checks both.
The tensors themselves belong to ``ModelCache``; this module only hands out ids. Pure Python; no torch.
"""

from __future__ import annotations

from collections import deque

from flashinfra.core.request import Request


class _IdPool:
    """Free-list of integer ids ``0 .. n-1``; freed ids are reused first (they are likely still hot)."""

    def __init__(self, n: int, what: str) -> None:
        if n < 1:
            raise ValueError(f"need at least one {what}, got {n}")
        self.total = n
        self.what = what
        self._free: deque[int] = deque(range(n))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free {self.what}")
        i = self._free.popleft()
        self._in_use.add(i)
        return i

    def give(self, i: int) -> None:
        if i not in self._in_use:
            raise RuntimeError(f"{self.what} {i} freed twice or never taken")
        self._in_use.remove(i)
        self._free.appendleft(i)


class HybridCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks = _IdPool(num_blocks, "cache block")
        self._slots = _IdPool(num_slots, "KDA state slot")

    @property
    def num_blocks(self) -> int:
        return self._blocks.total

    @property
    def num_slots(self) -> int:
        return self._slots.total

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence that fits in the whole cache."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks ``req`` must still acquire to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        if req.state_slot is None and self._slots.num_free == 0:
            return False
        return self.num_new_blocks(req, num_tokens) <= self._blocks.num_free

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Give ``req`` a state slot (if it has none) and blocks for ``num_tokens`` tokens."""
        if not self.can_allocate(req, num_tokens):
            raise RuntimeError(f"cannot allocate {num_tokens} tokens for request {req.request_id!r}")
        if req.state_slot is None:
            req.state_slot = self._slots.take()
        for _ in range(self.num_new_blocks(req, num_tokens)):
            req.block_ids.append(self._blocks.take())

    def free(self, req: Request) -> None:
        """Return everything ``req`` holds; its cache content is forgotten (it restarts from token 0)."""
        for b in reversed(req.block_ids):
            self._blocks.give(b)
        req.block_ids = []
        if req.state_slot is not None:
            self._slots.give(req.state_slot)
            req.state_slot = None

    def block_usage(self) -> float:
        return 1.0 - self._blocks.num_free / self._blocks.total

    def slot_usage(self) -> float:
        return 1.0 - self._slots.num_free / self._slots.total

"""Hybrid cache manager: who owns which paged block and which KDA state slot, and the prefix cache.

GLM-5.3-Flash keeps two kinds of per-request cache. MLA latents and indexer keys grow with the sequence
and live in fixed-size paged blocks (``block_size`` tokens each); KDA conv and recurrent states are
constant-size and live in one state slot per running request. A request can run only when it holds a slot
and enough blocks for every token it has computed plus the ones scheduled now, so admission checks both.

Prefix caching: the KDA state after a prefix cannot be rebuilt from the paged blocks, so a cached prefix
is a pair: the full blocks of its first ``c`` tokens (shared read-only, reference-counted) and a
checkpoint of the KDA state after exactly ``c`` tokens, kept in one of ``num_prefix_slots`` extra state
slots (ids ``num_slots ..``). ``c`` is a block boundary before a prompt's last token, so a hit always
leaves at least one token to compute. A hit is token-exact: the stored prefix is compared, not just
its hash, and so are the content hashes of the images/videos within it (same-size images have the same
placeholder tokens). Cached prefixes are evicted least-recently-used first, before any request is preempted.
Besides the last KDA chunk boundary of each prompt (its last block boundary where it is shorter than a chunk),
prefixes are also checkpointed every ``checkpoint_interval`` tokens, so requests that share only a long system
prompt find a hit too. One step may cross several checkpoint positions; each registers its own entry, sharing
the first blocks with the shorter ones.

The tensors themselves belong to ``ModelCache``; this module only hands out ids. Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from flashinfra.engine.sched.request import Request


class _IdPool:
    """Free-list of integer ids ``base .. base+n-1``; freed ids are reused first (they are likely hot)."""

    def __init__(self, n: int, what: str, base: int = 0) -> None:
        self.total = n
        self.what = what
        self._free: deque[int] = deque(range(base, base + n))
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


class _BlockPool:
    """Reference-counted blocks: a block returns to the free list when its last holder lets go. References
    held by cached prefixes are also counted apart, so blocks that only the prefix cache holds (reclaimable
    by eviction) are not reported as used. References are added and dropped a list of distinct blocks at a time, as
    arrays: a 1M-token prompt's prefix holds 65,536 blocks, which one call at a time took a tenth of a second."""

    def __init__(self, n: int) -> None:
        self.total = n
        self._free: deque[int] = deque(range(n))
        self._refs = np.zeros(n, dtype=np.int32)
        self._prefix_refs = np.zeros(n, dtype=np.int32)
        self.num_cached_only = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _cached_only(self, b: np.ndarray) -> int:
        refs = self._refs[b]
        return int(np.count_nonzero((refs > 0) & (refs == self._prefix_refs[b])))

    def take(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def share(self, blocks: list[int], by_prefix: bool = False) -> None:
        """One more reference to each of ``blocks`` (distinct, each held)."""
        b = np.asarray(blocks, dtype=np.int64)
        if (self._refs[b] < 1).any():
            raise RuntimeError(f"cache blocks {b[self._refs[b] < 1][:4].tolist()} shared while free")
        before = self._cached_only(b)
        self._refs[b] += 1
        if by_prefix:
            self._prefix_refs[b] += 1
        self.num_cached_only += self._cached_only(b) - before

    def release(self, blocks: list[int], by_prefix: bool = False) -> None:
        """One reference less to each of ``blocks`` (distinct); those left with none go to the free list's front,
        the last of ``blocks`` first."""
        b = np.asarray(blocks, dtype=np.int64)
        bad = (self._refs[b] < 1) | ((self._prefix_refs[b] < 1) & by_prefix)
        if bad.any():
            raise RuntimeError(f"cache blocks {b[bad][:4].tolist()} freed twice or never taken")
        before = self._cached_only(b)
        self._refs[b] -= 1
        if by_prefix:
            self._prefix_refs[b] -= 1
        self.num_cached_only += self._cached_only(b) - before
        self._free.extendleft(b[self._refs[b] == 0].tolist())


@dataclass
class PrefixEntry:
    """A cached prefix. Its tokens are the first ``length`` of ``source``, the token list of the request that cached
    it, shared rather than copied: a request's list only grows (a 1M-token prompt's copy took 18 ms a checkpoint)."""
    source: list[int]
    length: int  # c, a multiple of block_size
    block_ids: np.ndarray  # its c / block_size full blocks (an array: shared and released as one)
    slot: int  # checkpoint slot holding the KDA state after the prefix
    mm_hashes: tuple[str, ...] = ()  # content of the images/videos within the prefix

    def holds(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` start with this prefix (a hash match checked token by token)."""
        return len(tokens) >= self.length and tokens[: self.length] == self.source[: self.length]


class HybridCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, num_prefix_slots: int = 0,
                 checkpoint_interval: int = 1024, align: int = 1, chunk: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1 or num_slots < 1 or num_prefix_slots < 0:
            raise ValueError(f"need >= 1 block and slot, got {num_blocks} blocks, {num_slots} slots, "
                             f"{num_prefix_slots} prefix slots")
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1, got {checkpoint_interval}")
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        self.block_size = block_size
        # checkpoints sit on multiples of ``grain``: whole blocks, and in deterministic mode (``align`` > 1) whole
        # KDA chunks too, where the tokens after a hit must leave at least 2 prompt tokens (a 1-token prompt piece
        # on a cached state would run the decode kernel's arithmetic)
        self.grain = math.lcm(block_size, align)
        self.min_left = 1 if align == 1 else 2
        # a prompt's last checkpoint on a multiple of the KDA prefill's chunk too (``chunk``) where the prompt has
        # one: there the prefill writes the state anyway, where inside a chunk a pass of its own over the chunk's
        # head would reach it (every KDA layer, every prompt); a hit then recomputes under a chunk more
        self.last_grain = math.lcm(self.grain, chunk)
        # rounded up to whole grains: a checkpoint's prefix is made of full blocks
        self.checkpoint_interval = -(-checkpoint_interval // self.grain) * self.grain
        self._blocks = _BlockPool(num_blocks)
        self._slots = _IdPool(num_slots, "KDA state slot")
        self._prefix_slots = _IdPool(num_prefix_slots, "prefix checkpoint slot", base=num_slots)
        self._prefixes: OrderedDict[int, PrefixEntry] = OrderedDict()  # LRU order, oldest first

    # ---- sizes and usage ----
    @property
    def num_blocks(self) -> int:
        return self._blocks.total

    @property
    def num_slots(self) -> int:
        return self._slots.total

    @property
    def num_prefix_slots(self) -> int:
        return self._prefix_slots.total

    @property
    def prefix_caching(self) -> bool:
        return self._prefix_slots.total > 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (blocks held only by cached prefixes are not counted)."""
        return self._blocks.num_free

    @property
    def num_reclaimable_blocks(self) -> int:
        """Free blocks plus blocks that only cached prefixes hold (freed by eviction on demand)."""
        return self._blocks.num_free + self._blocks.num_cached_only

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_cached_prefixes(self) -> int:
        return len(self._prefixes)

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence that fits in the whole cache."""
        return self.num_blocks * self.block_size

    def block_usage(self) -> float:
        """Fraction of blocks held by requests (blocks held only by cached prefixes count as free)."""
        return 1.0 - self.num_reclaimable_blocks / self._blocks.total

    def slot_usage(self) -> float:
        return 1.0 - self._slots.num_free / self._slots.total

    # ---- per-request blocks and slot ----
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks ``req`` must still acquire to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(req.block_ids))

    def can_allocate(self, req: Request, num_tokens: int) -> bool:
        """Whether ``req`` can hold ``num_tokens`` tokens; evicts cached prefixes to make room if needed."""
        if req.state_slot is None and self._slots.num_free == 0:
            return False
        need = self.num_new_blocks(req, num_tokens)
        while need > self._blocks.num_free and self._evict_one():
            pass
        return need <= self._blocks.num_free

    def try_allocate(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` a state slot (if it has none) and blocks for ``num_tokens`` tokens, evicting cached
        prefixes if needed; False (and nothing taken) if that is not possible."""
        if req.state_slot is not None and num_tokens <= len(req.block_ids) * self.block_size:
            return True  # held already (a decode row inside its last block): the common case, kept short
        if not self.can_allocate(req, num_tokens):
            return False
        if req.state_slot is None:
            req.state_slot = self._slots.take()
        for _ in range(self.num_new_blocks(req, num_tokens)):
            req.block_ids.append(self._blocks.take())
        return True

    def allocate(self, req: Request, num_tokens: int) -> None:
        if not self.try_allocate(req, num_tokens):
            raise RuntimeError(f"cannot allocate {num_tokens} tokens for request {req.request_id!r}")

    def free(self, req: Request) -> None:
        """Let go of everything ``req`` holds (shared prefix blocks stay while the prefix cache holds them)."""
        self._blocks.release(req.block_ids[::-1])
        req.set_blocks([])
        if req.state_slot is not None:
            self._slots.give(req.state_slot)
            req.state_slot = None

    # ---- prefix cache ----
    def last_checkpoint_position(self, req: Request) -> int:
        """The last chunk boundary (``last_grain``) before the prompt's last token, or where the prompt is shorter
        than that, the last block boundary (grain boundary); 0: the prompt has none."""
        n = max(0, req.num_prompt_tokens - self.min_left)
        return n // self.last_grain * self.last_grain or n // self.grain * self.grain

    def checkpoints_between(self, req: Request, start: int, end: int) -> list[int]:
        """The positions in ``(start, end]`` where ``req``'s prompt prefix should be checkpointed and is not
        cached yet, in order: multiples of ``checkpoint_interval`` and ``last_checkpoint_position``."""
        last = self.last_checkpoint_position(req)
        out, q = [], start
        while q < last:
            q = min((q // self.checkpoint_interval + 1) * self.checkpoint_interval, last)
            if q > end:
                break
            if not self.has_prefix(req, q):
                out.append(q)
        return out

    def _key(self, req: Request, c: int) -> int:
        hashes = req.block_hashes(self.block_size)
        return hashes[c // self.block_size - 1]

    def has_prefix(self, req: Request, c: int) -> bool:
        return c > 0 and self._key(req, c) in self._prefixes

    def match_prefix(self, req: Request) -> PrefixEntry | None:
        """The longest cached prefix of ``req``'s tokens that leaves at least one token to compute."""
        if not self._prefixes:
            return None
        hashes = req.block_hashes(self.block_size)
        k = min(len(hashes), max(0, req.num_tokens - self.min_left) // self.block_size)
        for i in range(k, 0, -1):
            entry = self._prefixes.get(hashes[i - 1])
            if (entry is not None and entry.holds(req.all_token_ids)
                    and entry.mm_hashes == req.mm_hashes(0, entry.length)):
                self._prefixes.move_to_end(hashes[i - 1])
                return entry
        return None

    def use_prefix(self, req: Request, entry: PrefixEntry) -> None:
        """Share ``entry``'s blocks with ``req`` (which holds none yet) and skip the prefix's tokens."""
        if req.block_ids or req.num_computed_tokens:
            raise RuntimeError(f"request {req.request_id!r} already has cache content")
        self._blocks.share(entry.block_ids)
        req.set_blocks(entry.block_ids.tolist())
        req.num_computed_tokens = entry.length

    def reserve_checkpoint_slot(self) -> int | None:
        """A free checkpoint slot (evicting the least recently used prefix if needed), or None."""
        if self._prefix_slots.num_free == 0:
            self._evict_one()
        return self._prefix_slots.take() if self._prefix_slots.num_free else None

    def release_checkpoint_slot(self, slot: int) -> None:
        self._prefix_slots.give(slot)

    def register_prefix(self, req: Request, c: int, slot: int) -> None:
        """Record that checkpoint ``slot`` holds ``req``'s KDA state after its first ``c`` tokens."""
        key = self._key(req, c)
        if key in self._prefixes:
            self._prefix_slots.give(slot)  # another request cached the same prefix first
            return
        blocks = np.asarray(req.block_ids[: c // self.block_size], dtype=np.int64)
        self._blocks.share(blocks, by_prefix=True)
        self._prefixes[key] = PrefixEntry(req.all_token_ids, c, blocks, slot, req.mm_hashes(0, c))

    def clear_prefixes(self) -> None:
        while self._evict_one():
            pass

    def _evict_one(self) -> bool:
        if not self._prefixes:
            return False
        _, entry = self._prefixes.popitem(last=False)
        self._blocks.release(entry.block_ids, by_prefix=True)
        self._prefix_slots.give(entry.slot)
        return True

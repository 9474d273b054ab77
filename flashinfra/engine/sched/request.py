"""Per-request engine state: tokens, progress through them, cache ownership, and how the request ended.

A request is a token list (prompt + generated) and a cursor, ``num_computed_tokens``, that catches up to
``num_tokens``. Prefill, chunked prefill, decode and recompute after preemption are all the same thing:
moving that cursor. Pure Python; no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flashinfra.engine.sched.messages import MultiModalItem, SamplingParams, TransferParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # asynchronous scheduling: output tokens of steps scheduled (and counted in num_computed_tokens) whose result
    # has not arrived yet
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)  # grows by appends; replaced only by ``set_blocks``
    blocks_epoch: int = 0  # how many times ``set_blocks`` replaced ``block_ids`` (mirrors of it rebuild then)
    state_slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)  # ordered by offset
    transfer: TransferParams | None = None  # disaggregated serving (prefill export / decode import)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self._block_hashes: tuple[int, list[int]] | None = None

    def set_blocks(self, block_ids: list[int]) -> None:
        """Replace the request's blocks (freed, or a cached prefix's shared)."""
        self.block_ids = block_ids
        self.blocks_epoch += 1

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks: entry ``i`` identifies the first ``i + 1`` blocks.
        A block that holds part of an image or video also hashes that item's content, so two prompts
        with different images of one size (the same placeholder tokens) do not share it."""
        if self._block_hashes is None or self._block_hashes[0] != block_size:
            hashes, h = [], 0
            for start in range(0, self.num_prompt_tokens - block_size + 1, block_size):
                h = hash((h, tuple(self.prompt_token_ids[start : start + block_size]),
                          self.mm_hashes(start, start + block_size)))
                hashes.append(h)
            self._block_hashes = (block_size, hashes)
        return self._block_hashes[1]

    def mm_hashes(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images/videos whose span overlaps prompt positions ``[start, end)``."""
        return tuple(it.content_hash for it in self.mm_items if it.offset < end and it.end > start)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the cache (the whole prompt for a fresh or preempted request; 1 in decode)."""
        return self.num_tokens + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason after the latest token, or None to continue."""
        s = self.sampling
        last = self.output_token_ids[-1]
        if last in s.stop_token_ids or (not s.ignore_eos and last in self.eos_token_ids):
            return "stop"
        if self.num_output_tokens >= s.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

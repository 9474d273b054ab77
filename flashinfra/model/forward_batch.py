"""``ForwardBatch``: what one model step needs to know about its sequences.

The runner builds it; the model only reads it. Tokens of all sequences are packed into one ``[T]``
axis, sequence ``b`` owning ``cu_seqlens[b]:cu_seqlens[b + 1]``. Each sequence continues from
``context_lens[b]`` tokens already in the cache (0: it starts here), so one batch mixes fresh
prefills, prefill chunks and decode steps.

Cache addressing follows vLLM: the paged caches (MLA latent, indexer keys) are ``[num_blocks,
block_size, D]`` and a sequence's ``block_table`` lists its blocks in order; ``slot_mapping[t]`` is the
flat slot (``block * block_size + offset``) where new token ``t`` is written. KDA states live in fixed
slots, one per sequence: ``state_slots[b]``; ``checkpoints`` names spare slots that receive a sequence's KDA
states at positions inside the step (prefix caching).

The tensors reach the device in one packed copy (``model/staging.py``): ``host_arrays`` lists them, a caller
adds its own arrays of the step to the same copy, and ``from_views`` makes the batch of the device views.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashinfra.model.staging import Array, HostStaging

TENSOR_FIELDS = ("cu_seqlens", "slot_mapping", "state_slots_t", "block_tables_t", "seq_lens_t", "token_seq",
                 "positions")


@dataclass(frozen=True)
class ForwardBatch:
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # cached tokens per sequence before this step
    state_slots: tuple[int, ...]  # KDA state slot per sequence
    block_tables: tuple[Sequence[int], ...]  # paged-cache blocks per sequence (lists or int32 arrays)
    block_size: int
    cu_seqlens: torch.Tensor  # [B + 1] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    state_slots_t: torch.Tensor  # [B] int64, device
    block_tables_t: torch.Tensor  # [B, max_blocks] int32, device (padded with 0)
    seq_lens_t: torch.Tensor  # [B] int32, device: cached + new tokens per sequence
    token_seq: torch.Tensor  # [T] int32, device: the sequence of each new token
    positions: torch.Tensor  # [T] int32, device: each new token's position in its sequence
    # per sequence: its KDA layers verify from the checkpoint into the ReplaySSM ring (``model/replay.py``)
    # instead of writing the state; empty: none does
    replay: tuple[bool, ...] = ()
    # prefix checkpoints inside the step: (sequence, p, slot), the KDA states after the sequence's first p new
    # tokens (0 < p < its query length) go to state slot ``slot`` (kernels/kda/checkpoints.py)
    checkpoints: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @functools.cached_property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token to a non-empty cache."""
        return all(q == 1 for q in self.query_lens) and all(c > 0 for c in self.context_lens)

    @functools.cached_property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @functools.cached_property
    def cu_seqlens_list(self) -> tuple[int, ...]:
        """Cumulative query lengths from 0, on the host (made once per batch: every layer reads them)."""
        return (0, *itertools.accumulate(self.query_lens))

    @functools.cached_property
    def has_initial_state(self) -> tuple[bool, ...]:
        return tuple(c > 0 for c in self.context_lens)

    @property
    def last_token_indices(self) -> list[int]:
        """Index in the packed axis of each sequence's last new token (where its next token is sampled)."""
        return [e - 1 for e in self.cu_seqlens_list[1:]]

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        staging: HostStaging | None = None,
    ) -> "ForwardBatch":
        """The batch, its tensors copied to ``device`` in one packed copy (through ``staging``, the caller's
        persistent buffers, or one-off ones)."""
        arrays = ForwardBatch.host_arrays(query_lens, context_lens, state_slots, block_tables, block_size)
        views = (staging or HostStaging(device)).upload(arrays)
        return ForwardBatch.from_views(query_lens, context_lens, state_slots, block_tables, block_size, views)

    @staticmethod
    def host_arrays(
        query_lens: list[int],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> list[Array]:
        """The batch's integer tensors as host arrays for ``HostStaging.upload`` (a caller adds its own, such as
        the token ids, to the same copy). ``block_tables``: lists or int32 arrays (``engine/block_tables.py``
        keeps long ones as arrays between steps); the work is whole-array, not per token."""
        B = len(query_lens)
        if not (B == len(context_lens) == len(state_slots) == len(block_tables)):
            raise ValueError("ForwardBatch.build: per-sequence lists differ in length")
        q = np.asarray(query_lens, dtype=np.int64).reshape(B)
        c = np.asarray(context_lens, dtype=np.int64).reshape(B)
        widths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=B)
        if B and q.min() < 1:
            raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
        short = np.flatnonzero(-(-(c + q) // block_size) > widths)
        if len(short):
            b = int(short[0])
            raise ValueError(f"ForwardBatch.build: {c[b] + q[b]} tokens do not fit in {widths[b]} blocks")
        width = int(widths.max()) if B else 0
        padded = np.zeros((B, width), dtype=np.int32)
        for b, table in enumerate(block_tables):
            padded[b, : len(table)] = table
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        token_seq = np.repeat(np.arange(B, dtype=np.int32), q)
        positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - c, q)
        slots = padded[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
        i32, i64 = torch.int32, torch.int64
        return [
            ("cu_seqlens", i32, cu, (B + 1,)),
            ("slot_mapping", i64, slots, (len(slots),)),
            ("state_slots_t", i64, list(state_slots), (B,)),
            ("block_tables_t", i32, padded.reshape(-1), (B, width)),
            ("seq_lens_t", i32, c + q, (B,)),
            ("token_seq", i32, token_seq, (len(slots),)),
            ("positions", i32, positions, (len(slots),)),
        ]

    @staticmethod
    def from_views(
        query_lens: list[int],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        views: dict[str, torch.Tensor],
    ) -> "ForwardBatch":
        """The batch whose tensors are the device ``views`` of ``host_arrays``' arrays."""
        return ForwardBatch(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            state_slots=tuple(state_slots),
            block_tables=tuple(block_tables),
            block_size=block_size,
            **{name: views[name] for name in TENSOR_FIELDS},
        )

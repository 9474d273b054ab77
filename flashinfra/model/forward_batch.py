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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # cached tokens per sequence before this step
    state_slots: tuple[int, ...]  # KDA state slot per sequence
    block_tables: tuple[tuple[int, ...], ...]  # paged-cache blocks per sequence
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

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token to a non-empty cache."""
        return all(q == 1 for q in self.query_lens) and all(c > 0 for c in self.context_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))

    @property
    def cu_seqlens_list(self) -> list[int]:
        out = [0]
        for q in self.query_lens:
            out.append(out[-1] + q)
        return out

    @property
    def has_initial_state(self) -> list[bool]:
        return [c > 0 for c in self.context_lens]

    @property
    def last_token_indices(self) -> list[int]:
        """Index in the packed axis of each sequence's last new token (where its next token is sampled)."""
        return [e - 1 for e in self.cu_seqlens_list[1:]]

    @staticmethod
    def build(
        query_lens: list[int],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> "ForwardBatch":
        if not (len(query_lens) == len(context_lens) == len(state_slots) == len(block_tables)):
            raise ValueError("ForwardBatch.build: per-sequence lists differ in length")
        slots: list[int] = []
        token_seq: list[int] = []
        positions: list[int] = []
        for b, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            if q < 1:
                raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
            if (c + q + block_size - 1) // block_size > len(table):
                raise ValueError(f"ForwardBatch.build: {c + q} tokens do not fit in {len(table)} blocks")
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
            token_seq.extend([b] * q)
            positions.extend(range(c, c + q))
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return ForwardBatch(
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            state_slots=tuple(state_slots),
            block_tables=tuple(tuple(t) for t in block_tables),
            block_size=block_size,
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            state_slots_t=torch.tensor(state_slots, dtype=torch.int64, device=device),
            block_tables_t=torch.tensor(padded, dtype=torch.int32, device=device).view(len(block_tables), width),
            seq_lens_t=torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32, device=device),
            token_seq=torch.tensor(token_seq, dtype=torch.int32, device=device),
            positions=torch.tensor(positions, dtype=torch.int32, device=device),
        )

"""CUDA graphs for decode and speculative-verify steps: one captured model forward per (batch bucket, block-table
width bucket, tokens per row ``q``).

A decode step launches a few hundred small kernels; replaying them as one graph removes the launch gaps.
The model's kernel path takes tensors only (no host sync, no per-sequence Python), so one capture serves
every decode batch whose size rounds up to the same bucket and whose block tables fit the same width.

Static buffers (``StepBuffers``) hold the inputs (token ids and the ``ForwardBatch`` tensors); each step copies the
real batch into their first ``B`` rows. Rows past ``B`` are padding: they decode a dummy token of a dummy
sequence whose block table, cache slot and KDA state slot are the engine's scratch block and slot (which
the scheduler never hands out), so they never touch a real sequence's cache. Every op in the step works
row by row, so the padding rows cannot change the real rows' results.

Verify steps (speculative decoding, ``engine/speculative.py``): a step whose every row takes the KDA layers' verify
path (``batch.replay`` all set: the rows with drafts and the plain decode rows beside them) replays the graph of
``q = verify_q`` (``k + 1``) tokens per row, whose static batch has every ``replay`` flag set; the KDA layers then
read the batch's device tensors only (``KDAttention._forward_replay``: state slots and ``cu_seqlens``; a row's ring
entries are its slot's first ones, so there is no cursor to read). A row with fewer tokens (fewer drafts: a
request within ``k`` tokens of its ``max_tokens`` or of the context length, a step short of token budget, a
plain decode row) is padded to ``q`` rather than the step run eagerly: in a serving batch some row is nearly always
near its end, so a step of unequal rows is common, and a pad token costs only its share of the step's compute. A
pad token follows its row's own tokens, writes its latent and indexer entries to the scratch slot, and sits at the
row's last position (so whatever it reads lies within the row's table); in the KDA layers it runs the verify
recurrence after the row's tokens into the row's ring entries past them, which the fold never reads (it folds the
committed tokens, the row's own at most). Each op is causal within a row (the KDA recurrence, attention up to a
token's position) or works token by token, so the pad tokens cannot change the row's own. Padding rows verify
from the scratch slot into the scratch slot's ring entries (the runner's scratch slot is a slot of the cache, so
``Speculator`` gives it a ring like every other). The step's hidden states come back in its own packing, its
tokens' rows gathered on the device. A step mixing a prefill (or a prefix checkpoint) with its decode rows runs
eagerly.

What it leaves to the caller: choosing graph or eager (``can_run``), reserving the scratch block and
slot when allocating the cache, and which keys to capture ahead of serving (``engine/warmup.py``; a key met
later is still captured on first use). The MTP layer's chained draft steps: ``engine/draft_graphs.py``, in the same
memory pool (``GraphPool``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.graph_inputs import fill_step
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Block-table widths (in blocks) are captured at FIRST_WIDTH x WIDTH_GROWTH**k: a wider table than a batch
# needs costs only its zero padding (kernels read a row up to its sequence length), so coarse steps keep
# the number of graphs a configuration can need small enough to capture them all at start-up.
FIRST_WIDTH = 16
WIDTH_GROWTH = 4


def graphs_supported(model: LoadedModel) -> bool:
    """Graphs need the kernel path (tensors only); the references loop over sequences on the host. A model whose
    layers choose their collectives' arguments per step on the host (Layer Split) says so itself."""
    return (model.device.type == "cuda" and use_triton(torch.empty(0, device=model.device))
            and getattr(model, "graphs_supported", True))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is larger than the largest bucket {buckets[-1]}")


def width_bucket(w: int) -> int:
    """The captured block-table width that holds a table ``w`` blocks wide."""
    width = FIRST_WIDTH
    while width < w:
        width *= WIDTH_GROWTH
    return width


def graph_keys(max_num_seqs: int, max_blocks_per_seq: int, num_blocks: int,
               batch_buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[tuple[int, int]]:
    """Every (batch bucket, width bucket) a decode step of this configuration can meet, smallest first:
    batches up to ``max_num_seqs`` (capped at the largest bucket; larger decode batches run eagerly), block
    tables up to ``max_blocks_per_seq`` wide, and only pairs the cache can hold: a batch in bucket ``b``
    needs width bucket ``w`` only if one sequence past the previous width fits beside the others' blocks."""
    top = bucket(min(max_num_seqs, batch_buckets[-1]), batch_buckets)
    batches = [b for b in batch_buckets if b <= top]
    widths = [FIRST_WIDTH]
    while widths[-1] < max_blocks_per_seq:
        widths.append(widths[-1] * WIDTH_GROWTH)
    keys = []
    for i, w in enumerate(widths):
        prev_w = widths[i - 1] if i else 0
        for j, b in enumerate(batches):
            fewest = batches[j - 1] + 1 if j else 1  # sequences in a batch of this bucket, at least
            if (fewest - 1) + prev_w + 1 <= num_blocks:
                keys.append((b, w))
    return keys


def step_key(batch: ForwardBatch, batch_buckets: tuple[int, ...], verify_q: int = 1) -> tuple[int, int, int] | None:
    """The key (batch bucket, width bucket, q) of the graph that replays ``batch``, or None where it runs eagerly: a
    decode batch replays a ``q = 1`` graph; a verify batch (every row in the verify path, none longer than
    ``verify_q`` tokens) the ``q = verify_q`` graph (1: no verify graphs); anything else (a prefill or a prefix
    checkpoint in the step, more rows than the largest bucket) runs eagerly."""
    if batch.num_seqs > batch_buckets[-1] or batch.checkpoints:
        return None
    if batch.replay:
        if verify_q < 2 or not all(batch.replay) or max(batch.query_lens) > verify_q:
            return None
        q = verify_q
    elif batch.is_decode:
        q = 1
    else:
        return None
    return bucket(batch.num_seqs, batch_buckets), width_bucket(batch.block_tables_t.shape[1]), q


class StepBuffers:
    """The static inputs of one graph: ``bs`` rows of ``q`` tokens, block tables ``width`` blocks wide. Every row is
    a padding row (one token at position 1 of the scratch block, its other ``q - 1`` pad tokens beside it, state
    slot the scratch slot) until ``fill`` copies a step's rows in."""

    def __init__(self, bs: int, width: int, q: int, block_size: int, scratch_block: int, scratch_slot: int,
                 device: torch.device | str):
        self.bs, self.q = bs, q
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.scratch_entry = scratch_block * block_size + 1  # the cache slot every pad token writes
        T = bs * q
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.batch = ForwardBatch(
            query_lens=(q,) * bs, context_lens=(1,) * bs, state_slots=(scratch_slot,) * bs,
            block_tables=((scratch_block,),) * bs, block_size=block_size, replay=(True,) * bs if q > 1 else (),
            cu_seqlens=torch.arange(bs + 1, **i32) * q,
            slot_mapping=torch.full((T,), self.scratch_entry, dtype=torch.long, device=device),
            state_slots_t=torch.full((bs,), scratch_slot, dtype=torch.long, device=device),
            block_tables_t=torch.full((bs, width), scratch_block, **i32),
            seq_lens_t=torch.full((bs,), 2, **i32),
            token_seq=torch.arange(bs, **i32).repeat_interleave(q),
            positions=torch.ones(T, **i32),
        )
        self.at = torch.zeros(T, dtype=torch.long, device=device)  # where ``fill``'s tokens went
        self.clear()  # the fill kernel compiled here (at capture: the start-up warm-up)

    def clear(self) -> None:
        """Every row padding (an empty step)."""
        device = self.input_ids.device
        self.fill(torch.zeros(0, dtype=torch.long, device=device),
                  ForwardBatch.build([], [], [], [], self.batch.block_size, device))

    def fill(self, input_ids: torch.Tensor, batch: ForwardBatch) -> slice | torch.Tensor:
        """Copy ``batch`` (at most ``bs`` rows of at most ``q`` tokens) in, the rest padding, in one launch
        (``kernels/graph_inputs.py``); -> where its tokens lie among the ``bs * q`` (a slice for decode, else an index
        on the device, valid until the next fill)."""
        s = self.batch
        fill_step((input_ids, batch.cu_seqlens, batch.slot_mapping, batch.positions, batch.state_slots_t,
                   batch.block_tables_t, batch.seq_lens_t),
                  (self.input_ids, s.slot_mapping, s.positions, s.state_slots_t, s.block_tables_t, s.seq_lens_t,
                   self.at), self.q, (self.scratch_entry, self.scratch_slot, self.scratch_block))
        return slice(0, batch.num_seqs) if self.q == 1 else self.at[: input_ids.shape[0]]


class GraphPool:
    """The memory pool every capture of an engine shares (its graphs replay one at a time, on one stream)."""

    def __init__(self, device: torch.device):
        self.device, self.handle = device, None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``fn`` run twice on a side stream (compiling its kernels and settling the allocator outside the capture),
        then captured; -> the graph and ``fn``'s output, which each replay rewrites."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.handle):
            out = fn()
        self.handle = graph.pool()
        return graph, out


class DecodeGraphs:
    """The step graphs of one model and cache: decode, and verify where ``verify_q`` (the tokens per row of the
    verify graphs, ``k + 1``) is more than 1."""

    def __init__(self, model: LoadedModel, cache: ModelCache, scratch_block: int, scratch_slot: int,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, verify_q: int = 1):
        if not 0 <= scratch_block < cache.num_blocks or not 0 <= scratch_slot < cache.num_slots:
            raise ValueError(f"DecodeGraphs: scratch block {scratch_block} / slot {scratch_slot} outside the cache")
        self.model, self.cache = model, cache
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.max_batch = self.batch_buckets[-1]
        self.verify_q = verify_q
        self.pool = GraphPool(model.device)  # one memory pool shared by all captures
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, StepBuffers, torch.Tensor]] = {}

    @property
    def step_qs(self) -> tuple[int, ...]:
        """The tokens per row of the graphs a step may replay: 1 (decode), and ``verify_q`` where verifying."""
        return (1, self.verify_q) if self.verify_q > 1 else (1,)

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.key(batch) is not None

    def key(self, batch: ForwardBatch) -> tuple[int, int, int] | None:
        """The key of the graph that replays ``batch`` (``step_key``), or None."""
        return step_key(batch, self.batch_buckets, self.verify_q)

    def _capture(self, bs: int, width: int, q: int):
        buf = StepBuffers(bs, width, q, self.cache.block_size, self.scratch_block, self.scratch_slot,
                          self.model.device)
        forward = self.model.forward
        graph, hidden = self.pool.capture(lambda: forward(buf.input_ids, buf.batch, self.cache))
        return graph, buf, hidden

    def capture(self, keys: list[tuple[int, int, int]]) -> int:
        """Capture the graphs of ``keys`` (batch bucket, width bucket, q) not captured yet (start-up warm-up);
        returns how many were new."""
        new = [key for key in keys if key not in self.graphs]
        for key in new:
            self.graphs[key] = self._capture(*key)
        return len(new)

    def replay(self, input_ids: torch.Tensor, batch: ForwardBatch) -> Replayed:
        """The step copied into its graph's static inputs and the graph replayed (captured on first use)."""
        key = self.key(batch)
        if key is None:
            raise ValueError("DecodeGraphs.replay: not a decode or verify batch within the largest bucket")
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, buf, hidden = self.graphs[key]
        at = buf.fill(input_ids, batch)
        graph.replay()
        return Replayed(key, buf, hidden, at)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The step's hidden states ``[T, D]`` (its own packing) from a graph replay."""
        return self.replay(input_ids, batch).hidden()


@dataclass
class Replayed:
    """A replayed step graph: its key, its static inputs (``buf``, the step in its first rows) and output hidden
    states ``[bs * q, D]`` (``out``), both rewritten by the next replay of the same key, and where the step's tokens
    lie in them (``at``)."""

    key: tuple[int, int, int]
    buf: StepBuffers
    out: torch.Tensor
    at: slice | torch.Tensor

    def hidden(self) -> torch.Tensor:
        """The step's hidden states ``[T, D]`` in its own packing (a copy)."""
        return self.out[self.at].clone() if isinstance(self.at, slice) else self.out[self.at]

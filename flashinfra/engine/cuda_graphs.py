"""CUDA graphs for decode steps: one captured model forward per (batch bucket, block-table width bucket).

A decode step launches a few hundred small kernels; replaying them as one graph removes the launch gaps.
The model's kernel path takes tensors only (no host sync, no per-sequence Python), so one capture serves
every decode batch whose size rounds up to the same bucket and whose block tables fit the same width.

Static buffers hold the inputs (token ids and the ``ForwardBatch`` tensors); each step copies the real
batch into their first ``B`` rows. Rows past ``B`` are padding: they decode a dummy token of a dummy
sequence whose block table, cache slot and KDA state slot are the engine's scratch block and slot (which
the scheduler never hands out), so they never touch a real sequence's cache. Every op in the step works
row by row, so the padding rows cannot change the real rows' results.

What it leaves to the caller: choosing graph or eager (``can_run``), reserving the scratch block and
slot when allocating the cache, and which keys to capture ahead of serving (``engine/warmup.py``; a key met
later is still captured on first use).
"""

from __future__ import annotations

import torch

from flashinfra.kernels.dispatch import use_triton
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


class DecodeGraphs:
    def __init__(self, model: LoadedModel, cache: ModelCache, scratch_block: int, scratch_slot: int,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS):
        if model.device.type != "cuda":
            raise ValueError("DecodeGraphs: CUDA graphs need a CUDA model")
        if not 0 <= scratch_block < cache.num_blocks or not 0 <= scratch_slot < cache.num_slots:
            raise ValueError(f"DecodeGraphs: scratch block {scratch_block} / slot {scratch_slot} outside the cache")
        self.model, self.cache = model, cache
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.max_batch = self.batch_buckets[-1]
        self.pool = None  # one memory pool shared by all captures
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, ForwardBatch, torch.Tensor]] = {}

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.num_seqs <= self.max_batch

    def _static(self, bs: int, width: int) -> tuple[dict, ForwardBatch]:
        dev, block = self.model.device, self.cache.block_size
        i32 = dict(dtype=torch.int32, device=dev)
        buf = dict(
            input_ids=torch.zeros(bs, dtype=torch.long, device=dev),
            cu_seqlens=torch.arange(bs + 1, **i32),
            slot_mapping=torch.full((bs,), self.scratch_block * block + 1, dtype=torch.long, device=dev),
            state_slots_t=torch.full((bs,), self.scratch_slot, dtype=torch.long, device=dev),
            block_tables_t=torch.full((bs, width), self.scratch_block, **i32),
            seq_lens_t=torch.full((bs,), 2, **i32),
            token_seq=torch.arange(bs, **i32),
            positions=torch.ones(bs, **i32),
        )
        batch = ForwardBatch(
            query_lens=(1,) * bs, context_lens=(1,) * bs, state_slots=(self.scratch_slot,) * bs,
            block_tables=((self.scratch_block,),) * bs, block_size=block,
            **{k: v for k, v in buf.items() if k != "input_ids"},
        )
        return buf, batch

    def _capture(self, bs: int, width: int):
        buf, batch = self._static(bs, width)
        forward = self.model.forward
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the kernels and settles the allocator outside the capture
            for _ in range(2):
                forward(buf["input_ids"], batch, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward(buf["input_ids"], batch, self.cache)
        self.pool = graph.pool()
        return graph, buf, batch, hidden

    def capture(self, keys: list[tuple[int, int]]) -> int:
        """Capture the graphs of ``keys`` not captured yet (start-up warm-up); returns how many were new."""
        new = [key for key in keys if key not in self.graphs]
        for key in new:
            self.graphs[key] = self._capture(*key)
        return len(new)

    def _reset_padding(self, buf: dict, B: int) -> None:
        block = self.cache.block_size
        buf["input_ids"][B:] = 0
        buf["slot_mapping"][B:] = self.scratch_block * block + 1
        buf["state_slots_t"][B:] = self.scratch_slot
        buf["block_tables_t"][B:] = self.scratch_block
        buf["seq_lens_t"][B:] = 2
        buf["positions"][B:] = 1

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The decode step's hidden states ``[B, D]`` from a graph replay (capturing it on first use)."""
        if not self.can_run(batch):
            raise ValueError("DecodeGraphs.run: not a decode batch within the largest bucket")
        B, w = batch.num_seqs, batch.block_tables_t.shape[1]
        key = (bucket(B, self.batch_buckets), width_bucket(w))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, buf, _, hidden = self.graphs[key]
        buf["input_ids"][:B].copy_(input_ids)
        buf["slot_mapping"][:B].copy_(batch.slot_mapping)
        buf["state_slots_t"][:B].copy_(batch.state_slots_t)
        buf["block_tables_t"][:B, :w].copy_(batch.block_tables_t)
        buf["block_tables_t"][:B, w:] = 0
        buf["seq_lens_t"][:B].copy_(batch.seq_lens_t)
        buf["positions"][:B].copy_(batch.positions)
        self._reset_padding(buf, B)
        graph.replay()
        return hidden[:B].clone()

"""CUDA graphs for the MTP layer's draft: its catch-up over the committed tokens and the ``k - 1`` chained
single-token steps, with the ``k`` argmaxes between them, captured per (batch bucket, block-table width bucket).

``Speculator.draft`` (``engine/speculative.py``) catches the MTP layer up over each row's committed positions (its rows
are the previous step's last position and the positions the step committed: 2 to ``k + 2`` entries, a whole prompt after
a prefill, and its inputs are gathered per row from the verify step's hidden states) and takes the first draft from the
last entry of each row that goes on. The rest is a chain: ``k - 1`` steps of one token per row, each feeding the block's
output hidden and its argmax back in. Which row takes which step is known on the host before the chain starts
(``chain_steps``: a row goes on while its next position fits its block table), so the whole chain is one graph: its
inputs are the catch-up's last hidden per row, the block tables, and per step each row's cache slot and position
(``kernels/graph_inputs.fill_chain``); its output is the ``k`` drafts of every row, read back once where the eager
chain reads each step's tokens.

When no row has more than ``k + 2`` entries (every decode step's draft), the catch-up is in the graph too
(``CatchupBuffers``): its rows padded to ``k + 2`` tokens as a verify step's are to ``k + 1``
(``cuda_graphs.StepBuffers``: a pad token sits at its row's last position and writes the scratch slot), each row's last
real entry gathered on the device into the chain's input. A row that stops at this step (finished) drafts for nothing:
its chain stays within its table or writes the scratch slot. Otherwise (after a prompt, or over deferred positions) the
catch-up runs eagerly and the chain from its own graph.

The ReplaySSM fold of every KDA layer (two launches a layer) is one graph per batch bucket too (``FoldGraphs``).

A row whose table is full before its last step runs the steps past it writing the scratch slot, at the last
position its table holds (its drafts from those steps are dropped); the padding rows (past the batch, up to its
bucket) run from a zero hidden in the scratch block. The scratch block and slot, the buckets and the memory pool
are the step graphs' (``engine/cuda_graphs.py``). Every op of the MTP block works row by row and causally (attention
reads a row's own table up to its position), so neither kind of padding changes a real row's drafts. With ``k = 1``
there is no chained step: the one draft is the argmax of the catch-up's last entry.
"""

from __future__ import annotations

import torch

from flashinfra.engine.cuda_graphs import DecodeGraphs, StepBuffers, bucket, width_bucket
from flashinfra.kernels.graph_inputs import fill_chain
from flashinfra.kernels.kda.fold import kda_fold_launch
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.staging import HostStaging


def chain_steps(positions: list[int], tables: list[list[int]], num_tokens: int, block_size: int) -> list[int]:
    """The chained MTP steps of each row (0 to ``k - 1``): one per position from its next (``positions``) while
    that position fits its block table."""
    return [max(0, min(num_tokens - 1, len(t) * block_size - p)) for p, t in zip(positions, tables)]


class ChainBuffers:
    """The static inputs and the body of one chain graph: ``bs`` rows, block tables ``width`` blocks wide (the
    body runs eagerly too, from ``fill``'s inputs)."""

    def __init__(self, spec, bs: int, width: int, scratch_block: int, scratch_slot: int):
        self.spec, self.bs, self.width = spec, bs, width
        self.scratch_block = scratch_block
        self.scratch_entry = scratch_block * spec.block_size + 1
        dev, steps = spec.device, spec.num_tokens - 1
        i32 = dict(dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(bs, spec.model.config.text.hidden_size, dtype=spec.model.dtype, device=dev)
        self.block_tables = torch.full((bs, width), scratch_block, **i32)
        self.slot_mapping = torch.full((steps, bs), self.scratch_entry, dtype=torch.long, device=dev)
        self.positions = torch.ones(steps, bs, **i32)
        shared = dict(query_lens=(1,) * bs, context_lens=(1,) * bs, state_slots=(scratch_slot,) * bs,
                      block_tables=((scratch_block,),) * bs, block_size=spec.block_size,
                      cu_seqlens=torch.arange(bs + 1, **i32), block_tables_t=self.block_tables,
                      state_slots_t=torch.full((bs,), scratch_slot, dtype=torch.long, device=dev),
                      token_seq=torch.arange(bs, **i32))
        self.seq_lens = self.positions + 1
        self.batches = [ForwardBatch(slot_mapping=self.slot_mapping[j], positions=self.positions[j],
                                     seq_lens_t=self.seq_lens[j], **shared) for j in range(steps)]
        # no row: every row padding, and the fill kernel compiled here (at capture: the start-up warm-up)
        none = torch.zeros(0, dtype=torch.int32, device=dev)  # the next positions come as int64, as in use
        fill_chain((none.long(), none, none.view(0, 0)),
                   (self.block_tables, self.slot_mapping, self.positions, self.seq_lens), spec.block_size,
                   (self.scratch_entry, self.scratch_block))

    def fill(self, hidden: torch.Tensor | None, positions: list[int] | torch.Tensor, tables: list[list[int]],
             staging: HostStaging) -> None:
        """Copy a chain in: ``hidden`` [n, D] the catch-up's last entry per row (None: the catch-up graph writes it),
        ``positions`` each row's next (on the host, or on the device where the step accepted there), ``tables`` its
        block table; each step's slots and positions follow on the device (``fill_chain``, one launch)."""
        n, w, s = len(tables), max(len(t) for t in tables), self.spec
        arrays = [("tables", torch.int32, [b for t in tables for b in (*t, *[0] * (w - len(t)))], (n, w)),
                  ("caps", torch.int32, [len(t) * s.block_size for t in tables], (n,))]
        if not isinstance(positions, torch.Tensor):
            arrays.append(("next", torch.int64, positions, (n,)))
        views = staging.upload(arrays)
        if hidden is not None:
            self.hidden[:n].copy_(hidden)
            self.hidden[n:] = 0
        fill_chain((views["next"] if "next" in views else positions, views["caps"], views["tables"]),
                   (self.block_tables, self.slot_mapping, self.positions, self.seq_lens), s.block_size,
                   (self.scratch_entry, self.scratch_block))

    @staticmethod
    def drafts(out: torch.Tensor, steps: list[int]) -> list[list[int]]:
        """Each row's drafts (``1 + steps[r]`` of them) of a chain's output [k, bs]."""
        return [row[: 1 + n] for row, n in zip(out[:, : len(steps)].T.tolist(), steps)]

    def chain(self) -> torch.Tensor:
        """-> the drafts [k, bs]: the argmax of each step's hidden, fed to the next step with it."""
        s = self.spec
        embed, h, drafts = s.model.model.embed_tokens, self.hidden, []
        for j in range(s.num_tokens):
            tok = s.model.compute_logits(s.mtp.logits_hidden(h)).argmax(-1)
            drafts.append(tok)
            if j + 1 < s.num_tokens:
                h = s.mtp(embed[tok], h, self.batches[j], s.mtp_cache)
        return torch.stack(drafts)


class CatchupBuffers:
    """The static inputs and the body of one catch-up graph: the MTP layer's forward over ``bs`` rows of up to
    ``k + 2`` entries each (``StepBuffers``' padding: a pad token sits at its row's last position and writes
    the scratch slot), each row's last entry taken on the device, then the chain from those (``ChainBuffers``)."""

    def __init__(self, spec, bs: int, width: int, scratch_block: int, scratch_slot: int):
        self.spec, self.bs, self.q = spec, bs, spec.num_tokens + 2
        dev = spec.device
        self.step = StepBuffers(bs, width, self.q, spec.block_size, scratch_block, scratch_slot, dev)
        self.hidden = torch.zeros(bs * self.q, spec.model.config.text.hidden_size, dtype=spec.model.dtype, device=dev)
        self.last = torch.arange(bs, dtype=torch.long, device=dev) * self.q  # each row's last real entry
        self.chain = ChainBuffers(spec, bs, width, scratch_block, scratch_slot)

    def fill(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, positions: list[int] | torch.Tensor,
             tables: list[list[int]], staging: HostStaging, ends: torch.Tensor | None = None) -> None:
        """Copy a catch-up in: ``ids`` / ``hidden`` its tokens and target hiddens in ``batch``'s packing (each row at
        most ``k + 2`` entries), ``positions`` / ``tables`` the chain's (``ChainBuffers.fill``). ``ends``: each row's
        last real entry in ``batch``'s packing, on the device (default: the row's last; the entries after it are the
        row's rejected positions, causal to it and overwritten before they are read)."""
        at = self.step.fill(ids, batch)
        self.hidden.zero_()
        self.hidden[at] = hidden
        B = batch.num_seqs
        self.last[:B] = at[ends if ends is not None else batch.cu_seqlens[1:].long() - 1]
        self.last[B:] = torch.arange(B, self.bs, dtype=torch.long, device=self.last.device) * self.q
        self.chain.fill(None, positions, tables, staging)

    def body(self) -> torch.Tensor:
        """-> the drafts [k, bs]: the catch-up's forward, each row's last entry into the chain, the chain."""
        s = self.spec
        out = s.mtp(s.model.model.embed_tokens[self.step.input_ids], self.hidden, self.step.batch, s.mtp_cache)
        self.chain.hidden.copy_(out[self.last])
        return self.chain.chain()


class DraftGraphs:
    """The draft graphs of ``spec`` (a ``Speculator``), beside the step graphs ``graphs``: per (batch bucket, width
    bucket) a catch-up graph (the catch-up and the chain), and with ``k > 1`` a chain graph for the steps whose
    catch-up runs eagerly (a row longer than ``k + 2`` entries: after a prompt, or deferred positions)."""

    def __init__(self, spec, graphs: DecodeGraphs):
        self.spec = spec
        self.scratch_block, self.scratch_slot = graphs.scratch_block, graphs.scratch_slot
        self.batch_buckets, self.pool = graphs.batch_buckets, graphs.pool
        self.staging = HostStaging(spec.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, ChainBuffers, torch.Tensor]] = {}
        self.catchups: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, CatchupBuffers, torch.Tensor]] = {}

    def can_run(self, n: int) -> bool:
        return n <= self.batch_buckets[-1]

    def can_catch_up(self, qlens: list[int]) -> bool:
        return len(qlens) <= self.batch_buckets[-1] and max(qlens) <= self.spec.num_tokens + 2

    def _capture(self, bs: int, width: int):
        buf = ChainBuffers(self.spec, bs, width, self.scratch_block, self.scratch_slot)
        graph, drafts = self.pool.capture(buf.chain)
        return graph, buf, drafts

    def _capture_catchup(self, bs: int, width: int):
        buf = CatchupBuffers(self.spec, bs, width, self.scratch_block, self.scratch_slot)
        graph, drafts = self.pool.capture(buf.body)
        return graph, buf, drafts

    def capture(self, keys: list[tuple[int, int]]) -> int:
        """Capture the graphs of ``keys`` (batch bucket, width bucket) not captured yet; returns how many were new."""
        new = 0
        for key in keys:
            if key not in self.catchups:
                self.catchups[key] = self._capture_catchup(*key)
                new += 1
            if self.spec.num_tokens > 1 and key not in self.graphs:
                self.graphs[key] = self._capture(*key)
                new += 1
        return new

    def _key(self, tables: list[list[int]]) -> tuple[int, int]:
        """The (batch bucket, width bucket) of a draft over rows with these block tables."""
        return bucket(len(tables), self.batch_buckets), width_bucket(max(len(t) for t in tables))

    def run(self, hidden: torch.Tensor, positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """A chain graph replayed (captured on first use) -> its drafts [k, bs] on the device (``ChainBuffers.drafts``
        reads row r's ``1 + chain_steps[r]``)."""
        key = self._key(tables)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, buf, drafts = self.graphs[key]
        buf.fill(hidden, positions, tables, self.staging)
        graph.replay()
        return drafts

    def run_catchup(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                    positions: list[int] | torch.Tensor, tables: list[list[int]],
                    ends: torch.Tensor | None = None) -> torch.Tensor:
        """A catch-up graph replayed (``can_catch_up``; captured on first use) -> its drafts [k, bs] on the device
        (``CatchupBuffers.fill``)."""
        key = self._key(tables)
        if key not in self.catchups:
            self.catchups[key] = self._capture_catchup(*key)
        graph, buf, drafts = self.catchups[key]
        buf.fill(ids, hidden, batch, positions, tables, self.staging, ends)
        graph.replay()
        return drafts


def fold_layers(cache: ModelCache, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """Fold ``counts[r]`` ring entries into slot ``slots[r]`` of every KDA layer (int32 device tensors; a count of 0
    leaves its slot alone)."""
    for layer, ring in cache.replay.items():
        kda_fold_launch(ring, cache.conv_state[layer], cache.recurrent_state[layer], slots, counts)


class FoldGraphs:
    """The fold of every KDA layer's accepted ring entries into its checkpoint (``kda_fold_launch``), captured per
    batch bucket: the rows' slots and accepted counts go into static buffers, the padding rows with a count of zero
    (which leaves a slot untouched)."""

    def __init__(self, cache: ModelCache, graphs: DecodeGraphs):
        self.cache, self.batch_buckets, self.pool = cache, graphs.batch_buckets, graphs.pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def can_run(self, n: int) -> bool:
        return n <= self.batch_buckets[-1]

    def _capture(self, bs: int):
        dev = next(iter(self.cache.recurrent_state.values())).device
        slots, counts = (torch.zeros(bs, dtype=torch.int32, device=dev) for _ in range(2))

        graph, _ = self.pool.capture(lambda: fold_layers(self.cache, slots, counts))
        return graph, slots, counts

    def capture(self, buckets: list[int]) -> int:
        """Capture the graphs of these batch buckets not captured yet (start-up warm-up); returns how many were new."""
        new = [b for b in buckets if b not in self.graphs]
        for b in new:
            self.graphs[b] = self._capture(b)
        return len(new)

    def run(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        """Fold ``counts[r]`` entries into slot ``slots[r]`` of every layer (int32 device tensors of ``can_run``'s
        size) from a replay (capturing the bucket's graph on first use: its counts zero, so nothing changes)."""
        n = slots.numel()
        key = bucket(n, self.batch_buckets)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        graph, static_slots, static_counts = self.graphs[key]
        static_slots[:n].copy_(slots)
        static_counts[:n].copy_(counts)
        static_counts[n:] = 0
        graph.replay()

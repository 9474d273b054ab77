"""MLA/DSA layers under context parallelism: each rank's queries score the whole prefix with the indexer and
attend over what the top-k selects; this module decides which of the other ranks' new tokens reach a rank.

A rank runs the layer on its own tokens (``ContextParallelMLA``, the three steps of ``MLAttention``):

1. indexer entries (key | gate score, ``2 Di`` per token): all-gathered and written to the cache before the
   selection. Every query scores every pool of its causal prefix, so every rank needs every pool; and the cache
   that decode reads afterwards needs the whole prompt's.
2. ``queries`` (the rank's latent rows into its cache), ``index`` (the selection).
3. latent (``R`` per token), after the selection, by the rule below; then ``attend``.

The rule for the latent (``latent_needs``, ``gather_latent``):

- without Layer Split every rank's cache must hold the whole prompt's latent after the step, because the steps
  after it (decode) run replicated over that cache: the full all-gather, since the selected rows are a subset of
  what must arrive anyway and selecting them first would only add a collective;
- with Layer Split only the layer's owner keeps the layer: the owner needs every other rank's rows, any other
  rank only the rows its queries' selection picks among the other ranks' new tokens (the tail pools included).
  The ranks all-gather these needs (one byte per new token and rank, against ``R x 2`` bytes per latent row in
  bf16), then move exactly the needed rows in one all-to-all, unless the needs add up to at least the full
  all-gather's rows (``world x (world - 1) x`` the largest rank's tokens), where the all-gather is kept. Every
  rank sees the same needs, so every rank takes the same branch.

Bytes per MLA layer (received over all ranks, rows of ``R`` values): full all-gather ``(N - 1) T``; selective
``(N - 1) T / N`` for the owner plus, for every other rank, the union of its queries' selections among the
others' tokens: at most those ``(N - 1) T / N`` (a rank's ``T / N`` queries pick ``index_topk`` tokens each, so
at long prompts they can reach them all), far less when the selections concentrate (recent pools, a few global
ones). Which holds is the trained indexer's: hence the rule decides on the needs, per layer and step.
tests/parallel/test_context_mla.py counts both on a prompt of 30 x index_topk tokens.
A non-owner's transient buffer then holds only the rows its queries attend to; the rest stay stale (finite:
buffers start at zero) and are never selected.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import ContextBatch, ContextSplit, gather_tokens
from flashinfra.quant.cache import write_index_entries, write_latent


def selected_positions(selection, num_positions: int, device) -> torch.Tensor:
    """The union over a batch's queries of the positions their selection attends to -> bool [num_positions].
    ``selection``: the kernel path's ``[T, S]`` positions (-1 none), or the reference path's per-sequence
    ``[L, N]`` masks (every sequence of a ``ContextBatch`` shares one position axis)."""
    out = torch.zeros(num_positions, dtype=torch.bool, device=device)
    if isinstance(selection, torch.Tensor):
        out[selection[selection >= 0].long()] = True
        return out
    for mask in selection:
        out[: mask.shape[1]] |= mask.any(0)
    return out


def latent_needs(split: ContextSplit, rank: int, base_context: int, selection, owner: int | None):
    """The new tokens of other ranks whose latent ``rank`` needs -> bool [num new tokens], or None for all of
    them through the full all-gather (no Layer Split: ``owner`` None)."""
    if owner is None:
        return None
    device = selection.device if isinstance(selection, torch.Tensor) else selection[0].device
    if rank == owner:
        need = torch.ones(split.num_tokens, dtype=torch.bool, device=device)
    else:
        sel = selected_positions(selection, base_context + split.num_tokens, device)
        need = sel[base_context:].clone()
    need[split.token_index(rank).to(device)] = False
    return need


def _full_rows(split: ContextSplit) -> int:
    """Rows the full all-gather moves: every rank receives the padded rows of every other rank."""
    longest = max(sum(split.lens(r)) for r in range(split.world))
    return split.world * (split.world - 1) * longest


def gather_latent(comm: Comm, split: ContextSplit, rank: int, latent: torch.Tensor,
                  need: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent`` [rank's tokens, R] -> (positions among the new tokens, their rows) that this rank writes to
    its cache: every new token's (``need`` None, or needs adding up to the full all-gather's rows), else the
    needed rows of the other ranks."""
    everything = torch.arange(split.num_tokens, device=latent.device)
    if need is None:
        return everything, gather_tokens(comm, split, latent)
    wants = comm.all_gather(need.to(torch.uint8)).bool()  # [world, new tokens]
    if int(wants.sum()) >= _full_rows(split):
        return everything, gather_tokens(comm, split, latent)
    index = [split.token_index(r).to(latent.device) for r in range(split.world)]
    mine = index[rank]
    sends = [wants[r][mine].nonzero().flatten() for r in range(split.world)]  # rows of mine, in position order
    takes = [index[r][need[index[r]]] for r in range(split.world)]  # positions from each rank, the same order
    rows = comm.all_to_all(latent[torch.cat(sends)], [len(s) for s in sends], [len(t) for t in takes])
    return torch.cat(takes), rows


class ContextParallelMLA(nn.Module):
    """An MLA layer that runs a ``ContextBatch`` as part of the whole prompt, any other batch as before;
    ``owner``: the rank keeping the layer's cache under Layer Split (None without); ``tp``: as for
    ``ContextParallelKDA`` (the heads split, the latent and the indexer whole on every rank of the group)."""

    def __init__(self, attn: nn.Module, comm: Comm, owner: int | None = None, tp: Comm | None = None):
        super().__init__()
        self.inner, self.comm, self.owner, self.tp = attn, comm, owner, tp or Comm(1)
        self.layer = attn.layer  # what Layer Split's hook reads

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache, masks: dict) -> torch.Tensor:
        a = self.inner
        if not isinstance(batch, ContextBatch):
            return a(x, batch, cache, masks)
        split, rank = batch.split, batch.rank
        if a.indexer is not None:
            write_index_entries(cache, a.layer, batch.full_slot_mapping,
                                gather_tokens(self.comm, split, a.indexer.entries(x)), a.indexer.pool_ape)
        q, q_resid, latent = a.queries(x, batch, cache)
        a.index(x, q_resid, batch, cache, masks)
        need = latent_needs(split, rank, batch.base_context, masks[a.source], self.owner)
        positions, rows = gather_latent(self.comm, split, rank, latent, need)
        write_latent(cache, a.layer, batch.full_slot_mapping[positions], rows)
        return self.tp.all_reduce(a.attend(x, q, batch, cache, masks))

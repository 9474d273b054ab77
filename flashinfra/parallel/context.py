"""Context parallelism: one long prompt's prefill split over the ranks of a group, every rank running the whole
(replicated) model on its own tokens.

Split (``split_prompt``): contiguous (N segments, rank r holds segment r) or zig-zag (2N segments, rank r holds
segments r and 2N-1-r, so that causal attention's cost is balanced). A rank packs its segments as separate
sequences of one ``ContextBatch``; per-token work (projections, MoE, mHC, norms) needs nothing more.

KDA layers (``kda_context_prefill``, ``conv_context_prefill``):

1. conv halo: every rank all-gathers the last ``W - 1`` conv inputs of each segment; a segment's conv starts
   from the previous segment's (the first from the sequence's conv slot, or zeros);
2. summary: per segment the affine map ``S_out = M S_in + H`` (``kernels.kda.chain.kda_summary_gated``: ``M``
   and ``H``, the final state from a zero initial state, in one walk over the chunks with no output products);
3. all-gather of (M, H) and, on every rank, the fold in float32 over the segments in order,
   ``S_{i+1} = M_i S_i + H_i`` from the sequence's state (or zeros): each segment's initial state, and the
   final state, which every rank writes to the sequence's slot;
4. the final pass: the prefill op over each segment from its initial state.

The summary costs the 16-token in-chunk kernel and a walk of ``K + V`` state columns per head, not a prefill; it
is what buys each rank its initial state without waiting for the ranks before it. The final pass must run the
whole prefill from the corrected state: its outputs depend on the initial state through every token.

MLA/DSA layers (``gather_cache_hook``): before the layer runs, each rank computes the latent and indexer cache
entries of its own tokens, all-gathers them and writes the whole prompt's entries into its cache, so that its
queries' indexer and sparse attention see the full prefix exactly as on one rank. This is the simplest correct
design: it moves ``(R + 2 Di) * T`` values per layer to every rank and does one extra ``[T, D] x [D, R]``
projection (the layer forms the latent together with q); gathering only what the top-k selects is left out.
After the prefill every rank holds the prompt's whole cache and KDA state, so decode runs as on one rank
(or, with Layer Split, each MLA layer's cache on its owner: ``layer_split.py``).

Hidden states stay on the rank that computed them: ``gather_rows`` brings every rank only the rows whose logits
are sampled (a prompt's last token), not the whole prompt's ``[T, D]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from flashinfra.kernels.kda import causal_conv1d_prefill, kda_prefill_gated
from flashinfra.kernels.kda.chain import kda_summary_gated
from flashinfra.kernels.norms import gated_rms_norm
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.quant.cache import write_index_entries, write_latent
from flashinfra.quant.linear import linear


@dataclass(frozen=True)
class ContextSplit:
    """Segments of one prompt's new tokens: ``bounds`` (segments + 1 offsets) and the rank owning each."""

    bounds: tuple[int, ...]
    owners: tuple[int, ...]
    world: int

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1]

    def segments(self, rank: int) -> list[int]:
        """The segments of ``rank``, in sequence order."""
        return [i for i, o in enumerate(self.owners) if o == rank]

    def lens(self, rank: int) -> list[int]:
        return [self.bounds[i + 1] - self.bounds[i] for i in self.segments(rank)]

    def token_index(self, rank: int) -> torch.Tensor:
        """Positions (among the new tokens) of ``rank``'s tokens, in its packed order."""
        return torch.cat([torch.arange(self.bounds[i], self.bounds[i + 1]) for i in self.segments(rank)])


def split_prompt(num_tokens: int, world: int, zigzag: bool = False, min_segment: int = 1) -> ContextSplit:
    """Near-equal segments (the first ones a token longer); ``min_segment``: the conv halo's ``W - 1``."""
    n = 2 * world if zigzag else world
    if num_tokens < n * min_segment:
        raise ValueError(f"context parallelism over {world} ranks{' (zig-zag)' if zigzag else ''}: {num_tokens} "
                         f"tokens make {n} segments shorter than {min_segment} tokens")
    base, extra = divmod(num_tokens, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + base + (i < extra))
    owners = tuple(i if i < world else 2 * world - 1 - i for i in range(n))
    return ContextSplit(tuple(bounds), owners, world)


@dataclass(frozen=True)
class ContextBatch(ForwardBatch):
    """One rank's part of a context-parallel prefill: its segments as sequences (same block table and KDA
    slot, each continuing from the tokens before it), and what the layers need to see the whole prompt."""

    split: ContextSplit | None = None
    rank: int = 0
    base_context: int = 0  # tokens of the sequence cached before this prefill
    kda_slot: int = 0
    full_slot_mapping: torch.Tensor | None = None  # [num_tokens] every new token's cache slot


def context_batch(split: ContextSplit, rank: int, base_context: int, kda_slot: int, block_table: list[int],
                  block_size: int, device) -> ContextBatch:
    segs = split.segments(rank)
    fb = ForwardBatch.build(split.lens(rank), [base_context + split.bounds[i] for i in segs], [kda_slot] * len(segs),
                            [block_table] * len(segs), block_size, device)
    full = ForwardBatch.build([split.num_tokens], [base_context], [kda_slot], [block_table], block_size, device)
    fields = {f.name: getattr(fb, f.name) for f in dataclasses.fields(ForwardBatch)}
    return ContextBatch(**fields, split=split, rank=rank, base_context=base_context, kda_slot=kda_slot,
                        full_slot_mapping=full.slot_mapping)


def gather_segments(comm: Comm, split: ContextSplit, x: torch.Tensor) -> list[torch.Tensor]:
    """Every segment's rows of a per-segment tensor: ``x`` [segments of rank, ...] on each rank -> the list over
    all segments in sequence order (every rank owns the same number of segments)."""
    everyone = comm.all_gather(x)  # [world, local segments, ...]
    return [everyone[o][split.segments(o).index(i)] for i, o in enumerate(split.owners)]


def gather_tokens(comm: Comm, split: ContextSplit, x: torch.Tensor) -> torch.Tensor:
    """``x`` [rank's tokens, ...] on each rank -> [all new tokens, ...] in sequence order."""
    longest = max(sum(split.lens(r)) for r in range(split.world))
    padded = x.new_zeros(longest, *x.shape[1:])
    padded[: x.shape[0]] = x
    everyone = comm.all_gather(padded)
    out = x.new_empty(split.num_tokens, *x.shape[1:])
    for r in range(split.world):
        idx = split.token_index(r).to(x.device)
        out[idx] = everyone[r][: idx.numel()]
    return out


def _local_cu(split: ContextSplit, rank: int) -> list[int]:
    cu = [0]
    for n in split.lens(rank):
        cu.append(cu[-1] + n)
    return cu


def gather_rows(comm: Comm, split: ContextSplit, rank: int, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` [rank's tokens, ...] on each rank -> its ``rows`` (positions among all new tokens) on every rank:
    each row's owner fills it, the others add zeros (exact), one all-reduce of ``[len(rows), ...]``."""
    if rows.numel() == 0:  # the same plan on every rank: all skip the collective
        return x.new_zeros(0, *x.shape[1:])
    where = torch.full((split.num_tokens,), -1, dtype=torch.long)
    where[split.token_index(rank)] = torch.arange(x.shape[0])
    local = where[rows.cpu()].to(x.device)
    mine = local >= 0
    out = x.new_zeros(rows.numel(), *x.shape[1:])
    out[mine] = x[local[mine]]
    return comm.all_reduce(out)


def conv_context_prefill(comm: Comm, split: ContextSplit, rank: int, x: torch.Tensor, weight: torch.Tensor,
                         conv_state0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv of ``x`` [rank's tokens, C] with each segment's halo -> (output, the sequence's final
    conv state [C, W - 1]); ``conv_state0``: the sequence's conv state before this prefill, or None."""
    W1 = weight.shape[1] - 1
    cu = _local_cu(split, rank)
    tails = torch.stack([x[e - W1 : e] for e in cu[1:]])  # [local segments, W - 1, C]
    every = gather_segments(comm, split, tails)
    first = conv_state0.to(x.dtype) if conv_state0 is not None else x.new_zeros(x.shape[1], W1)
    halos = torch.stack([first if i == 0 else every[i - 1].t() for i in split.segments(rank)]).contiguous()
    n = len(cu) - 1
    y = causal_conv1d_prefill(x, weight, halos, cu, list(range(n)), [True] * n)
    return y, every[-1].t()


def fold(maps: list[torch.Tensor], offsets: list[torch.Tensor], state0: torch.Tensor) -> list[torch.Tensor]:
    """The states between the segments in float32: ``[S_0, S_1, ..., S_n]`` with ``S_{i+1} = M_i S_i + H_i``."""
    states = [state0.float()]
    for m, h in zip(maps, offsets):
        states.append(torch.matmul(m.float(), states[-1]) + h.float())
    return states


def kda_context_prefill(comm: Comm, split: ContextSplit, rank: int, q, k, v, g_raw, beta_logits, A_log, dt_bias,
                        lower_bound, state0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over ``rank``'s tokens (q, k, v [T, H, K|V] after the conv; the gate's raw input [T, H, K] and beta's
    logits [T, H]) as part of the whole prompt -> (output [T, H, V], the prompt's final state [H, K, V] float32);
    ``state0``: the sequence's state before this prefill, or None."""
    T, H, K = k.shape
    V = v.shape[-1]
    cu = _local_cu(split, rank)
    n = len(cu) - 1
    maps, offsets = kda_summary_gated(k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, cu)  # [n, H, K, K|V]
    every_m = gather_segments(comm, split, maps)
    every_h = gather_segments(comm, split, offsets)
    s0 = state0 if state0 is not None else torch.zeros(H, K, V, dtype=torch.float32, device=k.device)
    states = fold(every_m, every_h, s0)
    initial = torch.stack([states[i] for i in split.segments(rank)]).contiguous()  # [n, H, K, V]
    o = kda_prefill_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, initial, cu, list(range(n)),
                          [True] * n)
    return o, states[-1]


class ContextParallelKDA(nn.Module):
    """A KDA layer that runs a ``ContextBatch`` as part of the whole prompt, any other batch as before."""

    def __init__(self, attn: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = attn, comm

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        a = self.inner
        if not isinstance(batch, ContextBatch):
            return a(x, batch, cache)
        T, H, K = x.shape[0], a.H, a.K
        qkv, g_raw, b, gate = a.project(x)
        conv_state, state = cache.conv_state[a.layer], cache.recurrent_state[a.layer]
        slot, resume = batch.kda_slot, batch.base_context > 0
        y, conv_final = conv_context_prefill(self.comm, batch.split, batch.rank, qkv, a.conv_weight,
                                             conv_state[slot] if resume else None)
        q, k, v = y.view(T, 3, H, K).unbind(1)
        o, final = kda_context_prefill(self.comm, batch.split, batch.rank, q, k, v, g_raw.view(T, H, K), b, a.A_log,
                                       a.dt_bias, a.lower_bound, state[slot] if resume else None)
        conv_state[slot] = conv_final.to(conv_state.dtype)
        state[slot] = final.to(state.dtype)
        o = gated_rms_norm(o, gate.view(T, H, K), a.o_norm, a.eps)
        return linear(o.reshape(T, H * K), a.o_proj)


def gather_cache_hook(comm: Comm):
    """A forward pre-hook of an MLA layer: under a ``ContextBatch``, the whole prompt's latent (and indexer)
    entries written to this rank's cache before the layer reads them."""

    def hook(module, args):
        x, batch, cache = args[:3]
        if not isinstance(batch, ContextBatch):
            return
        split = batch.split
        write_latent(cache, module.layer, batch.full_slot_mapping,
                     gather_tokens(comm, split, module.latent(x)))
        if module.indexer is not None:
            write_index_entries(cache, module.layer, batch.full_slot_mapping,
                                gather_tokens(comm, split, module.indexer.entries(x)), module.indexer.pool_ape)

    return hook


def enable_context_parallel(model: nn.Module, comm: Comm) -> None:
    """Make every layer of ``model`` (a ``Glm5NextModel``, weights whole on every rank) run a ``ContextBatch``
    as one rank's part of the prompt. The MLA hooks run after any hook already registered (Layer Split's
    broadcast of the layer's earlier cache)."""
    for layer in model.layers:
        if layer.is_kda:
            layer.attn = ContextParallelKDA(layer.attn, comm)
        else:
            layer.attn.register_forward_pre_hook(gather_cache_hook(comm))

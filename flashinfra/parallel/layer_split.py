"""Layer Split: each rank of a context-parallel group keeps the paged MLA cache (latent, indexer keys, pool keys) of its
own block of MLA layers, plus one transient buffer; before an MLA layer runs, its owner's copy of the layer's
blocks that the batch uses lands in every other rank's transient buffer, and the layer then reads and writes its
cache as usual (the owner's writes land in its own cache, the others' in the transient buffer, which the next
non-owned layer overwrites). In a context-parallel split step only the blocks of the prefix cached before it
move this way: the prompt's new entries reach the owner (and what the others select) through the step's gathers
(``context_mla.py``), so a fresh long prompt's prefill broadcasts nothing.

Overlap (``LayerSplitBroadcasts``): the broadcast of the next MLA layer is issued asynchronously as the current
MLA layer starts, into a staging copy of the batch's blocks, and waited for just before the next layer runs; the
current layer's indexer and attention, and the KDA layers between the two, run meanwhile. The staging copy is
scattered into the transient buffer only after the wait, when the layer that used the buffer before is done, so
one transient buffer suffices; the staging copy is step memory (one layer's blocks of the batch), not cache.

The owners are contiguous blocks of the MLA layers in order, the first ranks one layer more. The KDA state
slots stay whole on every rank. 8-bit caches (with their scales) are not split.

``cache_tokens`` compares the tokens a cache budget holds per rank with Layer Split against full replication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from flashinfra.config import TextConfig
from flashinfra.model.cache import ModelCache, pool_keys
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import ContextBatch


def owned_layers(mla_layers: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
    base, extra = divmod(len(mla_layers), world)
    start = rank * base + min(rank, extra)
    return tuple(mla_layers[start : start + base + (rank < extra)])


def layer_owner(mla_layers: tuple[int, ...], world: int, layer: int) -> int:
    return next(r for r in range(world) if layer in owned_layers(mla_layers, world, r))


def _widths(cfg: TextConfig, owned: tuple[int, ...]) -> tuple[int, int]:
    """(values per token this rank keeps for its layers, values per token of its transient buffers)."""
    index = set(cfg.indexer_layers)
    per_index = 2 * cfg.index_head_dim + cfg.index_head_dim // cfg.index_kpool  # entries + its share of a pool key
    own = sum(cfg.kv_lora_rank + (per_index if i in index else 0) for i in owned)
    others = [i for i in cfg.mla_layers if i not in owned]
    transient = (cfg.kv_lora_rank if others else 0) + (per_index if index - set(owned) else 0)
    return own, transient


@dataclass(frozen=True)
class LayerSplitFit:
    world: int
    bytes_per_token_split: int  # the busiest rank: its layers plus the transient buffers
    bytes_per_token_replicated: int  # every MLA layer on every rank
    tokens_split: int
    tokens_replicated: int


def cache_tokens(cfg: TextConfig, world: int, cache_bytes: int, dtype: torch.dtype = torch.bfloat16) -> LayerSplitFit:
    """Tokens of MLA cache that ``cache_bytes`` per rank hold, with Layer Split over ``world`` ranks and with
    every layer replicated."""
    size = torch.empty((), dtype=dtype).element_size()
    split = max(sum(_widths(cfg, owned_layers(cfg.mla_layers, world, r))) for r in range(world)) * size
    replicated = sum(_widths(cfg, cfg.mla_layers)) * size
    return LayerSplitFit(world, split, replicated, cache_bytes // split, cache_bytes // replicated)


def layer_split_cache(cfg: TextConfig, world: int, rank: int, num_blocks: int, block_size: int, num_slots: int,
                      dtype: torch.dtype, device, state_dtype: torch.dtype = torch.float32) -> ModelCache:
    """``rank``'s cache: its MLA layers' latent and indexer keys, the other layers all mapped to one transient
    latent buffer (and one indexer buffer), and every KDA state slot."""
    cache = ModelCache.allocate(cfg, 0, block_size, num_slots, dtype, device, state_dtype)
    owned = owned_layers(cfg.mla_layers, world, rank)

    def paged(width: int) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device)

    transient_latent, transient_index = paged(cfg.kv_lora_rank), paged(2 * cfg.index_head_dim)
    transient_pools = pool_keys(cfg, num_blocks, block_size, dtype, device)
    cache.num_blocks = num_blocks
    cache.mla_latent = {i: paged(cfg.kv_lora_rank) if i in owned else transient_latent for i in cfg.mla_layers}
    cache.indexer_keys = {i: paged(2 * cfg.index_head_dim) if i in owned else transient_index
                          for i in cfg.indexer_layers}
    cache.indexer_pool_keys = {i: pool_keys(cfg, num_blocks, block_size, dtype, device) if i in owned
                               else transient_pools for i in cfg.indexer_layers}
    return cache


class LayerSplitBroadcasts:
    """The owners' broadcasts of a model's MLA layers, each issued as the MLA layer before it starts (the first
    layer's as it starts itself) and waited for just before its own layer runs. Every rank issues the same
    broadcasts in the same order, interleaved with the same other collectives."""

    def __init__(self, comm: Comm, rank: int, layers: list[int], owners: list[int]):
        self.comm, self.rank = comm, rank
        self.layers, self.owners = layers, dict(zip(layers, owners))  # MLA layer ids in model order
        self.pending: dict[int, list] = {}  # layer -> [(cache tensor, block index, staging, work)]

    def issue(self, layer: int, batch, cache) -> list:
        if isinstance(batch, ContextBatch):  # the new tokens' entries come by the split step's own gathers
            ids = batch.block_tables[0][: -(-batch.base_context // batch.block_size)]
        else:
            ids = sorted({b for table in batch.block_tables for b in table})
        if not ids:  # a split step over a fresh prompt: nothing cached to bring (the same on every rank)
            return []
        blocks = torch.tensor(ids, dtype=torch.long)
        owner, issued = self.owners[layer], []
        for paged in (cache.mla_latent[layer], cache.indexer_keys.get(layer), cache.indexer_pool_keys.get(layer)):
            if paged is None:
                continue
            idx = blocks.to(paged.device)
            buf = paged[idx] if self.rank == owner else paged.new_empty(len(blocks), *paged.shape[1:])
            issued.append((paged, idx, buf, self.comm.broadcast_async(buf, owner)))
        return issued

    def arrive(self, layer: int) -> None:
        """Wait for ``layer``'s broadcasts and write them into this rank's buffer of the layer."""
        for paged, idx, buf, work in self.pending.pop(layer):
            work.wait()
            if self.rank != self.owners[layer]:
                paged[idx] = buf

    def hook(self, module, args):
        """A forward pre-hook of every MLA layer."""
        batch, cache = args[1], args[2]
        layer = module.layer
        i = self.layers.index(layer)
        if i == 0:  # a new step: a step that failed half-way may have left broadcasts behind
            for stale in list(self.pending):
                self.arrive(stale)
            self.pending[layer] = self.issue(layer, batch, cache)
        if i + 1 < len(self.layers):
            self.pending[self.layers[i + 1]] = self.issue(self.layers[i + 1], batch, cache)
        self.arrive(layer)


def enable_layer_split(model: nn.Module, comm: Comm, rank: int) -> LayerSplitBroadcasts:
    """Register the owners' broadcasts on every MLA layer of ``model`` (a ``Glm5NextModel``); its cache comes
    from ``layer_split_cache``. Register after ``context_model.enable_context_parallel`` (on its MLA wrappers):
    the prompt's gathered entries are written over the broadcast blocks."""
    cfg = model.cfg
    mla = [layer.attn for layer in model.layers if not layer.is_kda]
    layers = [a.layer for a in mla]
    broadcasts = LayerSplitBroadcasts(comm, rank, layers, [layer_owner(cfg.mla_layers, comm.world, i) for i in layers])
    for attn in mla:
        attn.register_forward_pre_hook(broadcasts.hook)
    return broadcasts

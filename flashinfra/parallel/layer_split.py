"""Layer Split: each rank of a context-parallel group keeps the paged MLA cache (latent and indexer keys) of its
own block of MLA layers, plus one transient buffer; before an MLA layer runs, its owner broadcasts the layer's
blocks that the batch uses into every other rank's transient buffer, and the layer then reads and writes its
cache as usual (the owner's writes land in its own cache, the others' in the transient buffer, which the next
non-owned layer overwrites).

The owners are contiguous blocks of the MLA layers in order, the first ranks one layer more. The KDA state
slots stay whole on every rank. The broadcast runs before the layer, not yet overlapped with the indexer's
work; 8-bit caches (with their scales) are not split.

``cache_tokens`` compares the tokens a cache budget holds per rank with Layer Split against full replication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from flashinfra.config import TextConfig
from flashinfra.model.cache import ModelCache
from flashinfra.parallel.collectives import Comm


def owned_layers(mla_layers: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
    base, extra = divmod(len(mla_layers), world)
    start = rank * base + min(rank, extra)
    return tuple(mla_layers[start : start + base + (rank < extra)])


def layer_owner(mla_layers: tuple[int, ...], world: int, layer: int) -> int:
    return next(r for r in range(world) if layer in owned_layers(mla_layers, world, r))


def _widths(cfg: TextConfig, owned: tuple[int, ...]) -> tuple[int, int]:
    """(values per token this rank keeps for its layers, values per token of its transient buffers)."""
    index = set(cfg.indexer_layers)
    own = sum(cfg.kv_lora_rank + (2 * cfg.index_head_dim if i in index else 0) for i in owned)
    others = [i for i in cfg.mla_layers if i not in owned]
    transient = (cfg.kv_lora_rank if others else 0) + (2 * cfg.index_head_dim if index - set(owned) else 0)
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
    cache.num_blocks = num_blocks
    cache.mla_latent = {i: paged(cfg.kv_lora_rank) if i in owned else transient_latent for i in cfg.mla_layers}
    cache.indexer_keys = {i: paged(2 * cfg.index_head_dim) if i in owned else transient_index
                          for i in cfg.indexer_layers}
    return cache


def broadcast_hook(comm: Comm, rank: int, owner: int):
    """A forward pre-hook of an MLA layer: the owner's blocks of the batch into every rank's cache of the layer."""

    def hook(module, args):
        batch, cache = args[1], args[2]
        blocks = torch.tensor(sorted({b for table in batch.block_tables for b in table}), dtype=torch.long)
        for paged in (cache.mla_latent[module.layer], cache.indexer_keys.get(module.layer)):
            if paged is None:
                continue
            idx = blocks.to(paged.device)
            buf = paged[idx] if rank == owner else paged.new_empty(len(blocks), *paged.shape[1:])
            comm.broadcast(buf, owner)
            if rank != owner:
                paged[idx] = buf

    return hook


def enable_layer_split(model: nn.Module, comm: Comm, rank: int) -> None:
    """Register the owners' broadcasts on every MLA layer of ``model`` (a ``Glm5NextModel``); its cache comes
    from ``layer_split_cache``. Register before ``context.enable_context_parallel``: the prompt's gathered
    entries are written over the broadcast blocks."""
    cfg = model.cfg
    for layer in model.layers:
        if not layer.is_kda:
            owner = layer_owner(cfg.mla_layers, comm.world, layer.attn.layer)
            layer.attn.register_forward_pre_hook(broadcast_hook(comm, rank, owner))

"""``ModelCache``: the engine-owned cache tensors of one model, for every layer.

- MLA layers: the compressed latent (``kv_lora_rank`` values per token), paged; in the model dtype, or per layer
  in int8 / fp8 with one float32 scale per token in ``mla_latent_scale`` (``flashinfra.quant.cache``).
- Full-indexer MLA layers: per token the indexer key and its k-pool gate score (``2 * index_head_dim``),
  paged with the same block tables (shared-indexer layers keep nothing); in fp8 where the layer's latent is
  8-bit, with a float32 scale for each half in ``indexer_scale``; and per complete pool of ``index_kpool`` tokens
  its compressed key in ``indexer_pool_keys`` (``index_head_dim`` values in the model dtype, written when the pool's
  last token is written, read by the indexer's scoring: ``flashinfra.kernels.dsa_pool_keys``). That is
  ``2 * index_head_dim / index_kpool`` bytes per token and full-indexer layer in bf16 (64 at the released sizes,
  against 512 for the entries in bf16, 264 in fp8); the block size must be a multiple of ``index_kpool``.
- KDA layers: per state slot the conv state (last ``W - 1`` inputs of q|k|v) and the recurrent state
  ``[H, K, V]`` (float32 by default).

The cache does not decide who owns which block or slot: the cache manager does, and passes the result in
a ``ForwardBatch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flashinfra.config import TextConfig


@dataclass
class ModelCache:
    block_size: int
    num_blocks: int
    num_slots: int
    mla_latent: dict[int, torch.Tensor]  # layer -> [num_blocks, block_size, kv_lora_rank]
    indexer_keys: dict[int, torch.Tensor]  # layer -> [num_blocks, block_size, 2 * index_head_dim]
    conv_state: dict[int, torch.Tensor]  # layer -> [num_slots, 3 * linear_dim, W - 1]
    recurrent_state: dict[int, torch.Tensor]  # layer -> [num_slots, H, K, V]
    mla_latent_scale: dict[int, torch.Tensor] = field(default_factory=dict)  # 8-bit latent layer -> [blocks, bs]
    indexer_scale: dict[int, torch.Tensor] = field(default_factory=dict)  # fp8 indexer layer -> [blocks, bs, 2]
    # full-indexer layer -> [num_blocks, block_size // index_kpool, index_head_dim], the model dtype
    indexer_pool_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    # speculative decoding: per KDA layer the ReplaySSM ring (``flashinfra.model.replay.ReplayRing``)
    replay: dict[int, object] = field(default_factory=dict)

    @staticmethod
    def allocate(
        cfg: TextConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        state_dtype: torch.dtype = torch.float32,
        latent_dtypes: Mapping[int, torch.dtype] | None = None,
    ) -> "ModelCache":
        """``latent_dtypes``: an MLA layer's latent dtype where it is not ``dtype`` (int8 / fp8 get scales)."""
        latent_dtypes = latent_dtypes or {}
        if cfg.indexer_layers and block_size % cfg.index_kpool:
            raise ValueError(f"block size {block_size} is not a multiple of index_kpool {cfg.index_kpool}: a pool's "
                             "key is cached in the block of its tokens")

        def paged(width: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(num_blocks, block_size, width, dtype=dt, device=device)

        eight_bit = [i for i in cfg.mla_layers if latent_dtypes.get(i, dtype) in (torch.int8, torch.float8_e4m3fn)]
        fp8_index = [i for i in cfg.indexer_layers if i in eight_bit]  # indexer keys follow their layer's latent

        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        return ModelCache(
            block_size=block_size,
            num_blocks=num_blocks,
            num_slots=num_slots,
            mla_latent={i: paged(cfg.kv_lora_rank, latent_dtypes.get(i, dtype)) for i in cfg.mla_layers},
            indexer_keys={i: paged(2 * cfg.index_head_dim, torch.float8_e4m3fn if i in fp8_index else dtype)
                          for i in cfg.indexer_layers},
            conv_state={
                i: torch.zeros(num_slots, 3 * cfg.linear_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                               device=device)
                for i in cfg.kda_layers
            },
            recurrent_state={
                i: torch.zeros(num_slots, H, K, K, dtype=state_dtype, device=device) for i in cfg.kda_layers
            },
            mla_latent_scale={
                i: torch.ones(num_blocks, block_size, dtype=torch.float32, device=device) for i in eight_bit
            },
            indexer_scale={
                i: torch.ones(num_blocks, block_size, 2, dtype=torch.float32, device=device) for i in fp8_index
            },
            indexer_pool_keys={i: pool_keys(cfg, num_blocks, block_size, dtype, device) for i in cfg.indexer_layers},
        )

    def held_bytes(self) -> tuple[int, int]:
        """The bytes this cache holds: in its paged tensors (the blocks' per-token entries) and in its per-slot
        tensors (the KDA states and conv windows, and the ReplaySSM rings when speculating)."""
        paged = (self.mla_latent, self.mla_latent_scale, self.indexer_keys, self.indexer_scale, self.indexer_pool_keys)
        slots = [t for d in (self.conv_state, self.recurrent_state) for t in d.values()]
        slots += [t for ring in self.replay.values() for t in vars(ring).values()]
        return sum(t.nbytes for d in paged for t in d.values()), sum(t.nbytes for t in slots)

    @staticmethod
    def bytes_per_block(cfg: TextConfig, block_size: int, dtype: torch.dtype,
                        latent_dtypes: Mapping[int, torch.dtype] | None = None) -> int:
        from flashinfra.quant.cache import index_bytes_per_token, latent_bytes_per_token, pool_key_bytes

        if latent_dtypes:
            latent = sum(latent_bytes_per_token(cfg.kv_lora_rank, latent_dtypes.get(i, dtype)) for i in cfg.mla_layers)
            index = sum(index_bytes_per_token(cfg.index_head_dim, latent_dtypes.get(i, dtype), dtype)
                        for i in cfg.indexer_layers)
            return (latent + index) * block_size + pool_key_bytes(cfg, block_size, dtype)
        width = len(cfg.mla_layers) * cfg.kv_lora_rank + len(cfg.indexer_layers) * 2 * cfg.index_head_dim
        return width * block_size * torch.empty((), dtype=dtype).element_size() + pool_key_bytes(cfg, block_size, dtype)

    @staticmethod
    def bytes_per_slot(cfg: TextConfig, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        conv = 3 * cfg.linear_dim * (W - 1) * torch.empty((), dtype=dtype).element_size()
        rec = H * K * K * torch.empty((), dtype=state_dtype).element_size()
        return len(cfg.kda_layers) * (conv + rec)


def pool_keys(cfg: TextConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One full-indexer layer's pool-key cache [num_blocks, block_size // index_kpool, index_head_dim]."""
    return torch.zeros(num_blocks, block_size // cfg.index_kpool, cfg.index_head_dim, dtype=dtype, device=device)

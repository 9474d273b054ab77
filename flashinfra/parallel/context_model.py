"""``ContextParallelModel``: one rank's model in a context-parallel engine, with the ``LoadedModel`` calls the
runner makes (``forward``, ``compute_logits``, ``allocate_cache``, ``logits``).

Every rank holds the whole model. A step whose batch is one sequence with at least ``min_tokens`` new tokens
(a long prompt's prefill, or a chunk of one) is split over the ranks (``context.py``); every other batch runs
replicated on every rank, as on one GPU, over the same cache, which after a split prefill holds the whole
prompt on every rank. The split step's hidden states are all-gathered, so every rank returns what one rank
would and the runner samples as usual. With ``layer_split`` each rank's cache keeps only its MLA layers
(``layer_split.py``), and every step, split or not, pays the owners' broadcasts.
"""

from __future__ import annotations

import torch

from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import context_batch, enable_context_parallel, gather_tokens, split_prompt
from flashinfra.parallel.layer_split import enable_layer_split, layer_split_cache

# the shortest prefill split over the ranks, per rank: below it the summary pass and the collectives cost more
# than the tokens they spread
MIN_TOKENS_PER_RANK = 1024


class ContextParallelModel:
    def __init__(self, loaded: LoadedModel, comm: Comm, rank: int, min_tokens: int | None = None,
                 zigzag: bool = False, layer_split: bool = False):
        if (loaded.quantization != "none" or loaded.vision is not None
                or any(d != loaded.dtype for d in loaded.latent_dtypes().values())):
            raise ValueError("context parallelism needs unquantized weights and caches and no vision tower")
        self.loaded, self.comm, self.rank = loaded, comm, rank
        self.min_tokens = comm.world * MIN_TOKENS_PER_RANK if min_tokens is None else min_tokens
        self.zigzag, self.layer_split = zigzag, layer_split
        if layer_split:
            enable_layer_split(loaded.model, comm, rank)
        enable_context_parallel(loaded.model, comm)

    def __getattr__(self, name):  # config, dtype, device, path, report, cache_spec, model...: the loaded model's
        return getattr(self.loaded, name)

    def allocate_cache(self, num_blocks: int, block_size: int, num_slots: int) -> ModelCache:
        if not self.layer_split:
            return self.loaded.allocate_cache(num_blocks, block_size, num_slots)
        return layer_split_cache(self.config.text, self.comm.world, self.rank, num_blocks, block_size, num_slots,
                                 self.dtype, self.device, self.cache_spec.state_dtype)

    def splits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` runs split over the ranks."""
        halo = self.config.text.linear_conv_kernel_dim - 1  # the shortest segment: a whole conv halo
        return (self.comm.world > 1 and batch.num_seqs == 1 and not any(batch.replay)
                and batch.query_lens[0] >= max(self.min_tokens, 2 * self.comm.world * halo, 1))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        model = self.loaded.model
        if inputs_embeds is not None or not self.splits(batch):
            return model(input_ids, batch, cache, inputs_embeds=inputs_embeds)
        text = self.config.text
        split = split_prompt(batch.query_lens[0], self.comm.world, self.zigzag, text.linear_conv_kernel_dim - 1)
        mine = context_batch(split, self.rank, batch.context_lens[0], batch.state_slots[0],
                             list(batch.block_tables[0]), batch.block_size, self.device)
        hidden = model(input_ids[split.token_index(self.rank).to(input_ids.device)], mine, cache)
        return gather_tokens(self.comm, split, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.loaded.compute_logits(hidden)

    def logits(self, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
        return LoadedModel.logits(self, prompts, block_size)

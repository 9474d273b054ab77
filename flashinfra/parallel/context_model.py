"""``ContextParallelModel``: one rank's model in a context-parallel engine, with the ``LoadedModel`` calls the
runner makes (``forward``, ``compute_logits``, ``allocate_cache``, ``logits``).

Every rank holds the whole model, or, with tensor parallelism (world ``tp x cp``, ``groups.make_context_comms``),
every tensor-parallel group holds the whole model split by heads and the context-parallel ranks are the same
shard in each group. A step whose batch is one sequence with at least ``min_tokens`` new tokens (a long prompt's
prefill, or a chunk of one) is split over the ranks (``context.py``); every other batch runs replicated on every
rank, as on one GPU, over the same cache, which after a split prefill holds the whole prompt on every rank; a
split step's prefix checkpoints reach every rank's checkpoint slots (``context_checkpoints.py``), so prefix
caching works as on one rank. The split step's hidden states stay where they were computed: the runner asks for
the rows it samples (the prompt's last token), and only those are gathered (``context.gather_rows``). With
``layer_split`` each rank's cache keeps only its MLA layers (``layer_split.py``), every step, split or not,
pays the owners' broadcasts, and decode runs without CUDA graphs (the broadcasts' blocks are chosen per step on
the host).

The split's layout: zig-zag by default. Each rank's MLA layers run the indexer over the whole causal prefix of
its queries, work that grows with the query's position: contiguous parts give the last rank ``2N - 1`` times
the first one's indexer work, zig-zag gives every rank the same. The KDA layers do not care (their work is
linear in the tokens); zig-zag costs them twice the segments, that is twice the maps in the all-gather.
"""

from __future__ import annotations

import torch

from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import ContextParallelKDA, context_batch, gather_rows, split_prompt
from flashinfra.parallel.context_mla import ContextParallelMLA
from flashinfra.parallel.layer_split import cache_tokens, enable_layer_split, layer_owner, layer_split_cache
from flashinfra.parallel.shard import ShardedModel

# The shortest prefill split over the ranks, per rank. A split step pays, per layer, costs that do not shrink
# with the tokens: each KDA layer all-gathers every segment's maps, H x K x (K + V) floats each (as many values
# as the layer's q, k, v and gate carry for K (K + V) / (3K + V) tokens of one segment, ~64 at K = V = 128,
# times the ranks), and the conv halos; each MLA layer two all-gathers; each collective its latency. It saves
# (N - 1) / N of the step's work on the rank's tokens. At 1024 tokens per rank a layer's own work on its tokens
# (the projections, the MoE, the chunked KDA) is an order of magnitude above the map all-gather's bytes and the
# collectives' latency on NVLink, so the split gains; at a few hundred tokens it would not. bench/kda_chain.py
# measures the split layer against the part's prefill.
MIN_TOKENS_PER_RANK = 1024


def enable_context_parallel(model: torch.nn.Module, comm: Comm, layer_split: bool, tp: Comm) -> None:
    """Make every layer of ``model`` (a ``Glm5NextModel``, whole or split over the ``tp`` group) run a
    ``ContextBatch`` as one rank's part of the prompt; with ``layer_split`` each MLA layer knows the rank that
    keeps its cache."""
    mla_layers = model.cfg.mla_layers
    for layer in model.layers:
        if layer.is_kda:
            layer.attn = ContextParallelKDA(layer.attn, comm, tp)
        else:
            owner = layer_owner(mla_layers, comm.world, layer.attn.layer) if layer_split else None
            layer.attn = ContextParallelMLA(layer.attn, comm, owner, tp)


class ContextParallelModel:
    def __init__(self, loaded: LoadedModel, comm: Comm, rank: int, min_tokens: int | None = None,
                 zigzag: bool = True, layer_split: bool = False):
        if (loaded.quantization != "none" or loaded.vision is not None
                or any(d != loaded.dtype for d in loaded.latent_dtypes().values())):
            raise ValueError("context parallelism needs unquantized weights and caches and no vision tower")
        self.loaded, self.comm, self.rank = loaded, comm, rank
        self.min_tokens = comm.world * MIN_TOKENS_PER_RANK if min_tokens is None else min_tokens
        self.zigzag, self.layer_split = zigzag, layer_split
        tp = loaded.comms.tp if isinstance(loaded, ShardedModel) else Comm(1)
        enable_context_parallel(loaded.model, comm, layer_split, tp)
        # on the wrappers: their broadcasts land before the wrapper gathers the prompt's entries over them
        self.broadcasts = enable_layer_split(loaded.model, comm, rank) if layer_split else None

    def __getattr__(self, name):  # config, dtype, device, path, report, cache_spec, model...: the loaded model's
        return getattr(self.loaded, name)

    @property
    def graphs_supported(self) -> bool:
        """Whether decode may run as captured CUDA graphs: not with Layer Split's per-step broadcasts."""
        return not self.layer_split

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one paged block on the busiest rank: with Layer Split its MLA layers and the transient
        buffer, else every MLA layer."""
        text = self.config.text
        if not self.layer_split:
            return ModelCache.bytes_per_block(text, block_size, self.dtype, self.latent_dtypes())
        return cache_tokens(text, self.comm.world, 0, self.dtype).bytes_per_token_split * block_size

    def describe_cache(self, num_blocks: int, block_size: int) -> str:
        """The cache tokens per rank, against full replication of the MLA layers in the same bytes."""
        text = self.config.text
        tokens = num_blocks * block_size
        if not self.layer_split:
            return f"context parallel over {self.comm.world} ranks: {tokens} cache tokens per rank (replicated)"
        fit = cache_tokens(text, self.comm.world, self.cache_bytes_per_block(block_size) * num_blocks, self.dtype)
        return (f"Layer Split over {self.comm.world} ranks: {tokens} cache tokens per rank, {fit.tokens_replicated} "
                f"with every MLA layer replicated ({tokens / max(fit.tokens_replicated, 1):.2f}x)")

    def allocate_cache(self, num_blocks: int, block_size: int, num_slots: int) -> ModelCache:
        if not self.layer_split:
            return self.loaded.allocate_cache(num_blocks, block_size, num_slots)
        # the KDA state slots hold this rank's heads: all of them, or its tensor-parallel share
        text = self.loaded.cache_text if isinstance(self.loaded, ShardedModel) else self.config.text
        return layer_split_cache(text, self.comm.world, self.rank, num_blocks, block_size, num_slots, self.dtype,
                                 self.device, self.cache_spec.state_dtype)

    def splits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` runs split over the ranks; its prefix checkpoints (``batch.checkpoints``) are computed
        by the rank owning each position and delivered to every rank (``context_checkpoints.py``)."""
        halo = self.config.text.linear_conv_kernel_dim - 1  # the shortest segment: a whole conv halo
        return (self.comm.world > 1 and batch.num_seqs == 1 and not any(batch.replay)
                and batch.query_lens[0] >= max(self.min_tokens, 2 * self.comm.world * halo, 1))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
                inputs_embeds: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states of ``rows`` (all rows where None) of the batch, on every rank."""
        if inputs_embeds is not None:
            hidden = self.loaded.model(input_ids, batch, cache, inputs_embeds=inputs_embeds)
            return hidden if rows is None else hidden[rows]
        if not self.splits(batch):
            return self.loaded.forward(input_ids, batch, cache, rows=rows)
        text = self.config.text
        split = split_prompt(batch.query_lens[0], self.comm.world, self.zigzag, text.linear_conv_kernel_dim - 1)
        mine = context_batch(split, self.rank, batch.context_lens[0], batch.state_slots[0],
                             list(batch.block_tables[0]), batch.block_size, self.device,
                             tuple((p, slot) for _, p, slot in batch.checkpoints))
        hidden = self.loaded.forward(input_ids[split.token_index(self.rank).to(input_ids.device)], mine, cache)
        if rows is None:
            rows = torch.arange(split.num_tokens)
        return gather_rows(self.comm, split, self.rank, hidden, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.loaded.compute_logits(hidden)

    def logits(self, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
        return LoadedModel.logits(self, prompts, block_size)

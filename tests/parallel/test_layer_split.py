"""Layer Split's sizing: the MLA cache tokens one rank holds against full replication, for the released
model's layers, the owners' blocks, and the engine's cache sizing with a rank's bytes per block."""

from types import SimpleNamespace

import pytest
import torch

import flashinfra
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.runner import size_cache
from flashinfra.quant.cache import CacheSpec

from flashinfra.config import resolve_config
from flashinfra.model.cache import ModelCache
from flashinfra.parallel.layer_split import cache_tokens, layer_owner, owned_layers
from flashinfra.parallel.plan import GLM_5_3_FLASH

GIB = 2**30


@pytest.fixture(scope="module")
def text():
    return resolve_config(GLM_5_3_FLASH).text


def test_owned_layers_are_contiguous_blocks(text):
    mla = text.mla_layers
    assert len(mla) == 11
    blocks = [owned_layers(mla, 4, r) for r in range(4)]
    assert [len(b) for b in blocks] == [3, 3, 3, 2]
    assert sum(blocks, ()) == mla
    assert all(layer_owner(mla, 4, i) == r for r, b in enumerate(blocks) for i in b)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_cache_tokens_split_against_replicated(text, world):
    """Every MLA layer of the released model runs its own indexer: 512 latent + 256 indexer values per token and
    layer, plus a quarter of a 128-value pool key (kpool 4), 1600 bytes in bf16. A rank keeps ceil(11 / world) layers
    plus one transient layer's buffers."""
    assert text.indexer_layers == text.mla_layers
    budget = 40 * GIB
    fit = cache_tokens(text, world, budget, torch.bfloat16)
    per_layer = 2 * (text.kv_lora_rank + 2 * text.index_head_dim + text.index_head_dim // text.index_kpool)
    assert per_layer == 1600
    assert fit.bytes_per_token_replicated == 11 * per_layer == ModelCache.bytes_per_block(text, 1, torch.bfloat16)
    layers = -(-11 // world) + (world > 1)
    assert fit.bytes_per_token_split == layers * per_layer
    assert (fit.tokens_split, fit.tokens_replicated) == (budget // (layers * per_layer), budget // (11 * per_layer))
    print(f"world {world}: {fit.tokens_split} cache tokens per rank with Layer Split, {fit.tokens_replicated} "
          f"replicated ({fit.tokens_split / fit.tokens_replicated:.2f}x)")


def test_layer_split_needs_context_parallel_ranks():
    with pytest.raises(ValueError, match="layer_split needs context_parallel_size > 1"):
        flashinfra.LLM(None, layer_split=True, device="cpu")


def test_size_cache_gives_a_rank_more_blocks(text):
    """The engine's sizing with the busiest rank's bytes per block (as ``ContextParallelModel`` reports them under
    Layer Split): the blocks grow by the ratio of the per-token bytes."""
    model = SimpleNamespace(config=SimpleNamespace(text=text), cache_text=text, dtype=torch.bfloat16,
                            device=torch.device("cpu"), latent_dtypes=lambda: {}, cache_spec=CacheSpec())
    config = EngineConfig(kv_cache_memory=4 * GIB, max_num_seqs=1, prefix_cache_slots=0)
    longest = 2**24
    full = size_cache(model, config, longest)
    fit = cache_tokens(text, 4, 0)
    split = size_cache(model, config, longest, fit.bytes_per_token_split * config.block_size)
    ratio = fit.bytes_per_token_replicated / fit.bytes_per_token_split
    assert abs(split / full - ratio) < 1e-3 * ratio

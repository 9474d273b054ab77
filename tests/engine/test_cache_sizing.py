"""Cache sizing from a memory budget, and reading memory sizes."""

from __future__ import annotations

import pytest

import flashinfra
from flashinfra.engine.config import EngineConfig, parse_memory
from flashinfra.model.cache import ModelCache
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.engine.runner import size_cache


def test_parse_memory():
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory(" 1.5 kib ") == 1536
    assert parse_memory("1e6") == 10**6
    assert parse_memory(4096) == 4096
    for bad in ("", "12 parsecs", "-3GB", "0"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_size_cache_from_budget(tmp_path):
    model = flashinfra.load_model(write_tiny_checkpoint(tmp_path, seed=1, tokenizer=False))
    text = model.config.text
    per_block = ModelCache.bytes_per_block(text, 16, model.dtype)
    per_slot = ModelCache.bytes_per_slot(text, model.dtype)
    slots = 4 + 2
    budget = slots * per_slot + 37 * per_block + per_block // 2
    cfg = EngineConfig(kv_cache_memory=budget, max_num_seqs=4, prefix_cache_slots=2)
    assert size_cache(model, cfg, max_model_len=4096) == 37
    # never more blocks than max_num_seqs sequences of max_model_len can use
    assert size_cache(model, cfg, max_model_len=64) == 4 * 4
    assert size_cache(model, EngineConfig(num_blocks=5), max_model_len=4096) == 5
    with pytest.raises(ValueError, match="does not hold 6 KDA state slots"):
        size_cache(model, EngineConfig(kv_cache_memory=slots * per_slot, max_num_seqs=4, prefix_cache_slots=2), 4096)


def test_engine_config_rejects_bad_values():
    for kw in (dict(block_size=0), dict(max_num_seqs=0), dict(num_blocks=0), dict(kv_cache_memory=0),
               dict(max_model_len=1), dict(dtype="int3"), dict(prefix_cache_slots=-1)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineConfig(**kw)

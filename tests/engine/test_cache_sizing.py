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


@pytest.mark.parametrize("speculative_tokens", [0, 3])
def test_engine_reports_what_its_caches_hold(speculative_tokens):
    """The ready message's figures are the allocated tensors': a token's entries and a request's state as the
    sizing formulas count them; with drafts the MTP layer's entries per token and, per request, the ReplaySSM rings
    of every KDA layer and the last hidden state on top."""
    llm = flashinfra.LLM(device="cpu", dtype="float32", num_blocks=64, max_num_seqs=2,
                         speculative_tokens=speculative_tokens)
    try:
        ready, model, cache = llm.engine.ready_message(), llm.engine.model, llm.engine.runner.cache
        text = model.config.text
        per_token = ModelCache.bytes_per_block(text, 16, model.dtype) // 16
        per_slot = ModelCache.bytes_per_slot(text, model.dtype)
        total = per_token * 64 * 16 + per_slot * cache.num_slots
        if not speculative_tokens:
            assert (ready.cache_bytes_per_token, ready.state_bytes_per_seq, ready.cache_bytes) == (per_token, per_slot,
                                                                                                  total)
            return
        mtp_token = 4 * (text.kv_lora_rank + 2 * text.index_head_dim + text.index_head_dim // text.index_kpool)
        C, H, K = text.linear_dim * 3, text.linear_num_heads, text.linear_head_dim
        ring = (speculative_tokens + 1) * 4 * (C + 2 * H * K + H * K + H)  # x, k, v, g (float32), beta (float32)
        assert ready.cache_bytes_per_token == per_token + mtp_token
        assert ready.state_bytes_per_seq == per_slot + len(text.kda_layers) * ring + 4 * text.hidden_size
    finally:
        llm.engine.close()

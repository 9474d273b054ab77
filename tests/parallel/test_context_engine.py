"""The engine with ``context_parallel_size=2`` over CPU gloo ranks (zig-zag, with and without Layer Split, and
with ``tensor_parallel_size=2`` on 4 ranks): a prompt long enough to be split, and short ones that run
replicated, give one rank's greedy tokens; with Layer Split rank 0 reports the cache tokens per rank against full
replication. With prefix caching on, the split
prefill saves its prefix checkpoints on every rank, and later requests that hit them give one rank's logits."""

from __future__ import annotations

import random

import pytest
import torch

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.context_model import MIN_TOKENS_PER_RANK

pytestmark = pytest.mark.slow

# prefix caching off here; test_prefix_hits_after_a_split_prefill turns it on
ENGINE = dict(num_blocks=600, block_size=8, max_num_seqs=2, max_num_batched_tokens=2 * MIN_TOKENS_PER_RANK + 64,
              prefix_cache_slots=0,
              device="cpu", dtype="float32")


@pytest.mark.parametrize("layer_split,tp,load_format", [(False, 1, "auto"), (True, 1, "auto"), (False, 2, "auto"),
                                                       (False, 1, "random"), (False, 2, "random")])
def test_context_parallel_engine_equals_one_rank(tmp_path, capfd, layer_split, tp, load_format):
    """tp 2: 4 ranks, two tensor-parallel groups each holding the model split by heads. Random weights: every
    rank draws its part of the one-rank model's."""
    ckpt = write_tiny_checkpoint(tmp_path, seed=1)
    rng = random.Random(5)
    long = [rng.randrange(10, 512) for _ in range(2 * MIN_TOKENS_PER_RANK + 9)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = dict(ENGINE, load_format=load_format, seed=3)
    one = flashinfra.LLM(ckpt, **engine)
    prompts = [long, [11, 12, 13, 14, 15]]
    want = [o.token_ids for o in one.generate(prompts, params)]
    one.engine.close()
    llm = flashinfra.LLM(ckpt, context_parallel_size=2, tensor_parallel_size=tp, layer_split=layer_split,
                         dist_timeout_s=60, **engine)
    try:
        comm = llm.engine.runner.model.comm  # plans go over the control channel, uncounted: only split steps count
        got = [o.token_ids for o in llm.generate([prompts[0]], params)]  # alone: its prefill is split
        split_calls = comm.calls
        got += [o.token_ids for o in llm.generate([prompts[1]], params)]
        assert got == want
        assert split_calls > 0
        if layer_split:  # the owners' broadcasts run every step
            assert comm.calls > split_calls
            assert "Layer Split over 2 ranks: 4800 cache tokens per rank" in capfd.readouterr().err
        else:
            assert comm.calls == split_calls
    finally:
        llm.engine.close()


def _last_logits(llm, prompt: list[int]) -> torch.Tensor:
    """The logits of ``prompt``'s last position (rank 0's, the ones it samples from)."""
    model = llm.engine.runner.model
    seen: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    finally:
        del model.compute_logits
    return seen[-1][0]


def test_prefix_hits_after_a_split_prefill(tmp_path):
    """The long prompt's single split step crosses checkpoints at 512, 1024, 1536, 2048 and its last block
    boundary (2056), in segments of both ranks; a prompt sharing its first 1030 tokens hits 1024, the prompt again
    hits 2056; every last-position logit equals one rank's, hits included."""
    ckpt = write_tiny_checkpoint(tmp_path, seed=1)
    rng = random.Random(7)
    a = [rng.randrange(10, 512) for _ in range(2 * MIN_TOKENS_PER_RANK + 9)]
    b = a[:1030] + [rng.randrange(10, 512) for _ in range(40)]
    engine = dict(ENGINE, prefix_cache_slots=6, prefix_checkpoint_interval=512)
    results = []
    for extra in ({}, dict(context_parallel_size=2, dist_timeout_s=60)):
        llm = flashinfra.LLM(ckpt, **engine, **extra)
        try:
            logits, hits = [], []
            for prompt in (a, b, a):
                before = llm.engine.stats().num_prefix_hit_tokens_total
                logits.append(_last_logits(llm, prompt))
                hits.append(llm.engine.stats().num_prefix_hit_tokens_total - before)
            if extra:
                assert llm.engine.runner.model.comm.calls > 0  # the long prefill was split
            results.append((logits, hits))
        finally:
            llm.engine.close()
    (want, want_hits), (got, got_hits) = results
    assert want_hits == got_hits == [0, 1024, 2056]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-4)

"""The engine with ``context_parallel_size=2`` over CPU gloo ranks (zig-zag, with and without Layer Split): a
prompt long enough to be split, and short ones that run replicated, give one rank's greedy tokens; with Layer
Split rank 0 reports the cache tokens per rank against full replication."""

from __future__ import annotations

import random

import pytest

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.context_model import MIN_TOKENS_PER_RANK

pytestmark = pytest.mark.slow

# prefix caching off: its checkpoints cut a prompt into prefill chunks of --prefix-checkpoint-interval tokens
ENGINE = dict(num_blocks=600, block_size=8, max_num_seqs=2, max_num_batched_tokens=2 * MIN_TOKENS_PER_RANK + 64,
              prefix_cache_slots=0,
              device="cpu", dtype="float32")


@pytest.mark.parametrize("layer_split", [False, True])
def test_context_parallel_engine_equals_one_rank(tmp_path, capfd, layer_split):
    ckpt = write_tiny_checkpoint(tmp_path, seed=1)
    rng = random.Random(5)
    long = [rng.randrange(10, 512) for _ in range(2 * MIN_TOKENS_PER_RANK + 9)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    one = flashinfra.LLM(ckpt, **ENGINE)
    prompts = [long, [11, 12, 13, 14, 15]]
    want = [o.token_ids for o in one.generate(prompts, params)]
    one.engine.close()
    llm = flashinfra.LLM(ckpt, context_parallel_size=2, layer_split=layer_split, dist_timeout_s=60, **ENGINE)
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

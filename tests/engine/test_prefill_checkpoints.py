"""Prefix checkpoints inside one prefill step, through ``EngineCore`` on a tiny random checkpoint: a long prompt
prefilled in a single step registers a checkpoint at every interval and at its last KDA chunk boundary, and later
requests that hit them give the logits of a cold run."""

from __future__ import annotations

import random

import pytest
import torch

import flashinfra
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # one KDA and one MLA layer: the reference's long prefills stay cheap
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0, tokenizer=False, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])
    return flashinfra.load_model(path, dtype="float32", device="cpu")


def _engine(model, prefix_slots: int) -> EngineCore:
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=600, max_num_seqs=2,
                       max_num_batched_tokens=4096, prefix_cache_slots=prefix_slots, prefix_checkpoint_interval=1024)
    return EngineCore(cfg, model=model)


def _run(engine: EngineCore, rid: str, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The logits of ``prompt``'s last position, and the engine steps it took."""
    seen: list[torch.Tensor] = []
    runner_model = engine.runner.model
    compute = runner_model.compute_logits
    runner_model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    try:
        engine.add_request(EngineRequest(rid, prompt, GREEDY, 0.0))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        del runner_model.compute_logits
    return seen[-1][0], steps


def test_one_step_registers_every_checkpoint_and_hits_give_cold_logits(model):
    rng = random.Random(3)
    vocab = model.config.text.vocab_size
    a = [rng.randrange(1, vocab) for _ in range(3000)]
    b = a[:2048] + [rng.randrange(1, vocab) for _ in range(500)]
    warm, cold = _engine(model, 4), _engine(model, 0)

    logits_a, steps = _run(warm, "a", a)
    assert steps == 1  # the token budget alone cuts a step: no stop at the checkpoints
    cache = warm.scheduler.cache
    assert sorted(e.length for e in cache._prefixes.values()) == [1024, 2048, 2944]
    # each entry shares exactly its own prefix's blocks, the longer ones extending the shorter ones
    entries = sorted(cache._prefixes.values(), key=lambda e: e.length)
    assert [len(e.block_ids) for e in entries] == [64, 128, 184]
    assert entries[1].block_ids[:64].tolist() == entries[0].block_ids.tolist()
    assert entries[2].block_ids[:128].tolist() == entries[1].block_ids.tolist()

    hits = warm.stats().num_prefix_hit_tokens_total
    logits_b, _ = _run(warm, "b", b)
    assert warm.stats().num_prefix_hit_tokens_total - hits == 2048
    cold_b, _ = _run(cold, "b", b)
    # the cold run sums the attention over the prefix in another order: float32 rounding, no more
    torch.testing.assert_close(logits_b, cold_b, rtol=1e-4, atol=2e-4)

    # the last KDA chunk boundary (a block boundary too), inside the first step: the repeated prompt starts after it
    logits_again, _ = _run(warm, "a2", a)
    assert warm.stats().num_prefix_hit_tokens_total - hits == 2048 + 2944
    torch.testing.assert_close(logits_again, logits_a, rtol=1e-4, atol=2e-4)


def test_checkpoint_states_are_the_same_bits_whatever_the_steps(model):
    """A prefix checkpoint's KDA state (recurrent and conv) saved inside one 3000-token step is bit for bit the one
    saved by a prefill cut into 512-token steps (the chunks fall alike: 512 is a multiple of the 64-token chunk),
    so a hit restores exactly the state a cold run computes, not merely a close one."""
    rng = random.Random(5)
    a = [rng.randrange(1, model.config.text.vocab_size) for _ in range(3000)]
    states = []
    for budget in (4096, 512):
        cfg = EngineConfig(device="cpu", dtype="float32", block_size=16, num_blocks=600, max_num_seqs=2,
                           max_num_batched_tokens=budget, prefix_cache_slots=4, prefix_checkpoint_interval=1024)
        engine = EngineCore(cfg, model=model)
        _, steps = _run(engine, "a", a)
        assert steps == (1 if budget == 4096 else 6)
        cache = engine.runner.cache
        states.append({e.length: [t[e.slot].clone() for layer in model.config.text.kda_layers
                                       for t in (cache.recurrent_state[layer], cache.conv_state[layer])]
                       for e in engine.scheduler.cache._prefixes.values()})
    one_step, many_steps = states
    assert sorted(one_step) == sorted(many_steps) == [1024, 2048, 2944]
    for n in one_step:
        assert all(torch.equal(x, y) for x, y in zip(one_step[n], many_steps[n])), n
    # written, and each the state at its own position (a slot never written would be equal too: zeros)
    assert all(x.abs().sum() > 0 for x in one_step[1024])
    assert not torch.equal(one_step[1024][0], one_step[2048][0])

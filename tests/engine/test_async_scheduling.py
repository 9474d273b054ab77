"""Asynchronous scheduling (``async_scheduling=True``) gives exactly the outputs of synchronous scheduling: greedy
and seeded sampling, logprobs, many requests of different lengths, max_tokens of 1, stop tokens and EOS mid-batch,
aborts mid-stream, chunked prefill beside decodes, preemption in a small cache and prefix-cache hits; and it does
run steps ahead (a step launched with the previous one in flight)."""

from __future__ import annotations

import random
import time

import pytest

import flashinfra
from flashinfra import SamplingParams
from flashinfra.engine.sched.messages import EngineRequest
from flashinfra.model.factory import write_tiny_checkpoint
from tests.test_llm import fail_forward_call

# float32 on every device (the CPU's default; on CUDA the default is bfloat16, whose rounding of a row can change
# with the batch beside it by far more than ``assert_same`` allows)
ENGINE = dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, dtype="float32")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def pair(ckpt, **engine):
    """A synchronous and an asynchronous engine of one configuration."""
    args = {**ENGINE, **engine}
    return flashinfra.LLM(ckpt, **args), flashinfra.LLM(ckpt, async_scheduling=True, **args)


def count_ahead(llm, monkeypatch) -> list[int]:
    """A list that counts the steps launched while another was in flight."""
    runner, ahead = llm.engine.runner, []
    real = runner.launch

    def launch(plan, prev=None):
        ahead.extend([1] if prev is not None else [])
        return real(plan, prev)

    monkeypatch.setattr(runner, "launch", launch)
    return ahead


def assert_same(got, want, logprob_abs: float = 1e-4):
    """Same tokens, finish reasons and logprob records, their values to float32 rounding (``logprob_abs``): the two
    schedules fill a step's batch differently (a request finishing in the step in flight holds its seat one step
    longer), which may change the last bits of a row's logits on the CPU."""
    assert [(o.token_ids, o.finish_reason, o.error) for o in got] == [(o.token_ids, o.finish_reason, o.error)
                                                                       for o in want]
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or (), w.logprobs or ()):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=logprob_abs)


def workload(seed: int, n: int, max_len: int, vocab: int = 512, max_tokens: int = 9):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 3
        params.append(SamplingParams(
            max_tokens=rng.randrange(1, max_tokens), ignore_eos=True,
            temperature=0.0 if kind == 0 else 0.9, top_k=0 if kind < 2 else 20, seed=None if kind == 0 else 100 + i,
            logprobs=None if i % 2 else 2))
    return prompts, params


def test_mixed_lengths_greedy_seeded_logprobs_and_max_tokens_one(ckpt, monkeypatch):
    sync, ahead = pair(ckpt)
    launched = count_ahead(ahead, monkeypatch)
    prompts, params = workload(1, 14, 30)
    params[3] = SamplingParams(max_tokens=1, temperature=0.0)
    params[4] = SamplingParams(max_tokens=1, temperature=0.7, seed=9, logprobs=0)
    assert_same(ahead.generate(prompts, params), sync.generate(prompts, params))
    assert launched, "no step ran ahead"


def test_stop_tokens_and_eos_mid_batch(ckpt):
    sync, ahead = pair(ckpt)
    prompts, params = workload(2, 8, 20, max_tokens=12)
    free = [SamplingParams(max_tokens=12, temperature=p.temperature, seed=p.seed) for p in params]
    first = sync.generate(prompts, free)
    # stop each request on a token its free run emits in the middle: the step after it is computed and discarded
    stopping = [SamplingParams(max_tokens=12, temperature=p.temperature, seed=p.seed,
                               stop_token_ids=(o.token_ids[len(o.token_ids) // 2],) if o.token_ids else ())
                for p, o in zip(params, first)]
    want = sync.generate(prompts, stopping)
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 12 for o in want)
    assert_same(ahead.generate(prompts, stopping), want)
    assert_same(ahead.generate(prompts, free), first)  # EOS where the model emits it


def test_chunked_prefill_beside_decodes(ckpt, monkeypatch):
    sync, ahead = pair(ckpt, max_num_batched_tokens=16, max_prefill_chunk=8)
    launched = count_ahead(ahead, monkeypatch)
    prompts, params = workload(3, 10, 40)
    assert_same(ahead.generate(prompts, params), sync.generate(prompts, params))
    assert launched


def test_preemption_in_a_small_cache(ckpt, monkeypatch):
    sync, ahead = pair(ckpt, num_blocks=24, max_num_batched_tokens=48)
    launched = count_ahead(ahead, monkeypatch)
    prompts, params = workload(4, 8, 30, max_tokens=10)
    want = sync.generate(prompts, params)
    assert sync.engine.stats().num_preemptions_total > 0
    assert_same(ahead.generate(prompts, params), want)
    assert ahead.engine.stats().num_preemptions_total > 0 and launched


def test_prefix_cache_hits(ckpt):
    sync, ahead = pair(ckpt, prefix_checkpoint_interval=8)
    rng = random.Random(5)
    shared = [rng.randrange(10, 512) for _ in range(21)]
    prompts = [shared + [rng.randrange(10, 512) for _ in range(k)] for k in (1, 3, 6)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)] * 3
    for llm in (sync, ahead):
        llm.generate([shared + [11]], params[:1])  # registers the shared prefix
    assert_same(ahead.generate(prompts, params), sync.generate(prompts, params))
    assert ahead.engine.stats().num_prefix_hit_tokens_total > 0


def stream(llm, prompts, params, abort_after: dict[str, int]) -> dict[str, list]:
    """Every output each request receives from the engine, aborting request ``r`` once it has
    ``abort_after[r]`` tokens."""
    engine, got = llm.engine, {}
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(EngineRequest(f"r{i}", p, s, time.time()))
        got[f"r{i}"] = []
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].append((tuple(out.new_token_ids), out.finished, out.finish_reason))
            n = sum(len(t) for t, _, _ in got[out.request_id])
            if not out.finished and n == abort_after.get(out.request_id):
                engine.abort([out.request_id])
    return got


def test_aborts_mid_stream(ckpt):
    sync, ahead = pair(ckpt)
    prompts, params = workload(6, 6, 20, max_tokens=10)
    params = [SamplingParams(max_tokens=10, temperature=p.temperature, seed=p.seed, ignore_eos=True)
              for p in params]
    aborts = {"r1": 2, "r4": 5}
    want = stream(sync, prompts, params, aborts)
    assert want["r1"][-1] == ((), True, "abort") and sum(len(t) for t, _, _ in want["r1"]) == 2
    assert stream(ahead, prompts, params, aborts) == want
    sched = ahead.engine.scheduler
    assert not sched.requests and sched.cache.num_free_slots == sched.cache.num_slots


def test_a_failed_step_fails_only_its_requests(ckpt, monkeypatch):
    """The second forward pass (the first step launched ahead) fails: its requests end in an error after the
    token of the step before it, as synchronously; the engine goes on."""
    ahead = flashinfra.LLM(ckpt, async_scheduling=True, **ENGINE)
    model = ahead.engine.model
    real = fail_forward_call(monkeypatch, model, 2, ahead.engine.runner.graphs)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = ahead.generate([[5, 6, 7], [8, 9]], params)
    assert all(o.finish_reason == "error" and "device fault" in o.error and len(o.token_ids) == 1 for o in outs)
    monkeypatch.setattr(model, "forward", real)
    again = ahead.generate([[5, 6, 7]], params)[0]
    assert again.finish_reason == "length" and again.token_ids[:1] == outs[0].token_ids
    sched = ahead.engine.scheduler
    assert not sched.requests and sched.cache.num_free_slots == sched.cache.num_slots

"""Offline ``LLM`` on a tiny random checkpoint: batch invariance of greedy and seeded output (also under
preemption), agreement with a full recomputation, stops, logprobs, bad input, and fault isolation."""

from __future__ import annotations

import json
import random

import pytest
import torch

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


# the tests below compare a request alone with it in a batch: on the CPU every op is batch-invariant already, on a
# GPU that is what ``deterministic`` provides (bf16 kernels otherwise pick their splits by the batch)
INVARIANT = dict(deterministic=True) if torch.cuda.is_available() else {}


@pytest.fixture(scope="module")
def llm(ckpt):
    return flashinfra.LLM(ckpt, num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                          **INVARIANT)


def mixed_prompts(seed: int, n: int, max_len: int = 45, vocab: int = 512):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 6), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def alone(llm, prompts, params):
    return [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, params)]


@pytest.fixture(scope="module")
def mixed(llm):
    """Mixed-length greedy requests and what each generates when it runs alone."""
    prompts, params = mixed_prompts(0, 7, max_len=30)
    return prompts, params, alone(llm, prompts, params)


def test_greedy_alone_equals_in_a_mixed_batch(llm, mixed):
    prompts, params, solo = mixed
    batch = llm.generate(prompts, params)
    assert [o.token_ids for o in batch] == solo
    assert all(o.finish_reason == "length" and len(o.token_ids) == p.max_tokens for o, p in zip(batch, params))
    assert llm.engine.stats().num_preemptions_total == 0


def test_greedy_is_unchanged_when_a_tiny_cache_forces_preemption(mixed, ckpt, tmp_path):
    prompts, params, solo = mixed
    events = tmp_path / "events.jsonl"
    # scheduled synchronously: a step ahead never preempts (``test_async_scheduling`` covers preemption there)
    small = flashinfra.LLM(ckpt, num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=48,
                           events_path=str(events), async_scheduling=False, **INVARIANT)
    batch = small.generate(prompts, params)
    assert [o.token_ids for o in batch] == solo
    stats = small.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_blocks_free == 20 and stats.cache_usage == 0.0
    small.engine.events.close()
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert kinds.count("preempt") == stats.num_preemptions_total
    assert kinds.count("queue_wait") == len(prompts)
    assert kinds.count("step") == kinds.count("cache") > 0


def test_seeded_sampling_is_reproducible_in_any_batch(llm, ckpt, tmp_path):
    prompts, _ = mixed_prompts(2, 4, max_len=12)
    seeded = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    others = [SamplingParams(max_tokens=3, temperature=0.8, top_k=20, ignore_eos=True) for _ in range(3)]
    solo = llm.generate([prompts[0]], seeded)[0].token_ids
    batch = llm.generate(prompts, [seeded] + others)
    assert batch[0].token_ids == solo
    again = llm.generate(prompts[::-1], others + [seeded])
    assert again[-1].token_ids == solo
    # preempted and recomputed (5 blocks: the seeded request, admitted last, is the victim), a request
    # continues its own random stream
    events = tmp_path / "events.jsonl"
    small = flashinfra.LLM(ckpt, num_blocks=5, block_size=4, max_num_seqs=4, prefix_cache_slots=0,
                           events_path=str(events), **INVARIANT)
    outs = small.generate(prompts[1:] + prompts[:1], others + [seeded])
    assert outs[-1].token_ids == solo
    small.engine.events.close()
    preempted = [e["request_id"] for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "preempt"]
    assert outs[-1].request_id in preempted
    other_seed = llm.generate([prompts[0]], SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=43,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != solo


def test_greedy_continuation_matches_full_recomputation(llm):
    prompt = [11, 200, 37, 401, 99, 5, 300]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    seq = list(prompt)
    for i, tok in enumerate(out.token_ids):
        logits = llm.engine.model.logits([seq])[0][-1].double()
        lp = torch.log_softmax(logits, dim=-1)
        assert tok == int(logits.argmax())
        assert out.logprobs[i].token_id == tok
        assert out.logprobs[i].logprob == pytest.approx(float(lp[tok]), abs=1e-4)
        assert [t for t, _ in out.logprobs[i].top] == lp.topk(3).indices.tolist()
        seq.append(tok)


def test_stop_token_ids_eos_and_text(llm):
    prompt = "The capital of France is"
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert free.text == llm.decode(free.token_ids) and free.prompt_token_ids == llm.encode(prompt)
    stop = free.token_ids[2]
    cut = free.token_ids[: free.token_ids.index(stop) + 1]
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert out.token_ids == cut and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm, tmp_path):
    prompt = [20, 21, 22]
    toks = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    # the same weights (same seed) with the third greedy token declared EOS
    eos_ckpt = write_tiny_checkpoint(tmp_path, seed=0, eos_token_id=[toks[2]])
    eos_llm = flashinfra.LLM(eos_ckpt, num_blocks=64, block_size=4, max_num_seqs=2)
    out = eos_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.token_ids == toks[: toks.index(toks[2]) + 1] and out.finish_reason == "stop"
    ign = eos_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert ign.token_ids == toks and ign.finish_reason == "length"


def test_bad_input_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        llm.generate([[1, 2, 512]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([[1, 2]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="limit is"):
        llm.generate([[3] * 5000])
    assert not llm.engine.has_work()
    assert llm.engine.stats().num_blocks_free == llm.engine.stats().num_blocks_total


def test_a_sampling_fault_fails_only_that_request(llm, mixed, monkeypatch):
    from flashinfra.engine import runner as model_runner

    def poisoning(real):
        def poisoned(logits, rows, *args, **kwargs):  # NaN logits for the rows of requests seeded 666
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.seed == 666:
                    logits[i, 0] = float("nan")
            return real(logits, rows, *args, **kwargs)
        return poisoned

    for name in ("sample", "sample_batch"):  # sampled on the host, or on the device
        monkeypatch.setattr(model_runner, name, poisoning(getattr(model_runner, name)))
    prompts, params, solo = (x[:3] for x in mixed)
    bad = SamplingParams(max_tokens=3, temperature=1.0, seed=666)
    outs = llm.generate(prompts + [[7, 8, 9]], params + [bad])
    assert [o.token_ids for o in outs[:3]] == solo
    assert outs[3].finish_reason == "error" and "NaN" in outs[3].error and outs[3].token_ids == []


def fail_forward_call(monkeypatch, model, call: int, graphs=None):
    """The ``call``-th forward pass from now raises "device fault"; -> the real ``model.forward``. ``graphs``: the
    runner's ``DecodeGraphs`` (None on the CPU), whose replays are forward passes that do not call
    ``model.forward`` (their graphs were captured at start-up)."""
    real = model.forward
    calls = {"n": 0, "in_graph": False}

    def flaky(*args, **kwargs):
        if not calls["in_graph"]:  # a capture inside a replay call is that one pass
            calls["n"] += 1
            if calls["n"] == call:
                raise RuntimeError("device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    if graphs is not None:
        replay = graphs.run

        def flaky_replay(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                raise RuntimeError("device fault")
            calls["in_graph"] = True
            try:
                return replay(*args, **kwargs)
            finally:
                calls["in_graph"] = False

        monkeypatch.setattr(graphs, "run", flaky_replay)
    return real


def test_a_failed_forward_fails_that_step_and_the_engine_goes_on(llm, monkeypatch):
    model = llm.engine.model
    real = fail_forward_call(monkeypatch, model, 2, llm.engine.runner.graphs)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(o.finish_reason == "error" and "device fault" in o.error for o in outs)
    assert all(len(o.token_ids) == 1 for o in outs)
    monkeypatch.setattr(model, "forward", real)
    again = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert again.finish_reason == "length" and again.token_ids[:1] == outs[0].token_ids


def test_generate_command_prints_the_greedy_continuation(llm, ckpt, capsys):
    from flashinfra.cli import main

    assert main(["generate", "--model", str(ckpt), "--max-tokens", "5", "--device", "cpu", "The", "capital"]) == 0
    want = llm.generate("The capital", SamplingParams(max_tokens=5, temperature=0.0))[0].text
    assert capsys.readouterr().out == "The capital" + want + "\n"
    with pytest.raises(SystemExit, match="top_p"):
        main(["generate", "--model", str(ckpt), "--top-p", "0", "x"])


def test_prefix_cache_hits_give_the_cold_tokens(ckpt):
    rng = random.Random(5)
    system = [rng.randrange(10, 512) for _ in range(14)]
    prompts = [system + [rng.randrange(10, 512) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    cold = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, prefix_cache_slots=0)
    warm = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, prefix_checkpoint_interval=8)
    first = [o.token_ids for o in warm.generate(prompts, params)]
    assert first == [o.token_ids for o in cold.generate(prompts, params)]
    # a repeated prompt and a second conversation turn start from cached prefixes
    turn = prompts[0] + first[0] + [33, 44]
    follow = [prompts[1], turn]
    hits = warm.engine.stats().num_prefix_hit_tokens_total
    assert [o.token_ids for o in warm.generate(follow, params)] == [o.token_ids for o in cold.generate(follow, params)]
    assert warm.engine.stats().num_prefix_hit_tokens_total - hits >= 2 * 12
    assert cold.engine.stats().num_prefix_hit_tokens_total == 0


def test_deterministic_mode_same_tokens_alone_batched_chunked_and_from_the_prefix_cache(ckpt):
    """``deterministic=True``: greedy and seeded outputs are the same whatever runs beside them, whether the
    prompt is chunked at the token budget, hits the prefix cache, runs with prefix caching off or is preempted."""
    rng = random.Random(8)
    # batched, the 130-token prompt is cut at 64 (9 tokens of the budget gone), alone at 128
    prompts = [[rng.randrange(10, 512) for _ in range(n)] for n in (9, 130, 1)]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[0] = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    kw = dict(num_blocks=512, block_size=4, max_num_seqs=8, max_num_batched_tokens=128, deterministic=True)
    det = flashinfra.LLM(ckpt, prefix_checkpoint_interval=64, **kw)
    solo = alone(det, prompts, params)
    assert [o.token_ids for o in det.generate(prompts, params)] == solo  # prefix hits now
    assert det.engine.stats().num_prefix_hit_tokens_total > 0
    cold = flashinfra.LLM(ckpt, prefix_cache_slots=0, **kw)
    assert [o.token_ids for o in cold.generate(prompts, params)] == solo
    small = flashinfra.LLM(ckpt, prefix_cache_slots=0, **{**kw, "num_blocks": 36})
    assert [o.token_ids for o in small.generate(prompts, params)] == solo
    assert small.engine.stats().num_preemptions_total > 0
    with pytest.raises(ValueError, match="multiples of 64"):
        flashinfra.LLM(ckpt, **{**kw, "max_num_batched_tokens": 100})
